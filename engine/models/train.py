"""Train a small OLMoE-architecture model on text that ships with Python, so that its routing
has the structure real MoE models show (popular experts, cross-layer regularity, code versus
prose), entirely offline.

Data: the prose of `pydoc_data.topics` (general) and standard-library source (code), minus
every source an eval prompt is drawn from. Tokenizer: a byte-level BPE trained with
`tokenizers`. Both are deterministic for a seed. The model is mlx-lm's own `olmoe` class,
trained in float32 on whatever device MLX runs on (the small one on a CPU, the wide one on a
GPU) with OLMoE's load-balancing loss, then quantized with mlx-lm's `quantize_model` (4-bit
affine, group 64) and saved as every registered variant of it: `<id>` in its own dtype (float16,
as OLMoE itself is) and `<id>-f32` in float32 (CPU timing runs) where the registry names one.

Determinism: on the CPU a seed gives the same weights on every run. On a CUDA GPU it does not
quite: the scatter-adds of the expert dispatch (`.at[].add`) sum in an order the device's atomics
decide, so two runs differ in the last bits and drift apart over the steps; the data, tokenizer
and initial weights are still the seed's.
"""

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.utils import quantize_model
from tokenizers import Tokenizer

from ..config import resources_dir
from ..predict import corpus as text_corpus
from ..predict import prompts
from . import embedded, registry
from .anatomy import model_classes


def corpus(seed: int, code_bytes: int):
    """(general text, code text), deterministic; eval prompts' sources are left out."""

    held_out = {p["source"] for name in prompts.SETS for p in prompts.load(name, "eval")}
    general = "\n\n".join(text for name, text in text_corpus.pydoc_topics() if name not in held_out)
    files = [path for name, path in text_corpus.stdlib_sources() if name not in held_out]
    rng = np.random.default_rng(seed)
    rng.shuffle(files)
    chunks, total = [], 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        chunks.append(text)
        total += len(text)
        if total >= code_bytes:
            break
    return general, "\n\n".join(chunks)


def tokenize(tok, text: str) -> np.ndarray:
    lines = text.splitlines(keepends=True)
    ids = []
    for i in range(0, len(lines), 512):
        ids.extend(tok.encode("".join(lines[i : i + 512])).ids)
    return np.array(ids, np.int32)


def data(spec, work: Path):
    """Tokenizer and token streams; cached in `work`, with a digest of both."""

    tr = spec["training"]
    general, code = corpus(tr["seed"], tr["code_bytes"])
    work.mkdir(parents=True, exist_ok=True)
    embedded.train_tokenizer(spec["vocab"], work, general + "\n\n" + code)
    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    streams = {"general": tokenize(tok, general), "code": tokenize(tok, code)}
    h = hashlib.sha256((work / "tokenizer.json").read_bytes())
    for k in sorted(streams):
        h.update(streams[k].tobytes())
    return streams, h.hexdigest()


def batches(streams, seq: int, batch: int, steps: int, seed: int):
    """Random windows, half prose and half code in every batch (deterministic)."""
    rng = np.random.default_rng(seed + 1)
    names = sorted(streams)
    for _ in range(steps):
        rows = []
        for i in range(batch):
            s = streams[names[i % len(names)]]
            start = int(rng.integers(0, len(s) - seq - 1))
            rows.append(s[start : start + seq + 1])
        yield np.stack(rows)


def dispatch(glu, x, top, scores, capacity_factor=1.25):
    """The MoE layer for training: tokens grouped per expert into a fixed capacity and run as
    one batched matmul per projection (MLX's CPU gather_mm backward is far too slow to train
    with). Same weights, same SwiGLU, same score weighting as mlx-lm's OLMoE block; a token
    past an expert's capacity is dropped for that expert, as in Switch-style training."""

    N, D = x.shape
    K = top.shape[1]
    E = glu.gate_proj.weight.shape[0]
    C = max(1, int(N * K / E * capacity_factor))
    flat = top.reshape(-1)
    order = mx.argsort(flat)
    fs = flat[order]
    counts = mx.zeros((E,), mx.int32).at[flat].add(1)
    starts = mx.cumsum(counts) - counts
    pos = mx.arange(N * K) - starts[fs]
    slots = mx.where(pos < C, fs * C + pos, E * C)  # E * C: the overflow row, dropped
    tok = order // K
    xd = mx.zeros((E * C + 1, D), x.dtype).at[slots].add(x[tok])[: E * C].reshape(E, C, D)
    g = xd @ glu.gate_proj.weight.transpose(0, 2, 1)
    u = xd @ glu.up_proj.weight.transpose(0, 2, 1)
    y = (nn.silu(g) * u) @ glu.down_proj.weight.transpose(0, 2, 1)
    y = mx.concatenate([y.reshape(E * C, D), mx.zeros((1, D), y.dtype)])
    w = scores.reshape(-1)[order][:, None]
    return mx.zeros((N, D), y.dtype).at[tok].add(y[slots] * w)


def train(model_id: str, log_path=None):
    """Train `model_id` (an embedded spec with a `training:` block) and save both variants."""

    spec = registry.get_spec(model_id)
    tr = spec["training"]
    work = resources_dir() / "training" / model_id
    streams, data_digest = data(spec, work)
    mx.random.seed(tr["seed"])
    config = embedded.hf_config(dict(spec, dtype="float32"))
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    k, E = spec["top_k"], spec["experts"]

    def loss_fn(model, x, y):
        # The forward pass of mlx-lm's model, with each router's probabilities kept for
        # OLMoE's load-balancing loss: E * sum_e f_e * p_e per layer.
        h = model.model.embed_tokens(x)

        mask = create_attention_mask(h, None)
        aux = 0.0
        for layer in model.model.layers:
            h = h + layer.self_attn(layer.input_layernorm(h), mask, None)
            z = layer.post_attention_layernorm(h)
            zf = z.reshape(-1, z.shape[-1])
            probs = mx.softmax(layer.mlp.gate(zf), axis=-1, precise=True)
            top = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k])
            frac = mx.zeros((E,)).at[top.reshape(-1)].add(1.0) / top.size
            aux = aux + E * mx.sum(mx.stop_gradient(frac) * probs.mean(0))
            h = h + dispatch(layer.mlp.switch_mlp, zf, top, mx.take_along_axis(probs, top, axis=-1)).reshape(h.shape)
        logits = (
            model.model.embed_tokens.as_linear(model.model.norm(h))
            if model.args.tie_word_embeddings
            else model.lm_head(model.model.norm(h))
        )
        ce = nn.losses.cross_entropy(logits, y, reduction="mean")
        return ce + tr["balance"] * aux / len(model.model.layers), ce

    opt = optim.AdamW(learning_rate=schedule(tr), weight_decay=0.01)
    step_fn = nn.value_and_grad(model, loss_fn)
    curve = []
    t0 = time.time()
    for step, b in enumerate(batches(streams, tr["seq"], tr["batch"], tr["steps"], tr["seed"])):
        b = mx.array(b)
        (loss, ce), grads = step_fn(model, b[:, :-1], b[:, 1:])
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss, ce)
        curve.append(dict(step=step, loss=float(loss), cross_entropy=float(ce), seconds=time.time() - t0))
        if step % 10 == 0 or step == tr["steps"] - 1:
            print(
                f"[titan] train {model_id} step {step}/{tr['steps']} loss {float(loss):.3f} "
                f"ce {float(ce):.3f} {time.time() - t0:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    weights = dict(tree_flatten(model.parameters()))
    outs = {}
    for variant in variants(model_id):
        vspec = registry.get_spec(variant)
        outs[variant] = save_variant(weights, config, vspec, work, data_digest)
    return dict(
        curve=curve,
        data_digest=data_digest,
        outputs={k: str(v) for k, v in outs.items()},
        tokens_per_step=tr["seq"] * tr["batch"],
    )


def schedule(tr):
    """Cosine decay to a tenth of `lr`, after `warmup` steps of linear warm-up if given."""
    warm = tr.get("warmup", 0)
    decay = optim.cosine_decay(tr["lr"], max(1, tr["steps"] - warm), tr["lr"] * 0.1)
    if not warm:
        return decay
    return optim.join_schedules([optim.linear_schedule(tr["lr"] / warm, tr["lr"], warm), decay], [warm])


def variants(model_id: str) -> list:
    """What one training run writes: the float32 variant where the registry has one, then the model."""
    return [v for v in (model_id + "-f32", model_id) if v in registry.load_registry()]


def save_variant(weights, config, spec, work: Path, data_digest: str) -> Path:
    """Quantize float32 master weights as mlx-lm quantizes a checkpoint of spec's dtype."""

    dt = getattr(mx, spec["dtype"])
    cfg = dict(config, torch_dtype=spec["dtype"])
    model_class, args_class = model_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    model.load_weights([(k, v.astype(dt)) for k, v in weights.items()])
    with contextlib.redirect_stdout(io.StringIO()):
        model, qcfg = quantize_model(model, cfg, group_size=64, bits=4)
    cfg["quantization"] = cfg["quantization_config"] = qcfg["quantization"]
    out = resources_dir() / "models" / spec["id"]
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    params = dict(tree_flatten(model.parameters()))
    mx.eval(params)
    st = embedded._ST_DTYPES
    tensors = {
        k: (st[str(v.dtype).rsplit(".", 1)[-1]], tuple(v.shape), bytes(memoryview(mx.contiguous(v)).cast("B")))
        for k, v in params.items()
    }
    embedded.write_safetensors(tmp / "model.safetensors", tensors, {"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / f, tmp / f)
    manifest = dict(
        model=spec["id"],
        spec_digest=embedded.spec_digest(spec),
        builder_version=embedded.BUILDER_VERSION,
        data_digest=data_digest,
        files={f: embedded.sha256_file(tmp / f) for f in sorted(os.listdir(tmp))},
    )
    (tmp / embedded.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out
