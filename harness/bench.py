"""Engine-core benchmarks (`python -m harness bench ...`), each measured side by side in one run:

- `throughput`: decode tokens/s of the engine at S = E (and optional smaller S) against plain
  mlx-lm on the same model, prompt and loop, interleaved;
- `miss`: the per-miss cost of the engine's read path against a raw `os.preadv` of the same
  bytes into a preallocated buffer;
- `install`: the cost of installing one expert into a table of 8 and of 64 slots;
- `prefill`, `batch`: many rows through a layer at once (harness.manyrows).

Speed is reported, never asserted: the machines are noisy.
"""

import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from engine import api, device, load
from engine.arguments import at_most, memory_size, positive, probability
from engine.config import EngineConfig
from engine.models import registry
from engine.predict import prompts
from engine.predict.predictors import FITTED
from engine.runtime import installs
from engine.runtime.engine import build_cache, open_store
from engine.runtime.installs import records_to_mx
from engine.runtime.loop import call_split, decode, model_bytes, summarize, time_split, totals
from engine.runtime.slots import SlotTable
from engine.runtime.store import aligned_empty
from engine.tracing import trace

from . import families, manyrows, provenance, rawlog, servebench
from .design import HOST_VIEWS
from .report.tables.common import paired

DEFAULT_MODEL = {"throughput": "olmoe-tiny-f32", "prefetch": "olmoe-tiny-f32", "serve": "olmoe-tiny-f32"}
# --overlap: the settings to run (None: the engine's default for the install, Install.overlap_default)
OVERLAPS = {"auto": [None], "on": [True], "off": [False], "both": [True, False]}


def model_of(a) -> str:
    return a.model or DEFAULT_MODEL.get(a.which, "olmoe-1b-7b-shape")


def add_args(p):
    p.add_argument(
        "which", choices=["throughput", "miss", "install", "prefetch", "serve", "prefill", "batch", "families", "plan"]
    )
    p.add_argument(
        "--model",
        default=None,
        help="model id (default: olmoe-tiny-f32 for throughput, olmoe-1b-7b-shape for miss/install)",
    )
    p.add_argument("--tokens", type=positive, default=32, help="throughput: tokens per decode")
    p.add_argument(
        "--prompt-tokens",
        type=positive,
        default=None,
        help="throughput: a prompt of this many tokens, the --set eval prompts joined "
        "(default: one sentence); its prefill is measured too",
    )
    p.add_argument("--repeats", type=at_most(1000), default=5, help="interleaved repetitions (1..1000)")
    p.add_argument("--slots", type=positive, nargs="*", default=[], help="throughput: also run the engine at these S")
    p.add_argument("--tier", choices=["page_cache", "cold"], default="page_cache")
    p.add_argument(
        "--installs",
        nargs="*",
        default=None,
        choices=installs.CHOICES,
        help="throughput, prefill, batch: install modes to run each --slots at (default: auto)",
    )
    p.add_argument(
        "--lengths",
        type=positive,
        nargs="+",
        default=[128, 512, 2048, 8192],
        help="prefill: prompt lengths in tokens (each capped at the model's context)",
    )
    p.add_argument("--batches", type=at_most(256), nargs="+", default=[1, 4, 16], help="batch: sequences at once")
    p.add_argument(
        "--area-ahead",
        choices=list(manyrows.AHEAD),
        default="auto",
        help="prefill, batch: with the device install, copy the next layer's area during a prompt's "
        "layer (on, suffix /ahead), only the rows' experts, layer by layer (off, suffix /union), "
        "both, or the engine's default (auto)",
    )
    p.add_argument(
        "--resident",
        choices=["auto", "yes", "no"],
        default="auto",
        help="throughput: also decode the whole model resident (mlx-lm and the engine at S = E); "
        "auto: only where its weights fit in three quarters of this machine's memory",
    )
    p.add_argument(
        "--overlap",
        choices=list(OVERLAPS),
        default="auto",
        help="throughput: start each MoE layer's compute at once (on), only at the next sync "
        "(off, suffix /serial), or run both; prefetch: with the device install, a prefetch on a stream of "
        "its own (on) or on the decode stream (off, suffix /serial), or both; auto: the engine's default "
        "(on for the host installs, the decode stream for the device install)",
    )
    p.add_argument(
        "--install",
        default="auto",
        choices=installs.CHOICES,
        help="prefetch: install mode of every engine",
    )
    p.add_argument(
        "--loop",
        choices=["engine", "mlx-lm"],
        default="engine",
        help="throughput: decode with the engine's loop (one evaluation a token, the time split) or "
        "mlx-lm's own generate_step (the next token's graph built while this one computes)",
    )
    p.add_argument("--readers", type=positive, nargs="+", default=[1, 4], help="miss: reader-thread counts to measure")
    p.add_argument(
        "--batch",
        type=positive,
        nargs="+",
        default=[1, 8],
        help="miss: experts per batch (1: a lone miss, the common case at decode)",
    )
    p.add_argument(
        "--predictors",
        nargs="*",
        default=["oracle", "probe", "transition", "popularity", "previous"],
        help="prefetch: predictors to run beside demand loading",
    )
    p.add_argument("--depths", type=positive, nargs="+", default=[1, 2, 3], help="prefetch: depths")
    p.add_argument("--prompts", type=positive, default=4, help="prefetch: eval prompts of --set to decode")
    p.add_argument(
        "--set", choices=["general", "code"], default="general", help="prefetch, --prompt-tokens: prompt set"
    )
    p.add_argument(
        "--min-probs",
        type=probability,
        nargs="+",
        default=[0.0],
        help="prefetch: confidence floors to run each fitted predictor at (0: its whole top-k set)",
    )
    p.add_argument("--clients", type=at_most(256), default=8, help="serve: clients at once (1..256)")
    p.add_argument("--requests", type=at_most(1000), default=2, help="serve: completions each client asks, one by one")
    p.add_argument(
        "--fractions",
        type=probability,
        nargs="+",
        default=[0.125, 0.25, 0.5],
        help="families: slot counts holding these fractions of each layer's experts",
    )
    p.add_argument(
        "--budgets",
        type=memory_size,
        nargs="*",
        default=None,
        help="families: memory budgets (a card's memory) to decode each family at (default: 8, 16 and 24 GB); "
        "plan: the budgets to plan each family for (default: cards of 8 to 80 GB)",
    )
    p.add_argument(
        "--families",
        nargs="+",
        default=None,
        help="families: the models to run, each in a process of its own (default: every shape that mirrors a "
        "real checkpoint, and olmoe-1b-7b-shape); --model: one, in this process",
    )
    p.add_argument(
        "--clean", action="store_true", help="families: remove each family's model and store once it is recorded"
    )
    p.add_argument(
        "--exactness",
        action="store_true",
        help="families: run each family's full-size exactness test (tests/test_exactness.py) on the built model "
        "and record its outcome",
    )
    p.add_argument(
        "--record", action="store_true", help="also write the result as a raw record under results/raw/bench/<which>/"
    )


def _median(xs):
    return statistics.median(xs)


def _spread(xs) -> dict:
    return dict(median=_median(xs), min=min(xs), max=max(xs), n=len(xs))


def throughput(a):
    """Engine at S = E and at each --slots (per --installs) against plain mlx-lm, interleaved:
    every repetition runs each configuration once, in a rotating order."""

    mid = model_of(a)
    resident, why = resident_fits(mid, getattr(a, "resident", "auto"))
    if not resident and not a.slots:
        raise SystemExit(f"bench throughput: {why}, and no --slots were given: nothing to measure")
    if resident:
        ref, tok, spec = registry.load_reference(mid)
        engines = {"S=E": load(mid, EngineConfig())}
    else:
        print(f"[titan] {mid}: no resident decoding ({why})", file=sys.stderr, flush=True)
        tok = registry.load(mid, lazy=True)[1]
        engines = {}
    ids = prompt_ids(tok, a.prompt_tokens, a.set)  # before the offloaded engines load: a bad option wastes little
    installs = a.installs or ["auto"]
    overlaps = OVERLAPS[a.overlap]
    for s in a.slots:
        for inst in installs:
            for ov in overlaps:
                key = f"S={s}" + ("" if len(installs) == 1 else f"/{inst}") + ("/serial" if ov is False else "")
                engines[key] = load(mid, EngineConfig(slots=s, tier=a.tier, install=inst, overlap=ov))
    models = {**({"mlx-lm": ref} if resident else {}), **{k: e.model for k, e in engines.items()}}
    runs = {k: [] for k in models}
    prefill = {k: [] for k in models}  # each run's prefill: (tok/s, bytes read)
    splits = {k: [] for k in models}
    grown = dict.fromkeys(models, 0)
    for m in models.values():  # warm-up: first-call compilation
        decode(m, ids, 4)
    names = list(models)
    loop = getattr(a, "loop", "engine")
    for i in range(a.repeats):
        for k in names[i % len(names) :] + names[: i % len(names)]:
            if loop == "mlx-lm":
                tok_s, prefill_s, grew = pipelined(models[k], ids, a.tokens)
                runs[k].append(tok_s)
                prefill[k].append((len(ids) / prefill_s, None))
                grown[k] = max(grown[k], grew)
                continue
            recs = decode(models[k], ids, a.tokens)[1]
            runs[k].append(summarize(recs)["tok_s"])
            prefill[k].append((recs[0]["rows"] / recs[0]["seconds"], recs[0].get("bytes_read", 0)))
            splits[k].append({**time_split(recs), **call_split(recs)})
            grown[k] = max(grown[k], totals(recs)["decode_memory_bytes"] or 0)
    hit_rate = {
        k: e.counters()["hits"] / max(1, e.counters()["hits"] + e.counters()["misses"])
        for k, e in engines.items()
        if k != "S=E"
    }
    installs_used = {k: e.install.name for k, e in engines.items()}
    for e in engines.values():
        e.close()
    res = {k: _median(v) for k, v in runs.items()}
    split = {k: {p: _median([d[p] for d in v]) for p in v[0]} for k, v in splits.items() if v and v[0]}
    out = dict(
        bench="throughput",
        model=mid,
        tokens=a.tokens,
        repeats=a.repeats,
        tok_s=res,
        tok_s_runs=runs,
        tok_s_spread={k: _spread(v) for k, v in runs.items()},
        prompt_tokens=len(ids),
        # A prefill at S < E reads experts (the same prompt after every decode, so what the
        # previous decode left resident is read again or not): its speed and bytes read.
        prefill_tok_s={k: _median([p[0] for p in v]) for k, v in prefill.items()},
        prefill_tok_s_spread={k: _spread([p[0] for p in v]) for k, v in prefill.items()},
        prefill_bytes_read={k: _median([p[1] for p in v]) for k, v in prefill.items() if v[0][1] is not None},
        loop=loop,
        host_tier_bytes={k: e.cache.tier.nbytes for k, e in engines.items() if e.cache.tier is not None},
        resident=resident,
        resident_note=why,
        ratio_engine_full_vs_mlx_lm=res["S=E"] / res["mlx-lm"] if resident else None,
        ratio_vs_resident={k: v / res["S=E"] for k, v in res.items()} if resident else {},
        install=installs_used,
        hit_rate=hit_rate,
        time_split_ms=split,
        # what each configuration holds (model: weights not offloaded and slot tables) plus the
        # most one of its decodes added (KV cache, activations): comparable though all are loaded
        memory_bytes={k: model_bytes(m) + grown[k] for k, m in models.items()},
    )
    print(f"{mid}: median decode tok/s over {a.repeats} interleaved runs of {a.tokens} tokens [min, max]")
    for k, v in res.items():
        sp = out["tok_s_spread"][k]
        inst = installs_used.get(k, "")
        ratio = f"x{out['ratio_vs_resident'][k]:.3f} of S=E" if resident else ""
        print(
            f"  {k:14s} {v:9.2f} tok/s [{sp['min']:.2f}, {sp['max']:.2f}]  {ratio}"
            f"  {out['memory_bytes'][k] / 1e6:8.1f} MB  {inst}"
        )
        if k in split and k not in ("mlx-lm", "S=E"):
            print("      ms/token: " + ", ".join(f"{p} {x:.2f}" for p, x in split[k].items()))
        pf = out["prefill_tok_s_spread"][k]
        read = f", {out['prefill_bytes_read'][k] / 1e6:.1f} MB read" if k in out["prefill_bytes_read"] else ""
        print(f"      prefill of {len(ids)} tokens: {pf['median']:.1f} tok/s [{pf['min']:.1f}, {pf['max']:.1f}]{read}")
    if resident:
        print(f"  engine at S=E / mlx-lm = {out['ratio_engine_full_vs_mlx_lm']:.4f}")
    else:
        print(f"  no resident decoding: {why}")
    return out


def pipelined(model, ids, n: int):
    """One decode through mlx-lm's own `generate_step` (its async_eval pipelining): tokens/s after
    the first token, the prefill's seconds (to the first token), and the peak memory it added."""
    mx.reset_peak_memory()
    start_mem = mx.get_active_memory()
    t0 = time.perf_counter()
    times = []
    for _ in generate_step(mx.array(ids, mx.uint32), model, max_tokens=n + 1):
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]), times[0] - t0, max(0, mx.get_peak_memory() - start_mem)


def prompt_ids(tok, n: int | None, prompt_set: str) -> list:
    """The throughput bench's prompt: one sentence, or the first `n` tokens of `prompt_set`'s
    eval prompts joined."""
    if n is None:
        return tok.encode("The Python language reference describes the syntax and semantics of the language.")
    ids = tok.encode("\n\n".join(p["text"] for p in prompts.load(prompt_set, "eval")))
    if len(ids) < n:
        raise SystemExit(f"--prompt-tokens {n}: the {prompt_set} eval prompts make only {len(ids)} tokens")
    return ids[:n]


def resident_fits(model_id: str, choice: str = "auto"):
    """(whether to decode the whole model resident, why): `auto` does where its weights take at
    most three quarters of this machine's memory, so that a model offloading exists for (larger
    than memory) is measured at its --slots instead of swapping."""
    weights = sum(f.stat().st_size for f in registry.model_dir(model_id).glob("*.safetensors"))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    why = f"weights {weights / 1e9:.1f} GB, memory {memory / 1e9:.1f} GB"
    if choice == "auto":
        return weights <= 0.75 * memory, why + (" (fits)" if weights <= 0.75 * memory else ": does not fit")
    return choice == "yes", why + f" (--resident {choice})"


def _expert_batches(num_experts, k, n):
    """n batches of k distinct experts, consecutive batches disjoint (every read misses)."""
    order = np.arange(num_experts)
    return [[int(order[(i * k + j) % num_experts]) for j in range(k)] for i in range(n)]


class _PinnedFloor:
    """The floor of a GPU miss: `preadv` into pinned host memory on the reader threads, then one
    `cudaMemcpy` of the batch to device memory (the CUDA runtime through ctypes, as the engine's
    pinned path uses it; no CuPy)."""

    name = "preadv into pinned host memory + cudaMemcpy"

    def __init__(self, store, k, pool):

        self.rt, self.store, self.pool = device.cuda_runtime(), store, pool
        self.host = aligned_empty(k * store.record_bytes).reshape(k, store.record_bytes)
        self.registration = device.Registration(self.host, self.rt)
        self.dev = self.rt.malloc(self.host.nbytes)

    def run(self, layer, experts):
        st = self.store
        futures = [
            self.pool.submit(st.read_into, layer, e, [self.host[i, : st.expert_bytes]]) for i, e in enumerate(experts)
        ]
        for f in futures:
            f.result()
        self.rt.memcpy_h2d(self.dev, self.host.ctypes.data, len(experts) * st.record_bytes)
        self.rt.synchronize()

    def close(self):
        self.rt.free(self.dev)
        self.registration.release()


def miss(a):
    """Per-miss cost of every install path against raw reads and the pinned-copy floor, for a lone
    expert and for batches (`--batch`), each path in turn on fresh experts, interleaved."""

    mid = model_of(a)
    model, _, spec, path = registry.load(mid, lazy=True)
    stores = {r: open_store(mid, model, path, tier=a.tier, readers=r) for r in a.readers}
    R = max(a.readers)
    store = stores[R]
    del model
    E = store.num_experts(0)
    # Checksums are verified on an expert's first read: do it before timing (it warms the
    # page cache too, which is the page_cache tier's premise).
    for s in stores.values():
        s.verify_all(layers=[0])
    fd = store._fds[0]
    raw_buf = store.empty_record()
    why_not_pinned = device.pinned_unavailable()
    reader_pool = ThreadPoolExecutor(max_workers=R, thread_name_prefix="titan-bench-reader")
    # `--install inplace` on a GPU is pinned, whose tables have no host views (a GPU cannot share
    # them): it is measured there under its own name only, and no slot table takes preadv directly
    inplace = installs.choose("inplace", 0).host_views
    modes = [f"inplace_r{r}" for r in a.readers] * inplace + ["copy"] + ([] if why_not_pinned else ["pinned"])
    if why_not_pinned:
        print(f"  (no pinned path or floor: {why_not_pinned})", file=sys.stderr)
    if not inplace:
        print("  (no inplace install here: a GPU cannot share a slot table's host views)", file=sys.stderr)

    def drop(e):
        if a.tier == "cold":
            os.posix_fadvise(fd, e * store.record_bytes, store.record_bytes, os.POSIX_FADV_DONTNEED)

    results, split = {}, {}
    for k in a.batch:
        rounds = max(1, a.repeats * (E // max(k, 1)) // (1 if k > 1 else 4))
        batches = _expert_batches(E, k, rounds)
        floor = None if why_not_pinned else _PinnedFloor(store, k, reader_pool)
        tables, caches = {}, {}
        for m in modes:
            install = "inplace" if m.startswith("inplace") else m
            S = max(k, 8)
            caches[m] = build_cache(
                stores[int(m[9:])] if m.startswith("inplace") else store, S, EngineConfig(install=install), layers=[0]
            )
            tables[m] = caches[m].tables[0]
        res = {
            n: []
            for n in ["raw_preadv"]
            + ["raw_preadv_into_slots"] * inplace
            + (["floor"] if floor else [])
            + [f"engine_{m}" for m in modes]
        }
        sp = {f"{m}_{p}": [] for m in ("copy", "pinned") if m in modes for p in ("pread", "array", "install")}
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            for e in batch:  # one preadv per expert into one preallocated buffer, sequentially
                drop(e)
                os.preadv(fd, [raw_buf], e * store.record_bytes)
            res["raw_preadv"].append((time.perf_counter() - t0) / k)
            if inplace:
                t0 = time.perf_counter()
                dests = tables[modes[0]]
                for j, e in enumerate(batch):
                    drop(e)
                    os.preadv(fd, dests.dests(j % dests.slots), e * store.record_bytes)
                res["raw_preadv_into_slots"].append((time.perf_counter() - t0) / k)
            if floor:
                for e in batch:
                    drop(e)
                t0 = time.perf_counter()
                floor.run(0, batch)
                res["floor"].append((time.perf_counter() - t0) / k)
            for m in modes[i % len(modes) :] + modes[: i % len(modes)]:  # rotate who goes first
                cache, t = caches[m], tables[m]  # the store drops a cold record's pages itself
                cache.stats.reset()
                t0 = time.perf_counter()
                cache.read_misses(0, batch, protected=set(batch))
                if not t.host_views:
                    mx.eval(t.buffers)  # the lazy install, so that its cost is counted here
                wall = (time.perf_counter() - t0) / k
                res[f"engine_{m}"].append(wall)
                if m in ("copy", "pinned"):
                    st = cache.stats
                    sp[f"{m}_pread"].append(st.pread_s / k)
                    sp[f"{m}_array"].append(st.array_s / k)
                    sp[f"{m}_install"].append(wall - (st.stall_s + st.array_s) / k)
        for c in caches.values():
            c.close()
        if floor:
            floor.close()
        for n, v in res.items():
            results[f"{n}/b{k}"] = 1e3 * _median(v)
        for n, v in sp.items():
            split[f"{n}/b{k}"] = 1e3 * _median(v)
    reader_pool.shutdown()
    for s in stores.values():
        s.close()
    out = dict(
        bench="miss",
        model=mid,
        tier=a.tier,
        device=device.kind(),
        expert_bytes=store.expert_bytes,
        batches=list(a.batch),
        repeats=a.repeats,
        per_miss_ms=results,
        split_ms=split,
        ratio_vs_raw={n: v / results[f"raw_preadv/b{n.rsplit('/b', 1)[1]}"] for n, v in results.items()},
    )
    if not why_not_pinned:
        out["floor"] = _PinnedFloor.name
        out["ratio_vs_floor"] = {n: v / results[f"floor/b{n.rsplit('/b', 1)[1]}"] for n, v in results.items()}
    else:
        out["pinned_unavailable"] = why_not_pinned
    print(
        f"{mid}: per-miss cost of one {store.expert_bytes:,}-byte expert, tier {a.tier}, medians "
        f"(batches of {', '.join(map(str, a.batch))})"
    )
    for n, v in results.items():
        extra = f"   x{out['ratio_vs_floor'][n]:.2f} of the floor" if "ratio_vs_floor" in out else ""
        print(f"  {n:28s} {v:7.3f} ms   x{out['ratio_vs_raw'][n]:.2f} of raw preadv{extra}")
    print("  split: " + ", ".join(f"{n} {v:.3f} ms" for n, v in split.items()))
    return out


def _install_diagnosis(store, block, S, repeats):
    """Where one copy-mode install's time goes, on this device: making the MLX arrays, the
    slot write of arrays the device has already read, a fresh array's first device read, and
    the same for one array holding eight experts. Medians in ms per expert."""

    E = store.num_experts(0)
    t = SlotTable(0, E, S, store.tensors, host_views=False)
    ts = store.tensors

    def arrays(e):  # one MLX array per tensor (the CPU's copy path)
        return records_to_mx(block[e : e + 1], ts, one_array=False)[0]

    parts = {
        k: []
        for k in (
            "array",
            "first_device_read",
            "write_after_read",
            "write_resident",
            "fresh_write",
            "batched8_array",
            "batched8_write",
        )
    }
    for i in range(repeats):
        e = i % 8
        t0 = time.perf_counter()
        arrs = arrays(e)
        mx.eval(arrs)
        t1 = time.perf_counter()
        mx.eval([x.sum() for x in arrs])  # the device's first read of the new arrays
        t2 = time.perf_counter()
        t.install_arrays((2 * i) % S, arrs)
        mx.eval(t.buffers)
        t3 = time.perf_counter()
        t.install_arrays((2 * i + 1) % S, arrs)  # same arrays again: they are resident now
        mx.eval(t.buffers)
        t4 = time.perf_counter()
        fresh = arrays((e + 1) % 8)
        mx.eval(fresh)
        t5 = time.perf_counter()
        t.install_arrays((2 * i) % S, fresh)
        mx.eval(t.buffers)
        t6 = time.perf_counter()
        parts["array"].append(t1 - t0)
        parts["first_device_read"].append(t2 - t1)
        parts["write_after_read"].append(t3 - t2)
        parts["write_resident"].append(t4 - t3)
        parts["fresh_write"].append(t6 - t5)
        # eight experts in one MLX array (the GPU's copy path): one allocation, one transfer
        t7 = time.perf_counter()
        batch = records_to_mx(block, ts, one_array=True)
        mx.eval(batch)
        t8 = time.perf_counter()
        for x, arrs in enumerate(batch):
            t.install_arrays((x * 7 + i) % S, arrs)
        mx.eval(t.buffers)
        t9 = time.perf_counter()
        parts["batched8_array"].append((t8 - t7) / 8)
        parts["batched8_write"].append((t9 - t8) / 8)
    return {k: 1e3 * _median(v) for k, v in parts.items()}


def install(a):

    mid = model_of(a)
    model, _, spec, path = registry.load(mid, lazy=True)
    store = open_store(mid, model, path, readers=1)
    del model
    E = store.num_experts(0)
    block, _ = store.read_block(0, range(8))
    views = [store.views(row) for row in block]
    per = {}
    for S in (8, 64):
        for mode in ("inplace", "copy"):
            t = SlotTable(0, E, S, store.tensors, host_views=HOST_VIEWS[mode])
            times = []
            for i in range(a.repeats * 8):
                e, slot = i % 8, (i * 7) % S
                t0 = time.perf_counter()
                if t.host_views:
                    for d, v in zip(t.dests(slot), views[e]):
                        d[:] = v.reshape(-1).view(np.uint8)
                else:
                    t.install_arrays(slot, records_to_mx(block[e : e + 1], store.tensors, device.one_array())[0])
                # the device's first read of the slot (a host write moves pages on a GPU)
                mx.eval([b[slot].sum() for b in t.buffers])
                times.append(time.perf_counter() - t0)
            per[f"{mode}_S{S}"] = 1e3 * _median(times)
            del t
            mx.clear_cache()
    diag = _install_diagnosis(store, block, 64, a.repeats * 8)
    store.close()
    out = dict(
        bench="install",
        model=mid,
        device=device.kind(),
        expert_bytes=store.expert_bytes,
        install_ms=per,
        ratio_S64_vs_S8={m: per[f"{m}_S64"] / per[f"{m}_S8"] for m in ("inplace", "copy")},
        diagnosis_ms=diag,
        ratio_fresh_vs_parts=diag["fresh_write"] / (diag["array"] + diag["write_resident"]),
        gb_s={k: store.expert_bytes / v / 1e6 for k, v in per.items()},
    )
    buf_mb = {S: S * store.expert_bytes / 1e6 for S in (8, 64)}
    print(f"{mid} on {device.kind()}: installing one {store.expert_bytes:,}-byte expert (median of {a.repeats * 8})")
    for k, v in per.items():
        S = int(k.rsplit("S", 1)[1])
        print(f"  {k:12s} {v:7.3f} ms  {out['gb_s'][k]:6.2f} GB/s  (buffer {buf_mb[S]:.0f} MB)")
    for m, r in out["ratio_S64_vs_S8"].items():
        print(f"  {m}: S=64 / S=8 = {r:.2f}")
    print("  where a copy-mode install goes (ms per expert): " + ", ".join(f"{k} {v:.3f}" for k, v in diag.items()))
    print(f"  fresh write / (array + write of a resident array) = {out['ratio_fresh_vs_parts']:.2f}")
    return out


WARM_TOKENS = 4  # a prefetch bench's warm-up decode per engine


def prefetch_bench(a):
    """Demand loading against every predictor and depth at S = E/4 (or --slots), with resident
    decoding (S = E) in the same run. Each prompt is one repetition: every configuration decodes
    it in turn (rotating who goes first), so figures are medians over prompts with their range."""

    mid = model_of(a)
    ref, tok, spec = registry.load_reference(mid)
    E = spec["experts"]
    S = a.slots[0] if a.slots else E // 4
    overlaps = OVERLAPS[a.overlap]
    configs = [("resident", 0, 0.0, True), ("none", 0, 0.0, True)] + [
        (p, d, q, ov)
        for p in a.predictors
        for d in a.depths
        for q in (a.min_probs if p in FITTED else [0.0])
        for ov in overlaps
    ]
    engines = {
        c: load(
            mid,
            EngineConfig(
                slots=None if c[0] == "resident" else S,
                tier=a.tier,
                install=a.install,
                predictor="none" if c[0] == "resident" else c[0],
                depth=max(c[1], 1),
                fit_set=a.set,
                min_prob=c[2],
                overlap=c[3],
            ),
        )
        for c in configs
    }
    rows = prompts.load(a.set, "eval")[: a.prompts]
    counts = ("hits", "misses", "issued", "useful", "wasted", "late")
    # A few tokens of the first prompt through every engine first: a kernel's first-use compilation
    # (on a GPU, a second or more) would otherwise fall on whichever configuration decodes first.
    if rows:
        warm = tok.encode(rows[0]["text"])
        warm_sets = trace.record(ref, warm, WARM_TOKENS)["experts"]
        for eng in engines.values():
            eng.bind_oracle(warm_sets)
            decode(eng.model, warm, WARM_TOKENS, pipelined=True)
    per_prompt = {c: [] for c in configs}
    for i, p in enumerate(rows):
        ids = tok.encode(p["text"])
        sets = trace.record(ref, ids, a.tokens)["experts"]
        for c in configs[i % len(configs) :] + configs[: i % len(configs)]:
            eng = engines[c]
            eng.bind_oracle(sets)
            _, recs, _ = decode(eng.model, ids, a.tokens, pipelined=True)  # as mlx-lm's generate_step
            per_prompt[c].append(dict(totals(recs), split=time_split(recs), calls=call_split(recs)))
    installs = {c: e.install.name for c, e in engines.items()}
    overlaps_run = {c: e.install.overlap(e.config) for c, e in engines.items()}  # the row says where it ran
    for eng in engines.values():
        eng.close()
    table = {}
    for (name, d, q, asked), runs in per_prompt.items():
        ov = overlaps_run[(name, d, q, asked)]
        tok_s = [r["tokens"] / r["seconds"] for r in runs]
        stall = [1e3 * r["stall_s"] / r["tokens"] for r in runs]
        tot = {k: sum(r[k] for r in runs) for k in counts}
        table[f"{name}/d{d}" + (f"/p{q:g}" if q else "") + ("" if ov else "/serial")] = dict(
            predictor=name,
            depth=d,
            min_prob=q,
            overlap=ov,
            install=installs[(name, d, q, asked)],
            tok_s=_median(tok_s),
            tok_s_min=min(tok_s),
            tok_s_max=max(tok_s),
            tok_s_runs=tok_s,  # prompt by prompt, in the prompts' order: every row's runs pair up
            stall_ms_per_token=_median(stall),
            stall_ms_min=min(stall),
            stall_ms_max=max(stall),
            hit_rate=tot["hits"] / (tot["hits"] + tot["misses"]) if tot["hits"] + tot["misses"] else None,
            time_split_ms={k: _median([r["split"][k] for r in runs]) for k in runs[0]["split"]},
            # the token seen from the host: building its graph, then waiting for its evaluation
            call_split_ms={k: _median([r["calls"][k] for r in runs]) for k in runs[0]["calls"]},
            **{k: tot[k] for k in counts[2:]},
        )
    base = table["none/d0"]["stall_ms_per_token"]
    resident = table["resident/d0"]["tok_s"]
    for v in table.values():
        v["stall_cut"] = 1 - v["stall_ms_per_token"] / base if base else None
        v["x_resident"] = v["tok_s"] / resident
        # each prompt's ratio to resident decoding of the same prompt, decoded beside it
        v["x_resident_paired"] = paired(v["tok_s_runs"], table["resident/d0"]["tok_s_runs"])
        v["stall_x_demand"] = v["stall_ms_per_token"] / base if base else None
    fitted = [k for k, v in table.items() if v["predictor"] in FITTED]
    best = min(fitted, key=lambda k: table[k]["stall_ms_per_token"]) if fitted else None
    out = dict(
        bench="prefetch",
        model=mid,
        slots=S,
        experts=E,
        tier=a.tier,
        prompt_set=a.set,
        prompts=len(rows),
        tokens=a.tokens,
        install=a.install,
        loop="pipelined",  # each token's graph built and queued while the device runs the last one
        results=table,
        best_fitted=best,
    )
    print(
        f"{mid}: S={S}/{E}, tier {a.tier}, install {a.install}, {len(rows)} {a.set} eval prompts x {a.tokens} "
        f"tokens, pipelined as mlx-lm's generate_step (medians over prompts, [min, max])"
    )
    print(
        f"  {'predictor/depth':18s} {'tok/s':>22s} {'x res (paired)':>20s} {'stall ms/tok':>13s} {'cut':>6s} "
        f"{'hit':>6s} {'useful':>7s} {'wasted':>7s} {'late':>5s}"
    )
    for k, v in table.items():
        xr = v["x_resident_paired"]
        v_x = f"{xr['median']:.3f} [{xr['min']:.2f}, {xr['max']:.2f}]"
        cut = "" if v["stall_cut"] is None else f"{100 * v['stall_cut']:5.1f}%"
        hit = "" if v["hit_rate"] is None else f"{v['hit_rate']:6.3f}"
        rng = f"{v['tok_s']:7.2f} [{v['tok_s_min']:.1f}, {v['tok_s_max']:.1f}]"
        print(
            f"  {k:18s} {rng:>22s} {v_x:>20s} {v['stall_ms_per_token']:13.3f} {cut:>6s} {hit:>6s} "
            f"{v['useful']:7d} {v['wasted']:7d} {v['late']:5d}"
        )
        if v["predictor"] != "resident":
            print("      ms/token: " + ", ".join(f"{p} {x:.2f}" for p, x in v["time_split_ms"].items()))
        print("      host ms/token: " + ", ".join(f"{p} {x:.2f}" for p, x in v["call_split_ms"].items()))
    if best:
        print(f"  best fitted predictor: {best}")
    return out


def serve(a):
    """The engine's server beside mlx_lm.server under concurrent clients (harness.servebench)."""
    with tempfile.TemporaryDirectory(prefix="titan-serve-") as work:
        out = servebench.run(a, model_of(a), a.slots[0] if a.slots else None, Path(work))
    servebench.show(out)
    return out


def check_args(a):
    """The options against the model, before anything is built or measured (as engine.cli.check_args does)."""
    model = model_of(a)
    shape = registry.shape(model)
    for s in a.slots:
        api.check(model, EngineConfig(slots=s))
    for d in a.depths:
        api.check_prediction(shape, d, None, depth_option="--depths")
    if a.which == "prefill":
        return  # its lengths are capped at the model's context
    if a.which not in ("throughput", "prefetch", "serve", "batch"):
        return
    api.check_context(model, a.prompt_tokens or 1, a.tokens, "--tokens")


def main(a):
    check_args(a)
    started = provenance.utc_now()
    benches = {"throughput": throughput, "miss": miss, "install": install, "prefetch": prefetch_bench, "serve": serve,
               "prefill": manyrows.prefill, "batch": manyrows.batch, "families": families.families,
               "plan": families.planned}  # fmt: skip
    out = benches[a.which](a)
    if out is None:  # bench families over several families: each recorded in a process of its own
        return
    if a.record:
        cfg = {k: v for k, v in vars(a).items() if k not in ("fn", "record")}
        rows = out if isinstance(out, list) else [out]  # bench plan: one result a family
        path = rawlog.write_run(
            "bench",
            a.which,
            rows,
            config=cfg,
            seed=None,
            started=started,
            command=["python", "-m", "harness", *sys.argv[1:]],
            model=rows[0].get("model") if len(rows) == 1 else None,
            revision=None,
        )
        print(f"raw record: {path}")
    if a.which == "families" and a.clean:
        families.clean(out["model"])
