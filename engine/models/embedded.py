"""Embedded models: built locally and deterministically in mlx-lm's on-disk format.

The model is instantiated with mlx-lm's own class (`olmoe`, `qwen3_moe`) and quantized with
mlx-lm's own `quantize_model` (4-bit affine, group 64, the model's own predicate), all lazily:
only shapes are taken from it. Every parameter is then generated directly from (seed, name):
random packed 4-bit integers with bounded scales and biases, which is what makes the
full-size shape buildable in minutes (sampling float weights and quantizing them is not).
Files are written by hand (sorted tensors, fixed offsets) so that the same spec and seed give
byte-identical files.
"""

import contextlib
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..config import build_lock, disk_short, progress
from ..predict import corpus
from .anatomy import model_classes

BUILDER_VERSION = 1
MANIFEST = "titan-build.json"
SHARD_BYTES = 1 << 30
EOS = "<|endoftext|>"


class BuildError(ValueError):
    """An embedded model folder that cannot be used or built as asked."""


_ST_DTYPES = {"uint8": "U8", "uint32": "U32", "float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def hf_config(spec) -> dict:
    """The config.json that mlx-lm reads, for an embedded spec: its `config` (the architecture's
    own ModelArgs fields) when it has one, else OLMoE's or Qwen3-MoE's from the spec's fields."""
    if "config" in spec:
        cfg = dict(spec["config"], model_type=spec["architecture"], vocab_size=spec["vocab"],
                   torch_dtype=spec["dtype"], eos_token_id=0)  # fmt: skip
        if isinstance(cfg.get("text_config"), dict):  # e.g. llama4: the language model's own args
            cfg["text_config"] = dict(cfg["text_config"], vocab_size=spec["vocab"])
        return cfg
    common = dict(
        hidden_size=spec["hidden"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec.get("kv_heads", spec["heads"]),
        num_experts=spec["experts"],
        num_experts_per_tok=spec["top_k"],
        vocab_size=spec["vocab"],
        max_position_embeddings=4096,
        tie_word_embeddings=spec.get("tie_word_embeddings", False),
        torch_dtype=spec["dtype"],
        eos_token_id=0,
    )
    if spec["architecture"] == "olmoe":
        return dict(
            common,
            model_type="olmoe",
            architectures=["OlmoeForCausalLM"],
            intermediate_size=spec["expert_width"],
            norm_topk_prob=spec.get("norm_topk_prob", False),
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            **({"head_dim": spec["head_dim"]} if "head_dim" in spec else {}),
        )
    return dict(
        common,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        intermediate_size=spec.get("dense_width", 4 * spec["hidden"]),
        moe_intermediate_size=spec["expert_width"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        head_dim=spec.get("head_dim", spec["hidden"] // spec["heads"]),
        norm_topk_prob=spec.get("norm_topk_prob", True),
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    )


def spec_digest(spec) -> str:
    keep = {k: v for k, v in spec.items() if k not in ("description", "id", "source", "mirrors")}  # not what
    blob = json.dumps({"spec": keep, "builder": BUILDER_VERSION}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def _lazy(config, mode="affine", dtype=None):
    """mlx-lm's model of `config`, quantized as a build quantizes it, every parameter lazy (nothing
    is computed or allocated, whatever its size): (model, its quantized config). `dtype`: the
    floats' dtype, as the build writes them (None: the class's own)."""
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight
        if mode == "affine":
            return quantize_model(model, config, group_size=64, bits=4)
        # the mode's own group size and bits (mxfp4: 32, 4)
        return quantize_model(model, config, group_size=None, bits=None, mode=mode)


def skeleton(spec):
    """The model a build of `spec` writes, without its weights: its parameters' shapes and dtypes
    as a load of the built folder has them, none computed. What a memory plan reads
    (engine.memory), in seconds, for a model of any size, built or not."""
    config = hf_config(spec)
    return _lazy(config, spec.get("quantization_mode", "affine"), spec["dtype"])[0]


def _shapes(config, mode="affine"):
    """Parameter names, shapes, dtypes and quantization of mlx-lm's model, built lazily."""

    model, qconfig = _lazy(config, mode)
    quant = {}
    for name, mod in model.named_modules():
        if "scales" in mod and "weight" in mod:
            in_dims = mod.scales.shape[-1] * mod.group_size
            quant[name] = (mod.bits, mod.group_size, in_dims, type(mod).__name__, getattr(mod, "mode", "affine"))
    params = [(k, tuple(v.shape), v.dtype) for k, v in tree_flatten(model.parameters())]
    del model
    mx.clear_cache()
    return params, quant, qconfig


def _rng(seed, name):
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _generate(name, shape, quant, seed, dtype):
    """One parameter as a NumPy array (float32 for float tensors, cast later)."""
    rng = _rng(seed, name)
    owner, _, leaf = name.rpartition(".")
    quantized = owner in quant
    if quantized and quant[owner][4] != "affine":  # microscaling: packed fp4 codes, E8M0 scales
        if leaf == "weight":
            return rng.integers(0, 1 << 32, size=shape, dtype=np.uint32)
        if leaf == "scales":
            return rng.integers(119, 124, size=shape, dtype=np.uint8)  # 2**-8 .. 2**-4
        quantized = False  # the layer's own bias: an ordinary float tensor
    if quantized:
        bits, _, in_dims, cls, _ = quant[owner]
        # Embedding rows are normalised downstream; projections keep unit-scale activations.
        target = 1.0 if cls == "QuantizedEmbedding" else in_dims**-0.5
        levels = (1 << bits) - 1
        if leaf == "weight":
            return rng.integers(0, 1 << 32, size=shape, dtype=np.uint32)
        base = target / ((levels + 1) / 12**0.5)
        scales = base * rng.uniform(0.8, 1.2, size=shape)
        if leaf == "scales":
            return scales.astype(np.float32)
        # biases centre each group: w = s*q + b with q uniform in [0, levels]
        jitter = _rng(seed, name + "#jitter").uniform(-0.5, 0.5, size=shape)
        s = _generate(owner + ".scales", shape, quant, seed, dtype)
        return (-s * (levels / 2 + jitter)).astype(np.float32)
    if leaf == "weight" and len(shape) == 1:  # norms
        return np.ones(shape, np.float32)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return rng.normal(0.0, fan_in**-0.5, size=shape).astype(np.float32)


def _stored_bytes(shape, dt, dtype: str) -> int:
    """A parameter's bytes on disk: packed integers as they are, floats in the model's dtype."""
    stored = str(dt).rsplit(".", 1)[-1]
    size = dt.size if stored in ("uint32", "uint8") else (4 if dtype == "float32" else 2)
    return int(np.prod(shape)) * size


def _tensor_bytes(arr, dtype):
    """Raw little-endian bytes of a parameter in the model's dtype."""

    if arr.dtype in (np.uint32, np.uint8):
        return arr.tobytes()
    a = mx.array(arr).astype(getattr(mx, dtype))
    mx.eval(a)
    return bytes(memoryview(a).cast("B"))


def write_safetensors(path, tensors, metadata=None):
    """Write {name: (st dtype, shape, bytes)} with sorted names and contiguous offsets."""
    header, off = {}, 0
    for name in sorted(tensors):
        st, shape, raw = tensors[name]
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            f.write(tensors[name][2])


def _groups(params):
    """Split parameters into shards: top-level tensors first, then whole layers, <= SHARD_BYTES."""

    def layer_of(name):
        parts = name.split(".")
        return int(parts[2]) if name.startswith("model.layers.") else -1

    by_layer = {}
    for p in params:
        by_layer.setdefault(layer_of(p[0]), []).append(p)
    shards, cur, size = [], [], 0
    for layer in sorted(by_layer):
        group = by_layer[layer]
        nbytes = sum(int(np.prod(s)) * d.size for _, s, d in group)
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur += group
        size += nbytes
    shards.append(cur)
    return shards


def corpus_text() -> str:
    """Prose that ships with Python: the topics of the interactive help, in a fixed order."""

    return "\n\n".join(text for _, text in corpus.pydoc_topics())


def train_tokenizer(vocab_size: int, out: Path, text: str | None = None):
    """A byte-level BPE trained locally with `tokenizers`; deterministic for fixed text."""

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_text() if text is None else text
    lines = text.splitlines()
    tok.train_from_iterator((lines[i : i + 256] for i in range(0, len(lines), 256)), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "bos_token": None,
                "pad_token": EOS,
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
            sort_keys=True,
        )
    )
    return tok.get_vocab_size()


def _plan(spec):
    """(config.json, the quantized layers, the files' parameters, each file's bytes) of a build."""
    config = hf_config(spec)
    params, quant, qconfig = _shapes(config, spec.get("quantization_mode", "affine"))
    config["quantization"] = qconfig["quantization"]
    config["quantization_config"] = qconfig["quantization"]
    shards = _groups(params)
    need = [sum(_stored_bytes(shape, dt, spec["dtype"]) for _, shape, dt in shard) for shard in shards]
    return config, quant, shards, need


def planned_bytes(spec) -> int:
    """The bytes of weights a build of `spec` writes (nothing is built: shapes only)."""
    return sum(_plan(spec)[3])


def build(spec, out: Path):
    """Build an embedded model into `out` (atomically: a temporary folder, then a rename)."""
    out = Path(out)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config, quant, shards, need = _plan(spec)
        n = len(shards)
        short = disk_short(out.parent, sum(need))
        if short is not None:
            raise BuildError(f"{short} to build '{spec['id']}' ({sum(need) / 1e9:.2f} GB of weights in {n} files); "
                             "free space there or set TITAN_RESOURCES to a larger disk")  # fmt: skip
        files, start = {}, time.perf_counter()
        progress(spec["id"], 0, n, 0, sum(need), 0.0)  # what it will write, before it starts
        for i, shard in enumerate(shards):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            tensors = {}
            for pname, shape, dt in shard:
                stored = str(dt).rsplit(".", 1)[-1]
                dtype = stored if stored in ("uint32", "uint8") else spec["dtype"]
                raw = _tensor_bytes(_generate(pname, shape, quant, spec["seed"], dtype), dtype)
                tensors[pname] = (_ST_DTYPES[dtype], shape, raw)
            write_safetensors(tmp / name, tensors, {"format": "mlx"})
            files[name] = sorted(tensors)
            progress(spec["id"], i + 1, n, sum(need[: i + 1]), sum(need), time.perf_counter() - start)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        train_tokenizer(spec["vocab"], tmp)
        manifest = {
            "model": spec["id"],
            "spec_digest": spec_digest(spec),
            "builder_version": BUILDER_VERSION,
            "files": {f: sha256_file(tmp / f) for f in sorted(os.listdir(tmp))},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        for f in os.listdir(tmp):
            fd = os.open(tmp / f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
        record_verified(out, manifest["files"])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def record_verified(folder, files: dict):
    """What a build has just hashed, as found good by this process (verify_files' record)."""
    folder = Path(folder)
    for name, sha in files.items():
        _HASHED.add(_identity(folder / name, sha))


def git_blob_sha1(path) -> str:
    """git's id of a file's content (how the Hugging Face cache names the blobs of small files)."""
    return git_blob_sha1_of(Path(path).read_bytes())


def git_blob_sha1_of(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def check_or_build(spec, out: Path, allow_build: bool = True):
    """Build `out` if absent; refuse a folder built from another spec (nothing is deleted)."""
    manifest = Path(out) / MANIFEST
    if not manifest.exists():
        with build_lock(out):
            if not manifest.exists():  # another process may have built it while we waited
                return _build_missing(spec, out, allow_build)
    return _check_digest(spec, out, manifest)


def _build_missing(spec, out: Path, allow_build: bool):
    if Path(out).exists():
        raise BuildError(f"{out} exists but holds no {MANIFEST}: not an embedded build; move it away")
    if "training" in spec:
        base = spec["id"].removesuffix("-f32")
        raise BuildError(
            f"model '{spec['id']}' is trained, not built: run `snakemake --cores 2 train` "
            f"or `python -m engine train {base}` (about 20 minutes on 2 cores)"
        )
    if not allow_build:
        raise BuildError(f"model '{spec['id']}' is not built; run `python -m engine build {spec['id']}`")
    print(f"[titan] building embedded model {spec['id']} into {out} ...", file=sys.stderr, flush=True)
    return build(spec, out)


def _check_digest(spec, out: Path, manifest: Path):
    try:
        m = json.loads(manifest.read_text())
        digest, files = m["spec_digest"], m["files"]
    except (ValueError, KeyError) as e:
        raise BuildError(f"{manifest}: malformed build manifest ({e})") from None
    if digest != spec_digest(spec):
        raise BuildError(
            f"{out} was built from another spec of '{spec['id']}' than the registry now gives; "
            f"rebuild it with `python -m engine build {spec['id']} --force`"
        )
    how = f"rebuild it with `python -m engine build {spec['id']} --force`"
    if "training" in spec:
        how = f"train it again with `python -m engine train {spec['id'].removesuffix('-f32')}`"
    verify_files(out, files, how)
    return out


# The files this process has hashed and found good, as (path, size, mtime, inode, digest): a file
# is hashed by content the first time a process loads it, so that a byte changed under a kept
# size and modification time (bit rot keeps both) is caught at the next process's load; within a
# process, a file whose identity is unchanged is not hashed again.
_HASHED: set[tuple] = set()


def _identity(path: Path, sha: str, st=None) -> tuple:
    st = st or path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, sha)


def verify_files(folder, want: dict, how: str, force: bool = False):
    """Check every file of `want` ({name: sha256, or a 40-hex git blob id as the Hugging Face cache
    names small files}) in `folder`: present, and its digest the expected one. Each file is hashed
    the first time this process checks it, and again only once its size, modification time or
    inode changes (`force`: hash every file now). Raises BuildError naming the damaged file."""
    folder = Path(folder)
    for name, sha in sorted(want.items()):
        path = folder / name
        try:
            st = path.stat()
        except FileNotFoundError:
            raise BuildError(f"{path}: missing (the build wrote it): {how}") from None
        key = _identity(path, sha, st)
        if not force and key in _HASHED:
            continue
        got = sha256_file(path) if len(sha) == 64 else git_blob_sha1(path)
        if got != sha:
            kind = "sha256" if len(sha) == 64 else "git blob id"
            raise BuildError(
                f"{path}: damaged: its {kind} is {got[:16]}..., expected {sha[:16]}... ({st.st_size} bytes now): {how}"
            )
        _HASHED.add(key)
