"""The decode loop and what is said of a decode: per-step records, their summary, the split of
a token's time, and the one comparison of two runs' logits."""

import resource
import sys
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from ..device import device_indices
from .moe import StepStats, engine_layers


class MemoryWatch:
    """Memory while a decode runs. `peak_memory_bytes`: MLX's own peak (every array MLX holds:
    weights, slot tables, KV cache, activations), reset when the decode starts; `decode_memory_bytes`:
    how far that peak rose above what was allocated then (the KV cache and the activations of this
    decode alone, whatever else the process holds); `peak_rss_bytes`: the process's resident-set
    high-water mark (reset where Linux allows it, /proc/self/clear_refs)."""

    def __init__(self):
        mx.reset_peak_memory()
        self.start = int(mx.get_active_memory())
        self.rss_reset = _reset_rss_peak()

    def peaks(self) -> dict:
        peak = int(mx.get_peak_memory())
        return dict(peak_memory_bytes=peak, decode_memory_bytes=max(0, peak - self.start), peak_rss_bytes=_rss_peak())


def model_bytes(model) -> int:
    """What a model holds in memory: every parameter's bytes. For an engine model the experts'
    parameters are its slot tables, so this is the weights not offloaded plus the tables."""
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the VmHWM high-water mark to the current RSS
        return True
    except OSError:
        return False


def _rss_peak() -> int | None:
    """The resident set's high-water mark, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return int(peak if sys.platform == "darwin" else peak * 1024)


def expert_cache(model):
    """The ExpertCache of an engine model; None for plain mlx-lm."""
    layers = engine_layers(model)
    return layers[0]._cache if layers else None


def read_token(y: mx.array) -> int:
    """A decode's one read-back a token: its greedy choice."""
    return int(y.item())


def decode(model, prompt_ids, max_tokens: int, forced=None, keep_logits=False, eos_id=None, pipelined=False):
    """Greedy decoding: one prefill over the prompt, then `max_tokens` single-token steps.

    Works on an engine model and on plain mlx-lm alike. With `forced`, those tokens are fed
    instead of the model's own choices (teacher forcing, to compare two models step by step).
    Returns the generated tokens, one record per step (index 0 is the prefill) and, with
    `keep_logits`, the float32 logits of every step.

    `pipelined`: as mlx-lm's `generate_step` decodes, the next token's graph is built and queued
    (`mx.async_eval`) before this token is read back, so the host builds while the device
    computes; a step's `seconds` then run from one token's read-back to the next. Otherwise each
    step is built, then evaluated (`graph_s` and `eval_s` add up to the step: the device's time
    the host does not hide, and the host's the device does not).
    """
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be at least 0, not {max_tokens}")
    cache = make_prompt_cache(model)
    experts = expert_cache(model)
    memory = MemoryWatch()
    stats = experts.stats if experts is not None else StepStats()
    records, logits_out, tokens = [], [], []
    position = 0

    def call(inp):
        """Build one step's graph and hand it to the device (queued, or evaluated when not
        pipelined): its greedy token, logits, figures and host times."""
        nonlocal position
        if experts is not None:
            experts.begin_step(position, inp.shape[1])
        position += inp.shape[1]
        t0 = time.perf_counter()
        logits = model(inp, cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        t1 = time.perf_counter()
        kept = logits.astype(mx.float32) if keep_logits else None
        figures = stats.capture()  # what the host counted, and the device's counters as arrays
        queued = [a for a in (y, kept, *stats.pending(figures)) if a is not None]
        (mx.async_eval if pipelined else mx.eval)(queued)
        t2 = time.perf_counter()
        times = dict(graph_s=t1 - t0, queue_s=t2 - t1) if pipelined else dict(graph_s=t1 - t0, eval_s=t2 - t1)
        return dict(rows=inp.shape[1], y=y, kept=kept, figures=figures, times=times, start=t0)

    def next_input(step, y, tok):
        if forced is not None:
            return device_indices([[int(forced[step])]])
        if not pipelined:
            return device_indices([[tok]])
        # the device's token, never read back first; a view of a 16-byte block, so that its buffer
        # is not in MLX's CUDA small pool (slots.device_indices says why)
        return mx.pad(y, (0, 3))[:1][None]

    cur = call(device_indices(np.asarray(prompt_ids))[None])
    last = cur["start"]
    for step in range(max_tokens + 1):
        nxt = None
        if pipelined and step < max_tokens:
            nxt = call(next_input(step, cur["y"], None))
        t3 = time.perf_counter()
        tok = read_token(cur["y"])  # pipelined: the wait for this token while the next one runs
        t4 = time.perf_counter()
        if pipelined:
            cur["times"]["eval_s"] = t4 - t3
            seconds, last = t4 - last, t4
        else:
            seconds = sum(cur["times"].values())
        rec = dict(step=step, phase="prefill" if step == 0 else "decode", rows=cur["rows"], seconds=seconds)
        rec.update(cur["times"])
        rec.update(stats.figures(cur["figures"]))
        rec.update(memory.peaks())
        records.append(rec)
        if keep_logits:
            logits_out.append(np.array(cur["kept"])[0])
        if forced is not None:
            tok = int(forced[step])
        tokens.append(tok)
        if (eos_id is not None and tok == eos_id) or step == max_tokens:
            break
        cur = nxt if pipelined else call(next_input(step, cur["y"], tok))
    return tokens, records, logits_out


CALLS = ("graph_s", "queue_s", "eval_s")  # a step seen from the host (decode)
COUNTS = ("hits", "misses", "issued", "useful", "wasted", "late", "cancelled")
SECONDS = ("stall_s", "pread_s", "array_s", "install_s", "late_stall_s", "sync_s", "predict_s")


def totals(records) -> dict:
    """The decode steps' records (not the prefill's) added up: tokens, seconds, every counter."""
    dec = [r for r in records if r["phase"] == "decode"]
    out = dict(tokens=len(dec), seconds=sum(r["seconds"] for r in dec))
    for k in COUNTS + SECONDS + ("bytes_read", "many_rows") + CALLS:
        out[k] = sum(r.get(k, 0) for r in dec)
    for k in PEAKS:  # the prefill's too: a peak is of the whole decode
        vals = [r[k] for r in records if r.get(k) is not None]
        out[k] = max(vals) if vals else None
    return out


PEAKS = ("peak_memory_bytes", "decode_memory_bytes", "peak_rss_bytes")


def summarize(records) -> dict:
    """Decode-phase figures: tokens/s, hit rate, bytes, stall and synchronisation per token,
    prefetch counts, per-miss split. Takes per-step records or their `totals`."""
    t = records if isinstance(records, dict) else totals(records)
    n = t["tokens"]
    if not n:
        return {}
    out = dict(
        tokens=n,
        tok_s=n / t["seconds"],
        hits=t["hits"],
        misses=t["misses"],
        hit_rate=t["hits"] / (t["hits"] + t["misses"]) if t["hits"] + t["misses"] else None,
        bytes_read_per_token=t["bytes_read"] / n,
        stall_s_per_token=t["stall_s"] / n,
    )
    for k in ("issued", "useful", "wasted", "late", "cancelled"):
        out[k] = t[k]
    out["late_stall_s_per_token"] = t["late_stall_s"] / n
    for k in PEAKS:
        if t.get(k) is not None:
            out[k] = t[k]
    out["sync_s_per_token"] = t["sync_s"] / n
    out["predict_s_per_token"] = t["predict_s"] / n
    if t["misses"]:
        for k in ("pread_s", "array_s", "install_s", "stall_s"):
            out[f"per_miss_{k[:-2]}_ms"] = 1e3 * t[k] / t["misses"]
    return out


SPLIT = ("sync_s", "stall_s", "array_s", "install_s", "predict_s")


def time_split(records) -> dict:
    """Where a decode token's time goes, in ms per token: waiting at the host synchronisations
    (the device's compute up to each MoE layer, and the synchronisation itself), waiting for reads,
    making arrays or enqueueing copy kernels, installs, the predictor's host work (reading the MoE
    input back, predicting and issuing the reads), and the rest (the host building the graph)."""
    t = totals(records)
    if not t["tokens"]:
        return {}
    out = {k[:-2]: 1e3 * t[k] / t["tokens"] for k in SPLIT}
    total = 1e3 * t["seconds"] / t["tokens"]
    out["other"] = total - sum(out.values())
    out["total"] = total
    return out


def call_split(records) -> dict:
    """A decode token seen from the host, in ms: in the model call (`graph`: building the token's
    graph, and any synchronisation inside it), handing it to the device (`queue`, a pipelined
    decode's `mx.async_eval`) and waiting for it (`eval`: the step's evaluation, or a pipelined
    decode's wait for the token while the next one runs). With no synchronisation inside the call,
    `eval` is the device's time the host did not hide."""
    t = totals(records)
    if not t["tokens"]:
        return {}
    queued = any("queue_s" in r for r in records if r["phase"] == "decode")
    return {k[:-2]: 1e3 * t[k] / t["tokens"] for k in CALLS if k != "queue_s" or queued}


def max_abs_diff(a, b) -> float:
    """The largest |Δlogit| between two runs' per-step logits (0.0: bit-identical); NaN anywhere
    is a difference, never a match."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} steps of logits against {len(b)}")
    worst = 0.0
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            raise ValueError(f"logits of shape {x.shape} against {y.shape}")
        d = np.abs(x - y)
        if np.isnan(d).any():
            return float("inf")
        worst = max(worst, float(d.max()))
    return worst
