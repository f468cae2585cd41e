"""The `device` install (engine/runtime/device/) as CI can run it: its slot map as MLX
operations against a NumPy model of the algorithm, the engine on it bit-identical to mlx-lm at every
slot count, no host read inside a decode token, the host tier's checks, and on a CUDA GPU the
kernels against the operations."""

import gc
import weakref

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from conftest import MODELS, gpu_only, run_engine, run_with

from engine import EngineConfig, device, load, max_abs_diff
from engine.models import registry
from engine.models.registry import load_reference
from engine.runtime import hostcache, installs, loop
from engine.runtime.device import cache as devicecache
from engine.runtime.device import hosttier, kernels, ops, stats
from engine.runtime.device.ops import map_step_ops
from engine.runtime.device.state import MapState
from engine.runtime.loop import decode
from engine.runtime.slots import aligned_zeros, host_view


def reference_step(slot_of, expert_in, stamp, clock, counters, pending, inds, S):
    """The demand map step as the module docstring says it, one entry at a time."""
    slot_of, expert_in, stamp = slot_of.copy(), expert_in.copy(), stamp.copy()
    N = len(inds)
    M = min(N, S)
    used = np.zeros(S, bool)
    for e in inds:
        if e >= 0 and slot_of[e] >= 0:
            used[slot_of[e]] = True
    orig = slot_of.copy()
    taken, seen, fills, hits = np.zeros(S, bool), set(), [], 0
    for e in inds:
        if e < 0 or e in seen:
            continue
        seen.add(e)
        if orig[e] >= 0:
            hits += 1
            continue
        v = min((s for s in range(S) if not used[s] and not taken[s]), key=lambda s: stamp[s] * S + s)
        taken[v] = True
        if expert_in[v] >= 0:
            slot_of[expert_in[v]] = -1
        slot_of[e], expert_in[v] = v, e
        fills.append((e, v))
    pad = _pad(S, used, taken, stamp, fills)
    fe = [e for e, _ in fills] + [-1] * (M - len(fills))
    fs = [v for _, v in fills] + [pad] * (M - len(fills))
    remapped = [slot_of[e] if e >= 0 else 0 for e in inds]
    stamp[used | taken] = clock
    useful, wasted = int((pending & used).sum()), int((pending & ~used).sum())
    counters = counters + [hits, len(fills), 0, useful, wasted]
    state = (slot_of, expert_in, stamp, clock + 1, counters, np.zeros(S, bool))
    return state, (remapped, fe, fs, len(fills))


def _pad(S, used, taken, stamp, fills):
    rest = [s for s in range(S) if not taken[s]]
    return min(rest, key=lambda s: (ops.BIG + s) if used[s] else stamp[s] * S + s) if rest else fills[-1][1]


def reference_prefetch(slot_of, expert_in, stamp, clock, counters, pending, inds, S, protect=False):
    """The prefetch step as `prefetch_step_ops` says it, one entry at a time."""
    slot_of, expert_in, stamp, pending = slot_of.copy(), expert_in.copy(), stamp.copy(), pending.copy()
    M = min(len(inds), S)
    orig, orig_stamp = slot_of.copy(), stamp.copy()
    used = (orig_stamp == clock - 1) if protect else np.zeros(S, bool)
    for e in inds:
        if e >= 0 and orig[e] >= 0:
            used[orig[e]] = True
    free = int((~used).sum())
    taken, seen, fills, wanted, wasted = np.zeros(S, bool), set(), [], 0, 0
    for e in inds:
        if e < 0 or e in seen:
            continue
        seen.add(e)
        if orig[e] >= 0:
            stamp[orig[e]] = clock
            continue
        wanted += 1
        if wanted > free:
            continue
        v = min((s for s in range(S) if not used[s] and not taken[s]), key=lambda s: orig_stamp[s] * S + s)
        taken[v] = True
        if expert_in[v] >= 0:
            slot_of[expert_in[v]] = -1
        slot_of[e], expert_in[v] = v, e
        wasted += bool(pending[v])
        pending[v], stamp[v] = True, clock
        fills.append((e, v))
    pad = _pad(S, used, taken, orig_stamp, fills)
    fe = [e for e, _ in fills] + [-1] * (M - len(fills))
    fs = [v for _, v in fills] + [pad] * (M - len(fills))
    counters = counters + [0, 0, len(fills), 0, wasted]
    return (slot_of, expert_in, stamp, clock, counters, pending), (fe, fs, len(fills))


def random_steps(rng, E, S, steps):
    """Decode-like steps (k distinct experts) and prefill-like ones (repeats and ignored pairs),
    never more distinct experts in one step than slots."""
    for i in range(steps):
        if i % 3 == 2:
            chosen = rng.choice(E, size=rng.integers(1, S + 1), replace=False)
            n = 20 if i % 2 else 40  # 40: more entries than a warp has lanes
            inds = rng.choice(chosen, size=n)
            inds[rng.random(n) < 0.3] = -1
        else:
            inds = rng.choice(E, size=min(4, S), replace=False)
        yield inds.astype(np.int32)


def _same(state, ref):
    got = [np.array(a) for a in state.fields()]
    for i in (0, 1, 2):
        assert np.array_equal(got[i], ref[i])
    assert int(got[3][0]) == ref[3] and np.array_equal(got[4], ref[4]) and np.array_equal(got[5] > 0, ref[5])


@pytest.mark.parametrize("E,S", [(16, 6), (16, 4), (8, 8), (64, 16)])
def test_the_map_step_is_the_algorithm(E, S):
    """300 steps, demand and prefetch: a demand step keeps hits, gives each distinct miss the least
    recently used slot no entry of the step uses (empty slots first, lowest first), evicts what was
    there, names what to copy (padding with a slot that keeps its bytes) and counts distinct
    experts; a prefetched slot is useful if the next demand step hits it, wasted if it is evicted
    or not used; a prefetch fills as many predicted experts as there are slots it may take."""
    rng = np.random.default_rng(E * 100 + S)
    state = MapState.empty(E, S)
    ref = (np.full(E, -1), np.full(S, -1), np.full(S, -1), 0, np.zeros(5, int), np.zeros(S, bool))
    for i, inds in enumerate(random_steps(rng, E, S, 300)):
        if i % 4 == 1:  # a prediction for the next step: likely experts, some dropped
            pred = rng.choice(E, size=min(6, E), replace=False).astype(np.int32)
            pred[rng.random(len(pred)) < 0.2] = -1
            protect = bool(i % 8 == 1)
            state, fill = ops.prefetch_step_ops(state, mx.array(pred), S, protect)
            ref, (fe, fs, n) = reference_prefetch(*ref, pred, S, protect)
            _same(state, ref)
            assert np.array(fill.experts).tolist() == fe and np.array(fill.slots).tolist() == fs
            assert int(fill.count[0]) == n
            continue
        state, fill = map_step_ops(state, mx.array(inds), S)
        ref, (remapped, fe, fs, n) = reference_step(*ref, inds, S)
        _same(state, ref)
        assert np.array(fill.remapped).tolist() == remapped
        assert np.array(fill.experts).tolist() == fe and np.array(fill.slots).tolist() == fs
        assert int(fill.count[0]) == n
        valid = inds >= 0  # what the layer's SwitchGLU gets: each valid pair's expert, in its slot
        assert np.array_equal(np.array(state.expert_in)[np.array(fill.remapped)[valid]], inds[valid])
    if S < E:
        assert ref[4][2] > 0 and ref[4][3] > 0 and ref[4][4] > 0  # prefetches issued, useful and wasted


CASES = [(m, s) for m, d in MODELS.items() for s in (d["experts"], d["experts"] // 2, d["experts"] // 4, d["top_k"])]


@pytest.mark.parametrize("model_id,slots", CASES)
def test_device_install_logits_bit_identical(reference, model_id, slots):
    """The prefill and 32 decode steps through the device install equal mlx-lm's bit for bit."""
    ref = reference(model_id)
    records, logits, counters = run_engine(model_id, ref, slots=slots, install="device")
    assert max_abs_diff(ref["logits"], logits) == 0.0
    if slots < MODELS[model_id]["experts"]:
        assert counters["misses"] > 0 and counters["hits"] > 0
        dec = [r for r in records if r["phase"] == "decode"]
        assert sum(r["misses"] for r in dec) > 0  # the decode loop's per-step figures come from the device
        # a slot once filled stays filled: every fill past a layer's first S evicted an expert; at
        # S = top_k every layer fills all its slots in the prefill already
        assert 0 < counters["evictions"] <= counters["misses"]
        if slots == MODELS[model_id]["top_k"]:
            assert counters["evictions"] == counters["misses"] - slots * registry.shape(model_id)["layers"]
    else:
        assert counters["evictions"] == 0 and counters["misses"] == 0


@pytest.mark.parametrize(
    "name,depth,overlap", [("oracle", 1, True), ("oracle", 2, True), ("probe", 1, True), ("transition", 1, True),
                           ("popularity", 2, True), ("previous", 1, True), ("transition", 3, True),
                           ("oracle", 1, False), ("probe", 3, False)]
)  # fmt: skip
def test_device_prefetch_bit_identical(reference, fit_traces, name, depth, overlap):
    """Every predictor's prefetches through the device install, at depths that stay within the
    token and that wrap onto the next (3 = every layer of qwen3moe-tiny: onto the very layer
    being computed), on a stream of their own (`overlap`) or on the decode stream: the logits stay
    mlx-lm's."""
    ref = reference("qwen3moe-tiny")
    fit = fit_traces("qwen3moe-tiny")
    records, logits = run_with("qwen3moe-tiny", ref, name, depth, fit, install="device", overlap=overlap)
    assert max_abs_diff(ref["logits"], logits) == 0.0
    dec = records[1:]
    if name != "previous":  # `previous` predicts what is resident already
        assert sum(r["issued"] for r in dec) > 0


def test_a_pipelined_decode_builds_the_next_token_before_reading_this_one(monkeypatch, reference, fit_traces):
    """`decode(pipelined=True)` takes mlx-lm's `generate_step` order: token t+1's graph is built
    and queued (the oracle prefetching on the decode stream with it) before token t is read back,
    the only read-back of a token. Its logits stay mlx-lm's and each step's counters are those of
    the one-token-at-a-time loop; a greedy decode feeding the device's own token gives its tokens."""
    ref, fit = reference("qwen3moe-tiny"), fit_traces("qwen3moe-tiny")
    events = []
    real_read, real_begin = loop.read_token, devicecache.DeviceCache.begin_step
    monkeypatch.setattr(loop, "read_token", lambda y: events.append("read") or real_read(y))
    monkeypatch.setattr(
        devicecache.DeviceCache, "begin_step", lambda c, p, r: events.append("build") or real_begin(c, p, r)
    )
    runs = {}
    for pipelined in (False, True):
        events[:] = []
        runs[pipelined] = run_with("qwen3moe-tiny", ref, "oracle", 2, fit, install="device", pipelined=pipelined)
        n, seen = len(ref["tokens"]), events[events.index("build") :]  # (the oracle's trace is read first)
        if pipelined:
            assert seen == ["build"] + ["build", "read"] * (n - 1) + ["read"]
        else:
            assert seen == ["build", "read"] * n
        assert max_abs_diff(ref["logits"], runs[pipelined][1]) == 0.0
    figures = ("hits", "misses", "issued", "useful", "wasted")
    counted = {p: [tuple(r[k] for k in figures) for r in recs] for p, (recs, _) in runs.items()}
    assert counted[True] == counted[False]
    assert sum(c[2] for c in counted[True]) > 0  # the oracle did prefetch
    assert all("queue_s" in r for r in runs[True][0]) and not any("queue_s" in r for r in runs[False][0])
    eng = load("qwen3moe-tiny", EngineConfig(slots=8, install="device"))
    try:
        want = decode(eng.model, ref["ids"], 6)[0]
        assert decode(eng.model, ref["ids"], 6, pipelined=True)[0] == want == ref["tokens"][:7]
    finally:
        eng.close()


def test_the_device_install_prefetches_on_the_decode_stream_unless_asked():
    """`overlap` unset: the host installs start each layer's compute at once, the device install
    queues its prefetches on the decode stream (measured faster on the H200, docs/gpu.md); an
    explicit setting is kept for every install."""
    for install in (installs.InplaceInstall, installs.CopyInstall, installs.PinnedInstall):
        assert install.overlap(install, EngineConfig()) is True
        assert install.overlap(install, EngineConfig(overlap=False)) is False
    assert installs.DeviceInstall.overlap(installs.DeviceInstall, EngineConfig()) is False
    assert installs.DeviceInstall.overlap(installs.DeviceInstall, EngineConfig(overlap=True)) is True
    assert EngineConfig().overlap is None


@pytest.mark.parametrize("overlap", [True, False, None])
def test_a_prefetch_never_crosses_streams_inside_one_evaluation(monkeypatch, reference, fit_traces, overlap):
    """With `overlap`, each prefetch's map step runs on the thread's prefetch stream, after
    everything it reads has been handed to an evaluation of its own, and what it makes is handed to
    the next one: MLX's CUDA backend makes the host wait at a dependency between streams inside
    one evaluation, which would put a host synchronisation back inside the token. Without
    `overlap`, as by default (None), the step queues on the decode stream."""
    calls = []
    real_async = mx.async_eval

    def flat(args):
        return [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]

    def spy_async(*args):
        calls.append(("eval", flat(args)))
        return real_async(*args)

    decode_stream = mx.default_stream(mx.default_device())
    if device.kind() == "gpu":  # every prefetch is a job of a step kernel, alone or riding along
        real_kernel = devicecache.step_kernel

        def spy_kernel(jobs, tier=None, tensors=(), after=(), stream=None):
            ahead = [j for j in jobs if not j.demand]
            for j in ahead:
                calls.append(("step", stream if stream is not None else decode_stream, [j.inds, *j.state.arrays()]))
            out = real_kernel(jobs, tier, tensors, after, stream)
            calls.extend(("made", new.arrays()) for j, (new, _) in zip(jobs, out) if not j.demand)
            return out

        monkeypatch.setattr(devicecache, "step_kernel", spy_kernel)
    else:
        real_step = devicecache.prefetch_step_ops

        def spy_step(state, inds, slots, protect_recent=False):
            on = mx.default_stream(mx.default_device())  # the stream the operations are made on
            calls.append(("step", on, [inds, *state.arrays()]))
            new, fill = real_step(state, inds, slots, protect_recent)
            calls.append(("made", new.arrays()))
            return new, fill

        monkeypatch.setattr(devicecache, "prefetch_step_ops", spy_step)
    monkeypatch.setattr(mx, "async_eval", spy_async)
    ref = reference("qwen3moe-tiny")
    _, logits = run_with(
        "qwen3moe-tiny", ref, "oracle", 1, fit_traces("qwen3moe-tiny"), install="device", overlap=overlap
    )
    assert max_abs_diff(ref["logits"], logits) == 0.0
    steps = [i for i, c in enumerate(calls) if c[0] == "step"]
    assert len(steps) > 10
    for i in steps:
        _, on, read = calls[i]
        if overlap is not True:
            assert on == decode_stream
            continue
        assert on == stats.prefetch_stream() != decode_stream
        assert calls[i - 1][0] == "eval" and all(any(a is b for b in calls[i - 1][1]) for a in read)
        after = next(c for c in calls[i + 2 :] if c[0] == "eval")[1]
        assert all(any(a is b for b in after) for a in calls[i + 1][1])


def test_device_oracle_prefetch_leaves_no_demand_miss_after_warmup(reference, fit_traces):
    ref = reference("qwen3moe-tiny")
    records, _ = run_with("qwen3moe-tiny", ref, "oracle", 1, fit_traces("qwen3moe-tiny"), slots=32, install="device")
    dec = records[2:]  # past the prefill and the first decode step
    assert sum(r["useful"] for r in dec) > 0
    assert sum(r["wasted"] for r in dec) == 0
    assert sum(r["misses"] for r in dec) == 0


def test_a_prompt_larger_than_the_table_copies_its_area_and_leaves_its_most_named_experts_resident():
    """A prompt routing to more experts than S: one area a layer, the S experts most of its rows
    named (`moe.kept_after_many_rows`) filled into their slots from it."""
    model, tok, _ = load_reference("qwen3moe-tiny")
    from engine.tracing import trace

    ids = tok.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)")
    routed = trace.record(model, ids, 0)["experts"]
    _, _, want = decode(model, ids, 0, keep_logits=True)
    for ahead in (False, True):
        eng = load("qwen3moe-tiny", EngineConfig(slots=16, install="device", area_ahead=ahead))
        try:
            _, records, got = decode(eng.model, ids, 0, keep_logits=True)
            for layer in range(len(eng.cache.slots)):
                used, named = np.unique(routed[:, layer], return_counts=True)
                times = dict(zip(used.tolist(), named.tolist()))
                kept = set(eng.cache.resident(layer).tolist()) - {-1}
                assert len(kept) == 16 and min(times[e] for e in kept) >= max(times[e] for e in set(times) - kept)
                # an empty table: its misses are the kept experts, filled once each
                assert int(np.array(eng.cache.states[layer].counters)[1]) == len(kept)
        finally:
            eng.close()
        assert records[0]["many_rows"] == len(eng.cache.slots)
        assert max_abs_diff(want, got) == 0.0


class Counting:
    """A stand-in for a module's `np` that counts MLX arrays read back to the host."""

    def __init__(self, real):
        self.real, self.reads = real, 0

    def __getattr__(self, name):
        attr = getattr(self.real, name)
        if name in ("array", "asarray"):

            def read(a, *args, **kw):
                if isinstance(a, mx.array):
                    self.reads += 1
                return attr(a, *args, **kw)

            return read
        return attr


@pytest.mark.parametrize("install", ["device", "inplace"])
def test_host_synchronisations_per_decode_token(monkeypatch, install):
    """Per decode token, the device install reads nothing back inside the model call and is
    evaluated once (the decode loop's); Algorithm 1's path reads the routing back at every MoE
    layer (which this counter sees, so it would see the device install do so)."""
    counts = Counting(np)
    monkeypatch.setattr(hostcache, "np", counts)
    monkeypatch.setattr(devicecache, "np", counts)
    evals = []
    real_eval, real_async = mx.eval, mx.async_eval
    monkeypatch.setattr(mx, "eval", lambda *a: evals.append("eval") or real_eval(*a))
    monkeypatch.setattr(mx, "async_eval", lambda *a: evals.append("async") or real_async(*a))
    eng = load("olmoe-tiny", EngineConfig(slots=16, install=install))
    try:
        ids = eng.tokenizer.encode("def main():")
        inp = mx.array(ids, dtype=mx.uint32)[None]
        cache = mlx_lm.models.cache.make_prompt_cache(eng.model)
        real_eval(eng.model(inp, cache=cache))  # the prefill
        layers = len(eng.cache.slots)
        per_token = []
        for tok in (5, 17, 33, 2):
            counts.reads, evals[:] = 0, []
            logits = eng.model(mx.array([[tok]], dtype=mx.uint32), cache=cache)
            mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
            per_token.append((counts.reads, evals.count("eval")))
    finally:
        eng.close()
    if install == "device":
        assert per_token == [(0, 1)] * 4
    else:
        assert all(reads == layers for reads, _ in per_token)


def test_aligned_zeros_makes_arrays_past_two_to_the_31_elements():
    """A host tier of more than 2 GiB of experts (Mixtral's is 25 GB) is one MLX array although
    MLX's dimensions are 32-bit: zeroed, every row starting on a page, written through its host
    view and read back by MLX."""
    rows, inner = 513, 1 << 22  # 2^31 + 2^22 bytes
    a = aligned_zeros((rows, inner), mx.uint8)
    assert a.shape == (rows, inner)
    view = host_view(a)
    assert [view[r].ctypes.data % 4096 for r in (0, 1, rows - 1)] == [0, 0, 0]
    view[rows - 1, inner - 1], view[1, 0] = 7, 3
    assert (a[rows - 1, inner - 1].item(), a[1, 0].item(), a[2].max().item()) == (7, 3, 0)


def test_device_install_exact_over_a_host_tier_of_padded_rows(reference, monkeypatch):
    """The device install's operations (its form where CUDA is not; forced here on any backend)
    read the host tier however it is laid out: with the rows padded as past 2^31 elements (forced
    here on a small model), its logits equal mlx-lm's."""
    monkeypatch.setattr("engine.runtime.slots.FLAT_LIMIT", 1)
    real = devicecache.DeviceCache.__init__
    monkeypatch.setattr(
        devicecache.DeviceCache, "__init__", lambda self, *a, **k: real(self, *a, **{**k, "mode": "ops"})
    )
    ref = reference("olmoe-tiny")
    eng = load("olmoe-tiny", EngineConfig(slots=16, install="device"))
    try:
        tier = eng.cache.tier
        assert host_view(tier.array).strides[0] > tier.record_bytes  # the padded layout
        _, _, logits = decode(eng.model, ref["ids"], len(ref["tokens"]) - 1, forced=ref["tokens"], keep_logits=True)
    finally:
        eng.close()
    assert max_abs_diff(ref["logits"], logits) == 0.0


def test_the_host_tier_is_refused_by_name_when_it_does_not_fit(monkeypatch):
    monkeypatch.setattr(hosttier, "available_bytes", lambda: 1_000_000)
    with pytest.raises(ValueError, match=r"--install device cannot run here: its host tier \(0\.\d+ GB\) does not fit"):
        load("olmoe-tiny", EngineConfig(slots=16, install="device"))
    with pytest.raises(hosttier.HostTierError, match=r"needs 0\.\d+ GB of host memory .* has 0\.00 GB available"):
        from engine.models import registry
        from engine.runtime.engine import open_store

        model, _, spec, path = registry.load("olmoe-tiny", lazy=True)
        store = open_store("olmoe-tiny", model, path)
        try:
            hosttier.HostTier(store, cuda=False)
        finally:
            store.close()


def test_auto_steps_back_to_pinned_where_the_host_tier_does_not_fit(monkeypatch, capsys):
    """The engine runs what installs.choose picks, once: on a CUDA GPU whose host memory cannot
    hold the host tier, `auto` says so and runs `pinned` (here, as on the CPU, what `pinned` is)."""
    monkeypatch.setattr(device, "pinned_unavailable", lambda: None)
    monkeypatch.setattr(device, "kind", lambda: "gpu")
    monkeypatch.setattr(device, "_SAID", set())
    monkeypatch.setattr(hosttier, "fits", lambda n, margin=0.8: False)
    assert installs.choose("auto", 10**9) is installs.PinnedInstall
    assert "install auto: pinned, not device: its host tier" in capsys.readouterr().err


# -- on a CUDA GPU: the kernels ---------------------------------------------------------------------
@gpu_only
@pytest.mark.parametrize("E,S", [(16, 6), (64, 16), (128, 48)])  # 48: lanes of the warp own two slots
def test_the_map_kernel_gives_the_operations_maps(E, S):
    rng = np.random.default_rng(7)
    a, b = MapState.empty(E, S), MapState.empty(E, S)
    for i, inds in enumerate(random_steps(rng, E, S, 100)):
        a, fa = map_step_ops(a, mx.array(inds), S)
        b, fb = kernels.map_step_kernel(b, mx.array(inds), S)
        pred = mx.array(rng.choice(E, size=6, replace=False).astype(np.int32))
        protect = i % 2 == 1
        a, pa = ops.prefetch_step_ops(a, pred, S, protect_recent=protect)
        b, pb = kernels.prefetch_step_kernel(b, pred, S, protect_recent=protect)
        for x, y in zip(a.fields() + [pa.experts, pa.slots, pa.count], b.fields() + [pb.experts, pb.slots, pb.count]):
            assert np.array_equal(np.array(x), np.array(y))
        for x, y in zip(
            a.fields() + [fa.remapped, fa.experts, fa.slots, fa.count],
            b.fields() + [fb.remapped, fb.experts, fb.slots, fb.count],
        ):
            assert np.array_equal(np.array(x), np.array(y))


@gpu_only
def test_the_step_kernel_writes_the_slots_in_place_and_nothing_else():
    """Through the tables' own pointers: the named slots take the host tier's records and the others
    keep their bytes, also after the tables were read on the host (which moves a CUDA array's
    memory: a fill writing through an address taken before would miss the table)."""
    eng = load("olmoe-tiny", EngineConfig(slots=8, install="device"))
    try:
        cache, state = eng.cache, eng.cache.states[0]
        for wanted in ([3, 9, 40, 63], [1, 9, 2, 7, 5]):
            resident = set(np.array(state.expert_in).tolist())
            before = [np.array(b) for b in cache.tables[0]]  # a host read of every table
            job = kernels.Job(state, mx.array(wanted, mx.int32), 8, layer=cache.layer_ids[0], tables=cache.tables[0])
            ((state, fill),) = kernels.step_kernel([job], cache.tier, cache.tensors)
            mx.eval(fill.remapped)
            n = int(fill.count[0])
            filled = dict(zip(np.array(fill.experts)[:n].tolist(), np.array(fill.slots)[:n].tolist()))
            assert set(filled) == set(wanted) - resident
            for t, b, old in zip(cache.tensors, cache.tables[0], before):
                now = np.array(b)
                for e, s in filled.items():
                    row = cache.tier.rows[cache.tier.row(0, e)][t.offset : t.offset + t.nbytes]
                    assert now[s].tobytes() == row.tobytes()
                others = [s for s in range(8) if s not in set(filled.values())]
                assert np.array_equal(now[others], old[others])
    finally:
        eng.close()


@gpu_only
def test_stream_generate_through_the_device_install_gives_mlx_lms_tokens():
    model, tok, _ = load_reference("qwen3moe-tiny")
    text = " ".join(["def f(x): return x * 2 if x > 0 else -x"] * 40)
    ids = tok.encode(text)[:300]
    want = [r.token for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=16)]
    for slots in (8, 32, 128):
        eng = load("qwen3moe-tiny", EngineConfig(slots=slots, install="device"))
        try:
            got = [r.token for r in mlx_lm.stream_generate(eng.model, eng.tokenizer, ids, max_tokens=16)]
        finally:
            eng.close()
        assert got == want, slots


def test_an_engine_dropped_without_close_gives_its_host_tier_back():
    """The tier (on a CUDA GPU registered, pinned host memory) goes with the last engine reading
    it, closed or not; a later engine fills a new one."""
    eng = load("olmoe-tiny", EngineConfig(slots=16, install="device"))
    tier = weakref.ref(eng.cache.tier)
    del eng
    gc.collect()
    assert tier() is None and not hosttier._SHARED
    again = load("olmoe-tiny", EngineConfig(slots=16, install="device"))
    try:
        assert again.cache.tier.users == 1
    finally:
        again.close()
    assert not hosttier._SHARED


def test_a_closed_engine_frees_its_device_arrays_without_the_garbage_collector():
    """close() and del give back every array the install made, at once: nothing of it waits in a
    reference cycle for the collector, which a bench's next configuration would otherwise count,
    or see freed in the middle of its own load."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    gc.disable()
    try:
        eng = load("olmoe-tiny-f32", EngineConfig(slots=16, install="device"))
        ids = eng.tokenizer.encode("a closed engine")
        list(mlx_lm.stream_generate(eng.model, eng.tokenizer, ids, max_tokens=2))
        held = mx.get_active_memory() - before
        eng.close()
        del eng
        mx.clear_cache()
        left = mx.get_active_memory() - before
    finally:
        gc.enable()
    assert held > 1 << 20
    assert left < held / 100, (held, left)


def test_engines_of_one_store_share_its_host_tier():
    """A bench loads several engines of one model: the host tier is filled (and on CUDA pinned) once,
    and freed when the last of them closes."""
    a = load("olmoe-tiny", EngineConfig(slots=16, install="device"))
    b = load("olmoe-tiny", EngineConfig(slots=8, install="device"))
    try:
        assert a.cache.tier is b.cache.tier
        assert len(hosttier._SHARED) == 1
    finally:
        a.close()
        assert len(hosttier._SHARED) == 1  # b still reads it
        b.close()
    assert not hosttier._SHARED
