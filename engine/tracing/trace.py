"""Routing traces: per token and MoE layer, the selected experts, the router probabilities and
the hidden state at the MoE input, recorded while a model runs over a prompt set.

A trace is one compressed `.npz` (float16 hidden states and probabilities, int16 experts) with
a JSON sidecar saying what was traced, with what and when (the experiments' harness stamps its
full provenance there instead); both live under the resources folder, in `traces/`.
"""

import datetime
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import versions
from ..config import resources_dir
from ..models import registry
from ..models.anatomy import expert_params, moe_blocks
from ..predict import prompts as prompt_sets
from ..runtime.loop import decode


class TraceError(ValueError):
    """A trace file that is missing, malformed, or from another model."""


class RecordingSwitchGLU(nn.Module):
    """Stands in for a switch module: records the MoE input, the router's probabilities (the
    softmax of a `gate` projection, as OLMoE and Qwen3-MoE compute them; zeros for routers of
    another form) and the selected experts, then runs the original."""

    def __init__(self, glu, gate, sink: list):
        super().__init__()
        self.glu, self.gate = glu, gate
        self._experts = expert_params(glu)[0][1].shape[0]
        self._sink = sink

    def _probs(self, x):
        logits = self.gate(x) if isinstance(self.gate, nn.Linear | nn.QuantizedLinear) else None
        if logits is None or logits.shape[-1] != self._experts:
            return mx.zeros((*x.shape[:-1], self._experts), mx.float32)
        return mx.softmax(logits, axis=-1, precise=True)

    def __call__(self, x, indices):
        probs = self._probs(x)
        d, k = x.shape[-1], indices.shape[-1]
        self._sink.append((x.reshape(-1, d), probs.reshape(-1, probs.shape[-1]), indices.reshape(-1, k)))
        return self.glu(x, indices)


@dataclass
class Trace:
    """Concatenated per-token arrays of one prompt set (T tokens over all prompts)."""

    experts: np.ndarray  # (T, L, K) int16, sorted per row
    probs: np.ndarray  # (T, L, E) float16
    hidden: np.ndarray  # (T, L, D) float16
    tokens: np.ndarray  # (T,) token ids
    prompt: np.ndarray  # (T,) index into meta["prompts"]
    decode: np.ndarray  # (T,) bool: produced by a decode step (else a prompt token)
    meta: dict

    @property
    def num_layers(self):
        return self.experts.shape[1]

    @property
    def num_experts(self):
        return self.probs.shape[2]

    def sequences(self):
        """Per prompt, the slice of rows in token order."""
        bounds = np.flatnonzero(np.diff(self.prompt)) + 1
        starts = np.concatenate([[0], bounds])
        ends = np.concatenate([bounds, [len(self.prompt)]])
        return [slice(int(a), int(b)) for a, b in zip(starts, ends)]


def record(model, ids, tokens: int):
    """Run `model` greedily over `ids` and `tokens` more; returns per-row arrays of one prompt."""
    sinks, blocks = [], moe_blocks(model)
    for b in blocks:
        sink = []
        sinks.append(sink)
        setattr(b.parent, b.attr, RecordingSwitchGLU(b.switch, getattr(b.parent, "gate", None), sink))
    try:
        out, _, _ = decode(model, ids, tokens)
    finally:
        for b in blocks:
            setattr(b.parent, b.attr, b.switch)
    per_layer = []
    for sink in sinks:
        xs, ps, ks = zip(*sink)
        per_layer.append(
            (
                np.concatenate([np.array(x.astype(mx.float32)) for x in xs]),
                np.concatenate([np.array(p.astype(mx.float32)) for p in ps]),
                np.concatenate([np.array(k) for k in ks]),
            )
        )
    hidden = np.stack([p[0] for p in per_layer], 1).astype(np.float16)
    probs = np.stack([p[1] for p in per_layer], 1).astype(np.float16)
    experts = np.sort(np.stack([p[2] for p in per_layer], 1), axis=-1).astype(np.int16)
    # Rows: the prompt's tokens, then the tokens fed back by decode steps. The last generated
    # token is never fed back, so T = len(ids) + tokens.
    toks = np.array(list(ids) + out[:-1], np.int32)
    assert len(toks) == len(hidden), (len(toks), len(hidden))
    is_decode = np.arange(len(toks)) >= len(ids)
    return dict(experts=experts, probs=probs, hidden=hidden, tokens=toks, decode=is_decode, generated=out)


def trace_path(model_id: str, prompt_set: str, split: str, tokens: int) -> Path:
    return resources_dir() / "traces" / model_id / f"{prompt_set}-{split}-t{tokens}.npz"


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def basic_stamp(result: dict, *, command, seed, config, started, **extra) -> dict:
    """A trace's metadata where no fuller provenance is given: what, with which versions, when."""
    return dict(
        command=" ".join(command),
        versions=versions.versions(),
        seed=seed,
        config=config,
        started_utc=started,
        finished_utc=utc_now(),
        **extra,
        result=result,
    )


def run(model_id: str, prompt_set: str, split: str, tokens: int = 32, out=None, limit=None, stamp=None) -> Path:
    """Trace a model over a prompt set's split; writes the .npz and its .json sidecar, made by
    `stamp` (same signature as `basic_stamp`, the default)."""
    stamp = stamp or basic_stamp
    started = utc_now()
    model, tok, spec, _ = registry.load(model_id)
    rows = prompt_sets.load(prompt_set, split)[:limit]
    parts = []
    for i, p in enumerate(rows):
        r = record(model, tok.encode(p["text"]), tokens)
        r["prompt"] = np.full(len(r["tokens"]), i, np.int32)
        parts.append(r)
        print(f"\r[titan] trace {model_id} {prompt_set}/{split}: {i + 1}/{len(rows)}", end="", file=sys.stderr)
    print(file=sys.stderr)
    out = Path(out or trace_path(model_id, prompt_set, split, tokens))
    out.parent.mkdir(parents=True, exist_ok=True)
    arrays = {
        k: np.concatenate([p[k] for p in parts]) for k in ("experts", "probs", "hidden", "tokens", "prompt", "decode")
    }
    meta = stamp(
        dict(rows=int(len(arrays["tokens"])), prompts=[p["id"] for p in rows]),
        command=sys.argv,
        seed=spec.get("seed"),
        started=started,
        config=dict(model=model_id, prompt_set=prompt_set, split=split, tokens=tokens),
        model=model_id,
        revision=spec.get("revision"),
    )
    tmp = out.with_name(out.stem + f".tmp-{os.getpid()}.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, out)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    return out


def load(path) -> Trace:
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such trace (record it with `python -m engine trace`)")
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        with np.load(path) as z:
            arrays = {k: z[k] for k in ("experts", "probs", "hidden", "tokens", "prompt", "decode")}
    except (OSError, ValueError, KeyError) as e:
        raise TraceError(f"{path}: malformed trace ({e})") from None
    T = len(arrays["tokens"])
    for k, a in arrays.items():
        if len(a) != T:
            raise TraceError(f"{path}: array {k!r} has {len(a)} rows, expected {T}")
    return Trace(meta=meta, **arrays)
