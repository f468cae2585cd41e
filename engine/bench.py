"""Engine-core benchmarks, each measured side by side in one run:

- `throughput`: decode tokens/s of the engine at S = E (and optional smaller S) against plain
  mlx-lm on the same model, prompt and loop, interleaved;
- `miss`: the per-miss cost of the engine's read path against a raw `os.preadv` of the same
  bytes into a preallocated buffer;
- `install`: the cost of installing one expert into a table of 8 and of 64 slots.

Speed is reported, never asserted: the machines are noisy.
"""

import os
import statistics
import sys
import time

import numpy as np


def add_args(p):
    p.add_argument("which", choices=["throughput", "miss", "install", "prefetch"])
    p.add_argument("--model", default=None,
                   help="model id (default: olmoe-tiny-f32 for throughput, olmoe-1b-7b-shape for miss/install)")
    p.add_argument("--tokens", type=int, default=32, help="throughput: tokens per decode")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repetitions")
    p.add_argument("--slots", type=int, nargs="*", default=[], help="throughput: also run the engine at these S")
    p.add_argument("--tier", choices=["page_cache", "cold"], default="page_cache")
    p.add_argument("--readers", type=int, nargs="*", default=[1, 4], help="miss: reader-thread counts to measure")
    p.add_argument("--predictors", nargs="*", default=["oracle", "probe", "transition", "popularity", "previous"],
                   help="prefetch: predictors to run beside demand loading")
    p.add_argument("--depths", type=int, nargs="*", default=[1, 2, 3], help="prefetch: depths")
    p.add_argument("--prompts", type=int, default=4, help="prefetch: eval prompts of --set to decode")
    p.add_argument("--set", choices=["general", "code"], default="general", help="prefetch: prompt set")
    p.add_argument("--min-probs", type=float, nargs="*", default=[0.0],
                   help="prefetch: confidence floors to run each fitted predictor at (0: its whole top-k set)")
    p.add_argument("--record", action="store_true",
                   help="also write the result as a raw record under results/raw/bench/<which>/")


def _median(xs):
    return statistics.median(xs)


def throughput(a):
    from . import runtime

    mid = a.model or "olmoe-tiny-f32"
    ref, tok, spec = runtime.load_reference(mid)
    engines = {"S=E": runtime.Engine.load(mid, runtime.EngineConfig())}
    for s in a.slots:
        engines[f"S={s}"] = runtime.Engine.load(mid, runtime.EngineConfig(slots=s, tier=a.tier))
    ids = tok.encode("The Python language reference describes the syntax and semantics of the language.")
    runs = {"mlx-lm": [], **{k: [] for k in engines}}
    extra = {k: [] for k in engines}
    runtime.decode(ref, ids, 4)  # warm-up: first-call compilation
    for e in engines.values():
        runtime.decode(e.model, ids, 4)
    for _ in range(a.repeats):
        runs["mlx-lm"].append(runtime.summarize(runtime.decode(ref, ids, a.tokens)[1])["tok_s"])
        for k, e in engines.items():
            s = runtime.summarize(runtime.decode(e.model, ids, a.tokens)[1])
            runs[k].append(s["tok_s"])
            extra[k].append(s)
    for e in engines.values():
        e.close()
    res = {k: _median(v) for k, v in runs.items()}
    out = dict(bench="throughput", model=mid, tokens=a.tokens, repeats=a.repeats, tok_s=res, tok_s_runs=runs,
               ratio_engine_full_vs_mlx_lm=res["S=E"] / res["mlx-lm"],
               hit_rate={k: v[-1].get("hit_rate") for k, v in extra.items()})
    print(f"{mid}: median decode tok/s over {a.repeats} interleaved runs of {a.tokens} tokens")
    for k, v in res.items():
        print(f"  {k:8s} {v:9.2f} tok/s")
    print(f"  engine at S=E / mlx-lm = {out['ratio_engine_full_vs_mlx_lm']:.4f}")
    return out


def _expert_batches(num_experts, k, n):
    """n batches of k distinct experts, consecutive batches disjoint (every read misses)."""
    order = np.arange(num_experts)
    return [[int(order[(i * k + j) % num_experts]) for j in range(k)] for i in range(n)]


class _CupyH2D:
    """The floor of a GPU miss: `preadv` into pinned host memory, then one `cudaMemcpy` to
    device memory (CuPy, when it is installed; used only as a measuring stick)."""

    name = "preadv into pinned host memory + cudaMemcpy (CuPy)"

    def __init__(self, nbytes):
        import cupy

        self.cupy = cupy
        self._pinned = cupy.cuda.alloc_pinned_memory(nbytes)
        self.host = np.frombuffer(self._pinned, np.uint8, nbytes)
        self.dev = cupy.empty(nbytes, cupy.uint8)
        self.nbytes = nbytes

    def copy(self):
        rt = self.cupy.cuda.runtime
        rt.memcpy(self.dev.data.ptr, self.host.ctypes.data, self.nbytes, rt.memcpyHostToDevice)

    def sync(self):
        self.cupy.cuda.runtime.deviceSynchronize()


def _h2d_copier(nbytes):
    from . import device

    if device.kind() != "gpu":
        return None
    try:
        return _CupyH2D(nbytes)
    except Exception as exc:  # no CuPy: the ratio to a raw host read alone still stands
        print(f"  (no host-to-device baseline: {type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def miss(a):
    from . import device, registry
    from .moe import ExpertCache
    from .prefetch import NoPrefetch
    from .runtime import open_store
    from .slots import SlotTable

    mid = a.model or "olmoe-1b-7b-shape"
    model, _, spec, path = registry.load(mid, lazy=True)
    stores = {r: open_store(mid, model, path, tier=a.tier, readers=r) for r in a.readers}
    store = stores[max(a.readers)]
    del model
    E, K = store.num_experts(0), 8
    batches = _expert_batches(E, K, a.repeats * (E // K))
    # Checksums are verified on an expert's first read: do it before timing (it warms the
    # page cache too, which is the page_cache tier's premise).
    for s in stores.values():
        s.verify_all(layers=[0])
    raw_buf = store.empty_record()
    fd = store._fds[0]
    # Two raw baselines: one reused buffer (cache-hot destination, the floor) and the slot
    # table's own memory (the same destination footprint as the engine).
    results = {"raw_preadv": [], "raw_preadv_into_slots": []}
    h2d = _h2d_copier(store.record_bytes)
    if h2d:
        results["raw_preadv_h2d"] = []
    raw_table = SlotTable(0, E, K, store.tensors)
    for r in a.readers:
        results[f"engine_inplace_r{r}"] = []
    results["engine_copy"] = []
    split = {"pread": [], "array": [], "install": []}
    tables = {}
    for r in a.readers + ["copy"]:
        t = SlotTable(0, E, K, store.tensors, install="copy" if r == "copy" else "inplace")
        tables[r] = t
    for batch in batches:
        # raw: one preadv per expert into one preallocated buffer, sequentially
        t0 = time.perf_counter()
        for e in batch:
            if a.tier == "cold":
                os.posix_fadvise(fd, e * store.record_bytes, store.record_bytes, os.POSIX_FADV_DONTNEED)
            os.preadv(fd, [raw_buf], e * store.record_bytes)
        results["raw_preadv"].append((time.perf_counter() - t0) / K)
        if h2d:
            t0 = time.perf_counter()
            for e in batch:
                if a.tier == "cold":
                    os.posix_fadvise(fd, e * store.record_bytes, store.record_bytes, os.POSIX_FADV_DONTNEED)
                os.preadv(fd, [h2d.host], e * store.record_bytes)
                h2d.copy()
            h2d.sync()
            results["raw_preadv_h2d"].append((time.perf_counter() - t0) / K)
        t0 = time.perf_counter()
        for j, e in enumerate(batch):
            if a.tier == "cold":
                os.posix_fadvise(fd, e * store.record_bytes, store.record_bytes, os.POSIX_FADV_DONTNEED)
            os.preadv(fd, raw_table.dests(j), e * store.record_bytes)
        results["raw_preadv_into_slots"].append((time.perf_counter() - t0) / K)
        for r in a.readers + ["copy"]:
            cache = ExpertCache(stores[max(a.readers) if r == "copy" else r], [tables[r]], NoPrefetch())
            t0 = time.perf_counter()
            cache.read_misses(0, batch, protected=set(batch))
            if r == "copy":
                import mlx.core as mx

                mx.eval(tables[r].buffers)  # the lazy install, so that its cost is counted here
            wall = (time.perf_counter() - t0) / K
            results["engine_copy" if r == "copy" else f"engine_inplace_r{r}"].append(wall)
            if r == "copy":
                st = cache.stats
                split["pread"].append(st.pread_s / K)
                split["array"].append(st.array_s / K)
                split["install"].append(wall - (st.stall_s + st.array_s) / K)
    for s in stores.values():
        s.close()
    med = {k: 1e3 * _median(v) for k, v in results.items()}
    out = dict(bench="miss", model=mid, tier=a.tier, device=device.kind(), expert_bytes=store.expert_bytes, batch=K,
               batches=len(batches), per_miss_ms=med,
               copy_split_ms={k: 1e3 * _median(v) for k, v in split.items()},
               ratio_vs_raw={k: v / med["raw_preadv"] for k, v in med.items()})
    if h2d:
        out["h2d_baseline"] = h2d.name
        out["ratio_vs_raw_h2d"] = {k: v / med["raw_preadv_h2d"] for k, v in med.items()}
    print(f"{mid}: per-miss cost of one {store.expert_bytes:,}-byte expert, tier {a.tier}, median of {len(batches)} batches of {K}")
    for k, v in med.items():
        print(f"  {k:20s} {v:7.3f} ms   x{out['ratio_vs_raw'][k]:.2f} of raw preadv")
    print("  copy mode split: " + ", ".join(f"{k} {v:.3f} ms" for k, v in out["copy_split_ms"].items()))
    if h2d:
        print(f"  against {h2d.name}: " + ", ".join(f"{k} x{v:.2f}" for k, v in out["ratio_vs_raw_h2d"].items()))
    return out


def _install_diagnosis(store, block, S, repeats):
    """Where one copy-mode install's time goes, on this device: making the MLX arrays, the
    slot write of arrays the device has already read, a fresh array's first device read, and
    the same for one array holding eight experts. Medians in ms per expert."""
    import mlx.core as mx

    from .moe import records_to_mx
    from .slots import SlotTable

    E = store.num_experts(0)
    t = SlotTable(0, E, S, store.tensors, install="copy")
    ts = store.tensors

    def arrays(e):  # one MLX array per tensor (the CPU's copy path)
        return records_to_mx(block[e: e + 1], ts, one_array=False)[0]

    parts = {k: [] for k in ("array", "first_device_read", "write_after_read", "write_resident", "fresh_write",
                             "batched8_array", "batched8_write")}
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
    import mlx.core as mx

    from . import device, registry
    from .moe import records_to_mx
    from .runtime import open_store
    from .slots import SlotTable

    mid = a.model or "olmoe-1b-7b-shape"
    model, _, spec, path = registry.load(mid, lazy=True)
    store = open_store(mid, model, path, readers=1)
    del model
    E = store.num_experts(0)
    block, _ = store.read_block(0, range(8))
    views = [store.views(row) for row in block]
    per = {}
    for S in (8, 64):
        for mode in ("inplace", "copy"):
            t = SlotTable(0, E, S, store.tensors, install=mode)
            times = []
            for i in range(a.repeats * 8):
                e, slot = i % 8, (i * 7) % S
                t0 = time.perf_counter()
                if mode == "inplace":
                    for d, v in zip(t.dests(slot), views[e]):
                        d[:] = v.reshape(-1).view(np.uint8)
                else:
                    t.install_arrays(slot, records_to_mx(block[e: e + 1], store.tensors, device.one_array())[0])
                # the device's first read of the slot (a host write moves pages on a GPU)
                mx.eval([b[slot].sum() for b in t.buffers])
                times.append(time.perf_counter() - t0)
            per[f"{mode}_S{S}"] = 1e3 * _median(times)
            del t
            mx.clear_cache()
    diag = _install_diagnosis(store, block, 64, a.repeats * 8)
    store.close()
    out = dict(bench="install", model=mid, device=device.kind(), expert_bytes=store.expert_bytes, install_ms=per,
               ratio_S64_vs_S8={m: per[f"{m}_S64"] / per[f"{m}_S8"] for m in ("inplace", "copy")},
               diagnosis_ms=diag,
               ratio_fresh_vs_parts=diag["fresh_write"] / (diag["array"] + diag["write_resident"]),
               gb_s={k: store.expert_bytes / v / 1e6 for k, v in per.items()})
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


def prefetch_bench(a):
    """Demand loading against every predictor and depth at S = E/4 (or --slots), one run."""
    from . import prompts, runtime, trace

    mid = a.model or "olmoe-tiny-f32"
    ref, tok, spec = runtime.load_reference(mid)
    E = spec["experts"]
    S = a.slots[0] if a.slots else E // 4
    from .predictors import FITTED

    configs = [("none", 0, 0.0)] + [(p, d, q) for p in a.predictors for d in a.depths
                                     for q in (a.min_probs if p in FITTED else [0.0])]
    engines = {
        c: runtime.Engine.load(mid, runtime.EngineConfig(slots=S, tier=a.tier, predictor=c[0], depth=max(c[1], 1),
                                                         fit_set=a.set, min_prob=c[2]))
        for c in configs
    }
    rows = prompts.load(a.set, "eval")[: a.prompts]
    sums = {c: dict(tokens=0, seconds=0.0, stall=0.0, hits=0, misses=0, issued=0, useful=0, wasted=0, late=0)
            for c in configs}
    for p in rows:
        ids = tok.encode(p["text"])
        sets = trace.record(ref, ids, a.tokens)["experts"]
        for c, eng in engines.items():
            eng.bind_oracle(sets)
            _, recs, _ = runtime.decode(eng.model, ids, a.tokens)
            for r in recs[1:]:
                acc = sums[c]
                acc["tokens"] += 1
                acc["seconds"] += r["seconds"]
                acc["stall"] += r["stall_s"]
                for k in ("hits", "misses", "issued", "useful", "wasted", "late"):
                    acc[k] += r[k]
    for eng in engines.values():
        eng.close()
    table = {}
    for (name, d, q), acc in sums.items():
        table[f"{name}/d{d}" + (f"/p{q:g}" if q else "")] = dict(
            predictor=name, depth=d, min_prob=q, tok_s=acc["tokens"] / acc["seconds"],
            stall_ms_per_token=1e3 * acc["stall"] / acc["tokens"],
            hit_rate=acc["hits"] / (acc["hits"] + acc["misses"]),
            issued=acc["issued"], useful=acc["useful"], wasted=acc["wasted"], late=acc["late"])
    base = table["none/d0"]["stall_ms_per_token"]
    for v in table.values():
        v["stall_cut"] = 1 - v["stall_ms_per_token"] / base if base else None
    fitted = [k for k, v in table.items() if v["predictor"] not in ("none", "oracle")]
    best = min(fitted, key=lambda k: table[k]["stall_ms_per_token"]) if fitted else None
    out = dict(bench="prefetch", model=mid, slots=S, experts=E, tier=a.tier, prompt_set=a.set, prompts=len(rows),
               tokens=a.tokens, results=table, best_fitted=best)
    print(f"{mid}: S={S}/{E}, tier {a.tier}, {len(rows)} {a.set} eval prompts x {a.tokens} tokens")
    print(f"  {'predictor/depth':18s} {'tok/s':>8s} {'stall ms/tok':>13s} {'cut':>6s} {'hit':>6s} {'useful':>7s} {'wasted':>7s} {'late':>5s}")
    for k, v in table.items():
        cut = "" if v["stall_cut"] is None else f"{100 * v['stall_cut']:5.1f}%"
        print(f"  {k:18s} {v['tok_s']:8.2f} {v['stall_ms_per_token']:13.3f} {cut:>6s} {v['hit_rate']:6.3f} "
              f"{v['useful']:7d} {v['wasted']:7d} {v['late']:5d}")
    if best:
        print(f"  best fitted predictor: {best}")
    return out


def main(a):
    from . import provenance, rawlog

    started = provenance.utc_now()
    out = {"throughput": throughput, "miss": miss, "install": install, "prefetch": prefetch_bench}[a.which](a)
    if a.record:
        cfg = {k: v for k, v in vars(a).items() if k not in ("fn", "record")}
        path = rawlog.write_run("bench", a.which, [out], config=cfg, seed=None, started=started,
                                command=["python", "-m", "engine", *sys.argv[1:]], model=out.get("model"), revision=None)
        print(f"raw record: {path}")
