"""Gate B (`design`): the cost of the engine's building blocks, on synthetic experts of a
model's shape, and the activation-parity check on a real (embedded) model.

- slot write: one expert's nine tensors written into stacked buffers of S slots, in place
  (a read landing in slot memory) and through MLX (`buffer[slot] = array`, evaluated);
- kernels, per layer and token: a loop of per-expert `quantized_matmul`s, one `gather_qmm`
  over the slot table (mlx-lm's SwitchGLU), and restacking the selected experts per call;
- parity: max |logit difference| against mlx-lm of an unfused `up * sigmoid(gate) * gate`
  against mlx-lm's compiled SwiGLU.
"""

import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu
from mlx_lm.models.switch_layers import SwitchGLU

from engine import load, max_abs_diff
from engine.config import EngineConfig
from engine.models.registry import load_reference
from engine.runtime.loop import decode
from engine.runtime.moe import engine_layers
from engine.runtime.slots import SlotTable
from engine.runtime.store import TensorSpec

GROUP, BITS = 64, 4
# Gate B's two ways of writing a slot, by the paper's names for them: the store's bytes straight
# into the slot's memory through a host view, or an MLX array written into the slot.
HOST_VIEWS = {"inplace": True, "copy": False}
PARITY_PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"


def expert_tensors(hidden: int, width: int, dtype: str):
    """The nine tensors of one 4-bit expert: (name, shape, dtype) in store order."""
    shapes = {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
    specs, off = [], 0
    for proj, (out_d, in_d) in shapes.items():
        for part, shape, dt in (
            ("weight", (out_d, in_d * BITS // 32), "uint32"),
            ("scales", (out_d, in_d // GROUP), dtype),
            ("biases", (out_d, in_d // GROUP), dtype),
        ):
            n = int(np.prod(shape)) * (4 if dt in ("uint32", "float32") else 2)
            specs.append(TensorSpec(f"{proj}.{part}", shape, dt, off, n))
            off += n
    return specs


def _calls_per_sample(fn, sample_ms) -> int:
    """How many calls of `fn` one timed sample makes so that it lasts at least `sample_ms`
    (doubling, as timeit's autorange does): a single call of a few hundred microseconds on a GPU
    is at the mercy of one scheduling hiccup, and the claims' ranges are those samples' extremes."""
    n = 1
    while n < 1 << 16:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if 1e3 * (time.perf_counter() - t0) >= sample_ms:
            return n
        n *= 2
    return n


def _interleaved_ms(fns: dict, repeats, sample_ms=0.0) -> dict:
    """Each of `fns` timed in `repeats` samples after a warm-up, one sample of each per round in an
    order that rotates between rounds; a sample is the mean of as many calls as last `sample_ms`
    together (one call at 0). Per name: the median, min and max in ms a call."""
    names = list(fns)
    for n in names:
        fns[n]()  # warm-up
    calls = {n: _calls_per_sample(fns[n], sample_ms) for n in names}
    ts = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(calls[n]):
                fns[n]()
            ts[n].append(1e3 * (time.perf_counter() - t0) / calls[n])
    return {
        n: dict(ms=statistics.median(v), ms_min=min(v), ms_max=max(v), repeats=repeats, calls=calls[n])
        for n, v in ts.items()
    }


def _slot_writer(table, arrays, record, S, mode):
    """One expert's write into the next slot of `table` per call."""
    i = [0]

    def write():
        slot = (i[0] * 7) % S
        i[0] += 1
        if table.host_views:
            for d, r in zip(table.dests(slot), record):
                np.frombuffer(d, np.uint8)[:] = r
        else:
            table.install_arrays(slot, arrays)
            mx.eval(table.buffers)

    return write


def slot_write(hidden, width, dtype, slots_list, experts, repeats=20, seed=0, sample_ms=0.0):
    rng = np.random.default_rng(seed)
    specs = expert_tensors(hidden, width, dtype)
    nbytes = sum(t.nbytes for t in specs)
    record = [rng.integers(0, 255, t.nbytes, dtype=np.uint8) for t in specs]
    tables, writers = [], {}
    for S in slots_list:
        for mode in ("inplace", "copy"):
            table = SlotTable(0, experts, S, specs, host_views=HOST_VIEWS[mode])
            arrays = [mx.array(r).view(getattr(mx, t.dtype)).reshape(t.shape) for r, t in zip(record, specs)]
            mx.eval(arrays)
            tables.append(table)
            writers[S, mode] = _slot_writer(table, arrays, record, S, mode)
    timed = _interleaved_ms(writers, repeats, sample_ms)
    out = [
        dict(
            measure="slot_write",
            install=mode,
            slots=S,
            expert_bytes=nbytes,
            buffer_bytes=S * nbytes,
            gb_s=nbytes / t["ms"] / 1e6,
            **t,
        )
        for (S, mode), t in timed.items()
    ]
    tables.clear()
    mx.clear_cache()
    return out


def kernels(hidden, width, dtype, experts, top_k, repeats=20, seed=0, sample_ms=0.0):
    """Per layer, one token: loop of quantized_matmul vs gather_qmm vs restack+gather_qmm."""
    mx.random.seed(seed)
    dt = getattr(mx, dtype)
    glu = SwitchGLU(hidden, width, experts)
    nn.quantize(glu, GROUP, BITS)
    for p in (glu.gate_proj, glu.up_proj, glu.down_proj):
        p.scales, p.biases = p.scales.astype(dt), p.biases.astype(dt)
    mx.eval(glu.parameters())
    x = mx.random.normal((1, hidden)).astype(dt)
    idx = mx.array(np.random.default_rng(seed).choice(experts, top_k, replace=False)[None].astype(np.uint32))
    mx.eval(x, idx)
    sel = [int(e) for e in np.array(idx)[0]]

    def qmm(p, e, v):
        return mx.quantized_matmul(
            v, p.weight[e], p.scales[e], p.biases[e], transpose=True, group_size=GROUP, bits=BITS
        )

    def loop():
        outs = [qmm(glu.down_proj, e, swiglu(qmm(glu.gate_proj, e, x), qmm(glu.up_proj, e, x))) for e in sel]
        mx.eval(outs)

    def gather():
        mx.eval(glu(x, idx))

    def restack():
        sub = SwitchGLU(hidden, width, top_k)
        nn.quantize(sub, GROUP, BITS)
        for name in ("gate_proj", "up_proj", "down_proj"):
            src, dst = getattr(glu, name), getattr(sub, name)
            for part in ("weight", "scales", "biases"):
                dst[part] = mx.stack([src[part][e] for e in sel])
        mx.eval(sub(x, mx.arange(top_k, dtype=mx.uint32)[None]))

    timed = _interleaved_ms(
        {"loop_quantized_matmul": loop, "gather_qmm": gather, "restack_gather_qmm": restack}, repeats, sample_ms
    )
    return [dict(measure="kernel", variant=name, experts=experts, top_k=top_k, **t) for name, t in timed.items()]


class UnfusedSwiGLU(nn.Module):
    """up * sigmoid(gate) * gate as separate ops in the model's dtype (the paper's first try)."""

    def __call__(self, x, gate):
        return x * mx.sigmoid(gate) * gate


def parity(model_id: str, prompt: str, steps: int = 16):
    """Max |logit difference| against mlx-lm over a prefill and `steps` decode steps, with the
    engine's activation unfused and with mlx-lm's compiled SwiGLU."""
    ref, tok, spec = load_reference(model_id)
    ids = tok.encode(prompt)
    tokens, _, ref_logits = decode(ref, ids, steps, keep_logits=True)
    out = []
    for variant in ("compiled_swiglu", "unfused"):
        eng = load(model_id, EngineConfig())
        if variant == "unfused":
            for sw in engine_layers(eng.model):
                sw.glu.activation = UnfusedSwiGLU()
        _, _, logits = decode(eng.model, ids, steps, forced=tokens, keep_logits=True)
        eng.close()
        diff = max_abs_diff(ref_logits, logits)
        out.append(
            dict(
                measure="parity",
                variant=variant,
                model=model_id,
                dtype=spec["dtype"],
                steps=steps,
                max_abs_logit_diff=diff,
            )
        )
    return out
