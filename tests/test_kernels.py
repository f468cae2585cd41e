"""The engine's CUDA kernels, checked where there is no GPU (tests/cuda_emulator.py): every kernel
the device install can launch is well-formed C++ with the arguments the engine gives it, and the
layer step kernel, run on the CPU as threads with CUDA's barriers and warp shuffles, computes what
the MLX operations compute: the same maps, fill lists and remapped indices, the same bytes in the
slot tables, and through the engine the logits of mlx-lm. On a GPU the same comparisons run on
the device (tests/test_kernels.py)."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import cpu_only, run_engine, run_with
from cuda_emulator import CXX, Emulator, address, compiles_alone

from engine import device, max_abs_diff
from engine.runtime import staging
from engine.runtime.device import cache as devicecache
from engine.runtime.device import hosttier, kernels
from engine.runtime.device.kernels import Job
from engine.runtime.device.ops import area_ops, fill_ops, map_step_ops, prefetch_step_ops
from engine.runtime.device.state import MapState
from engine.runtime.store import TensorSpec

pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (g++ or clang++)")

TENSORS = [
    TensorSpec("gate_proj.weight", (8, 4), "uint32", 0, 128),
    TensorSpec("gate_proj.scales", (8, 2), "float16", 128, 32),
    TensorSpec("gate_proj.biases", (8, 2), "bfloat16", 160, 32),
    TensorSpec("odd", (3,), "float32", 192, 12),  # a tensor whose widest load is 4 bytes
]
RECORD = 208


@pytest.fixture
def emulated(monkeypatch):
    """mx.fast.cuda_kernel as the emulator (kernels made through it must not outlive the test)."""

    def use(**kw):
        emu = Emulator(**kw)
        monkeypatch.setattr(mx.fast, "cuda_kernel", emu, raising=False)
        staging.cuda_kernel.cache_clear()
        return emu

    yield use
    staging.cuda_kernel.cache_clear()


class Tier:
    """A host tier of random records as the kernels see one: `base`, the address of its rows."""

    def __init__(self, layers, experts, seed=0):
        rng = np.random.default_rng(seed)
        self.num_experts, self.record_bytes = experts, RECORD
        self.array = mx.array(rng.integers(0, 256, (layers * experts, RECORD), dtype=np.uint8))
        mx.eval(self.array)
        self.base = mx.array([address(self.array)], mx.uint64)


def tables(layers, S):
    out = [[mx.zeros((S, *t.shape), getattr(mx, t.dtype)) for t in TENSORS] for _ in range(layers)]
    mx.eval(out)
    return out


def test_every_kernel_the_device_install_launches_is_well_formed(emulated):
    emu = emulated(run=False)
    E, S = 64, 16
    state = MapState.empty(E, S)
    kernels.map_step_kernel(state, mx.array([3, 9, 40, 63, 1, 2, 5, 7], mx.int32), S)
    kernels.map_step_kernel(state, mx.array([[[3, 9, 40, 63, 1, 2, 5, 7]]], mx.uint32), S)  # the router's own
    for protect in (False, True):
        kernels.prefetch_step_kernel(state, mx.array([3, -1, 40], mx.int32), S, protect)
    tier = type("Tier", (), dict(base=mx.array([0], mx.uint64), record_bytes=RECORD, num_experts=E))()
    tabs, layer = tables(2, S), mx.array([1], mx.uint32)
    inds = mx.array([[[3, 9, 40, 63, 1, 2, 5, 7]]], mx.uint32)
    for after in ((), (mx.zeros((1, 1, 8, 128)),), (mx.zeros((2,)), mx.zeros((3,)))):
        jobs = [
            Job(state, inds, S, layer=layer, tables=tabs[0]),
            Job(MapState.empty(E, 12), inds[0, 0, :4], 12, False, False, layer, tabs[1]),
        ]
        kernels.step_kernel(jobs, tier, TENSORS, after)
    kernels.step_kernel([Job(state, inds[0, 0], S, False, True, layer, tabs[1])], tier, TENSORS)
    with pytest.raises(ValueError, match="a job of 12 slots on a map of 16 of 64 experts"):
        kernels.step_kernel([Job(state, inds, 12)])  # a map's block is laid out for its own S
    area = kernels.area_kernel(tier, layer, state, tabs[0], TENSORS, inds)  # the experts rows name
    kernels.area_kernel(tier, layer, state, tabs[0], TENSORS)  # every expert
    settle = Job(state, inds, S, layer=layer, tables=tabs[0], source=tuple(area))  # a fill from an area
    kernels.step_kernel([settle], tier, TENSORS, (mx.zeros((2,)),))
    staging.copy_kernel(TENSORS, RECORD)(
        inputs=[mx.array([0], mx.uint64), mx.array(np.arange(8, dtype=np.uint8))],
        output_shapes=[(8, *t.shape) for t in TENSORS] + [(1,)],
        output_dtypes=[getattr(mx, t.dtype) for t in TENSORS] + [mx.uint32],
        grid=(1024, 1, 1),
        threadgroup=(256, 1, 1),
    )
    assert (
        len(emu.sources) >= 11
    )  # map (2 index types), prefetch (2), step (3 orderings, 1 alone), area (2), settle, stage


def test_a_job_costs_the_launch_its_map_as_one_array_in_and_out():
    """Each array of a launch is host work on the GPU (an output about 2 µs): a job hands the step
    kernel its indices, its map's block and its layer, and takes back its map's block (the fill
    list in it) and, for a demand step, the remapped indices; the tables and ordering inputs follow."""
    kinds = ((True, False), (False, False))  # (demand, filled from an area) a job
    ins, outs, _, dtypes = kernels.step_signature(kinds, tuple(TENSORS), RECORD, 64, (16, 16), 2)
    assert outs == ("state_o0", "remapped0", "state_o1") and dtypes == [mx.int32, mx.uint32, mx.int32]
    head = [n for n in ins if not n.startswith(("tab", "after"))]
    assert head == ["base", "inds0", "state0", "layer0", "inds1", "state1", "layer1"]
    assert len(ins) == len(head) + 2 * len(TENSORS) + 2


def test_a_broken_kernel_is_caught():
    """The check can fail: a body naming an input the kernel does not have."""
    assert not compiles_alone("k", ["a"], [mx.zeros((2,), mx.int32)], ["o"], [mx.int32], "o[0] = b[0];")


@cpu_only  # on a GPU the kernels themselves run (tests/test_kernels.py)
@pytest.mark.parametrize("E,S", [(16, 6), (64, 16), (128, 48)])  # 48: lanes of the warp own two slots
def test_the_step_kernel_computes_what_the_operations_compute(emulated, E, S):
    """A layer's demand step with a prefetch into another layer riding along, and prefetches alone
    (sparing the latest step's slots or not), run as the kernel on emulated threads in three
    blocks (each runs the map steps; block 0 writes them out; all copy): maps, fill lists,
    remapped indices and every table byte are the operations' (map_step_ops, fill_ops)."""
    emu = emulated()
    L, rng = 3, np.random.default_rng(E + S)
    tier = Tier(L, E, seed=E)
    tabs_a, tabs_b = tables(L, S), tables(L, S)
    ops, kern = [MapState.empty(E, S) for _ in range(L)], [MapState.empty(E, S) for _ in range(L)]
    for i in range(45):
        layer, target = i % L, (i + 1) % L
        inds = rng.choice(E, size=min(8, S), replace=False).astype(np.int32)
        if i % 5 == 4:  # a prefill-like step: repeats, ignored pairs, more entries than a warp's lanes
            inds = rng.choice(rng.choice(E, size=min(S, 9), replace=False), size=40).astype(np.int32)
            inds[rng.random(40) < 0.3] = -1
        pred = rng.choice(E, size=6, replace=False).astype(np.int32)
        pred[rng.random(6) < 0.2] = -1
        if i % 7 == 3:  # a prefetch alone, onto the layer just computed: sparing its slots
            ops[layer], fa = prefetch_step_ops(ops[layer], mx.array(pred), S, protect_recent=True)
            fill_ops(tier, layer, tabs_a[layer], TENSORS, fa)
            job = Job(kern[layer], mx.array(pred), S, False, True, mx.array([layer], mx.uint32), tabs_b[layer])
            ((kern[layer], fb),) = kernels.step_kernel([job], tier, TENSORS)
            pairs = [(ops[layer], kern[layer], fa, fb)]
        else:
            ops[target], pa = prefetch_step_ops(ops[target], mx.array(pred), S)
            fill_ops(tier, target, tabs_a[target], TENSORS, pa)
            ops[layer], fa = map_step_ops(ops[layer], mx.array(inds), S)
            fill_ops(tier, layer, tabs_a[layer], TENSORS, fa)
            decode = i % 5 != 4
            given = (
                mx.array(inds.astype(np.uint32)[None, None]) if decode else mx.array(inds)
            )  # as the router gives them
            jobs = [
                Job(kern[layer], given, S, layer=mx.array([layer], mx.uint32), tables=tabs_b[layer]),
                Job(kern[target], mx.array(pred), S, False, False, mx.array([target], mx.uint32), tabs_b[target]),
            ]
            (kern[layer], fb), (kern[target], pb) = kernels.step_kernel(jobs, tier, TENSORS)
            assert fb.remapped.shape == given.shape
            assert np.array_equal(np.array(fb.remapped).reshape(-1), np.array(fa.remapped))
            pairs = [(ops[layer], kern[layer], fa, fb), (ops[target], kern[target], pa, pb)]
        for a, b, fa, fb in pairs:
            for x, y in zip(
                a.fields() + [fa.experts, fa.slots, fa.count], b.fields() + [fb.experts, fb.slots, fb.count]
            ):
                assert np.array_equal(np.array(x), np.array(y)), i
        for ta, tb in zip(tabs_a, tabs_b):
            for x, y in zip(ta, tb):
                assert memoryview(x).tobytes() == memoryview(y).tobytes(), i
    assert emu.launches == 45
    counters = np.array(mx.stack([s.counters for s in kern]))
    assert counters[:, 1].sum() > 0 and counters[:, 2].sum() > 0  # misses filled and prefetches issued


@cpu_only  # on a GPU: tests/test_kernels.py::test_the_map_kernel_gives_the_operations_maps
@pytest.mark.parametrize("E,S", [(16, 6), (64, 16)])
def test_the_map_kernels_without_a_fill_compute_what_the_operations_compute(emulated, E, S):
    """A step kernel with no tier and no tables (map_step_kernel, prefetch_step_kernel) reads and
    writes its map's block in the block's own layout, as the kernel with a fill does."""
    emulated()
    rng = np.random.default_rng(E)
    a, b = MapState.empty(E, S), MapState.empty(E, S)
    for i in range(12):
        inds = mx.array(rng.choice(E, size=min(8, S), replace=False).astype(np.int32))
        a, fa = map_step_ops(a, inds, S)
        b, fb = kernels.map_step_kernel(b, inds, S)
        assert np.array_equal(np.array(fa.remapped), np.array(fb.remapped)), i
        pred = mx.array(rng.choice(E, size=6, replace=False).astype(np.int32))
        a, pa = prefetch_step_ops(a, pred, S, protect_recent=i % 2 == 1)
        b, pb = kernels.prefetch_step_kernel(b, pred, S, protect_recent=i % 2 == 1)
        ours, theirs = a.fields() + [fa.experts, pa.experts, pa.count], b.fields() + [fb.experts, pb.experts, pb.count]
        for x, y in zip(ours, theirs):
            assert np.array_equal(np.array(x), np.array(y)), i


@cpu_only
@pytest.mark.parametrize("E,S", [(16, 6), (64, 16)])
def test_the_area_kernel_copies_each_named_expert_from_its_slot_or_the_host_tier(emulated, E, S):
    """A many-rows area made by the kernel on emulated threads in three blocks: each expert the rows
    name is at its own index, a resident one with its slot's bytes (device memory, here made to
    differ from the tier's so that the source shows), any other with its host tier record's; with
    no indices, every expert. A fill of the slots from it (a job with a `source`) writes what
    fill_ops writes from it."""
    emulated(blocks=3, threads=64)
    tier, tabs, layer = Tier(2, E, seed=E), tables(2, S), mx.array([1], mx.uint32)
    state, fill = map_step_ops(MapState.empty(E, S), mx.array([3, 5, 7, 9], mx.int32), S)
    fill_ops(tier, 1, tabs[1], TENSORS, fill)
    slots = [t + 1 if t.dtype != mx.uint32 else t ^ 0xFFFF for t in tabs[1]]  # no longer the tier's bytes
    mx.eval(state.block, slots)
    whole = area_ops(tier, 1, TENSORS)
    slot_of = np.array(state.slot_of)
    rows = np.array([[3, 11, 5], [11, 2, 3]], np.uint32)
    for inds in (mx.array(rows), None):
        area = kernels.area_kernel(tier, layer, state, slots, TENSORS, inds)
        named = np.unique(rows) if inds is not None else np.arange(E)
        for i, t in enumerate(TENSORS):
            for e in named:
                src = slots[i][int(slot_of[e])] if slot_of[e] >= 0 else whole[i][int(e)]
                assert memoryview(area[i][int(e)]).tobytes() == memoryview(src).tobytes(), (t.name, e)
    # the router's latest rows (uint32), and what moe.kept_after_many_rows gives (int32, -1 past the kept)
    for last in (mx.array([[2, 11, 5, 3]], mx.uint32), mx.array([2, 11, 5, 3] + [-1] * (S - 4), mx.int32)):
        a, fa = map_step_ops(state, last.reshape(-1).astype(mx.int32), S)
        ours, theirs = [mx.array(t) for t in slots], [mx.array(t) for t in slots]
        fill_ops(tier, 1, ours, TENSORS, fa, source=area)
        job = Job(state, last, S, layer=layer, tables=theirs, source=tuple(area))
        ((b, fb),) = kernels.step_kernel([job], tier, TENSORS)
        assert np.array_equal(np.array(a.block)[: E + 3 * S], np.array(b.block)[: E + 3 * S])
        for x, y in zip(ours, theirs):
            assert memoryview(x).tobytes() == memoryview(y).tobytes()


@pytest.fixture
def emulated_device(emulated, monkeypatch):
    """The device install on the CPU with its CUDA kernels run by the emulator (mode "kernel")."""
    emu = emulated(blocks=2, threads=64)  # smaller than the launch's grid: the copies stride over it
    monkeypatch.setattr(device, "pinned_unavailable", lambda: None)
    acquire = hosttier.acquire

    def cpu_tier(store, cuda):
        tier = acquire(store, cuda=False)
        tier.base = mx.array([address(tier.array)], mx.uint64)
        return tier

    monkeypatch.setattr(hosttier, "acquire", cpu_tier)
    init = devicecache.DeviceCache.__init__
    monkeypatch.setattr(
        devicecache.DeviceCache, "__init__", lambda self, *a, **kw: init(self, *a, **{**kw, "mode": "kernel"})
    )
    return emu


@cpu_only
@pytest.mark.parametrize("name,depth", [("probe", 2), ("oracle", 3)])
def test_the_engine_on_the_emulated_kernels_gives_mlx_lms_logits(emulated_device, reference, fit_traces, name, depth):
    """The device install's kernel path end to end on the CPU: every layer one step kernel (its
    demand step, the prefetch for layer l+d riding along on the decode stream; at d = 3 onto the
    very layer, a prefetch alone after its compute), the prompt's prefill in expert batches, the
    slot tables written through their pointers; the logits are mlx-lm's bit for bit and the
    prefetches were useful."""
    ref = reference("qwen3moe-tiny")
    records, logits = run_with(
        "qwen3moe-tiny", ref, name, depth, fit_traces("qwen3moe-tiny"), install="device", overlap=False
    )
    assert max_abs_diff(ref["logits"], logits) == 0.0
    assert emulated_device.launches > 0 and sum(r["useful"] for r in records[1:]) > 0
    assert sum(r["misses"] for r in records) > 0


@cpu_only
@pytest.mark.parametrize("slots", [2, 4])
def test_mixtrals_shape_on_the_emulated_kernels_gives_mlx_lms_logits(emulated_device, reference, slots):
    """Mixtral's routing (8 experts, top 2: fewer experts than a warp's lanes) at S = top-k and at
    half the experts, demand loading through the step kernels, the prompt through the many-rows
    area: mlx-lm's logits. (On an H100, `mixtral-8x7b-shape`'s tokens at these fractions differed
    from resident's because resident's own varied between runs, docs/gpu.md; this pins the kernels'
    own logic at Mixtral's routing.)"""
    ref = reference("tiny-mixtral")
    records, logits, counters = run_engine("tiny-mixtral", ref, slots=slots, install="device", overlap=False)
    assert max_abs_diff(ref["logits"], logits) == 0.0
    assert emulated_device.launches > 0 and counters["misses"] > 0 and records[0]["many_rows"] > 0


@cpu_only
def test_the_emulator_runs_a_warps_lanes_together(emulated):
    """32 lanes exchanging their values through shuffles each end with the sum of all 32: the
    emulator runs threads meeting at barriers, not the body once."""
    emulated()
    src = (
        "int v = threadIdx.x;"
        "for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);"
        "out[threadIdx.x] = v;"
    )
    k = mx.fast.cuda_kernel(name="sum", input_names=["x"], output_names=["out"], source=src)
    (out,) = k(inputs=[mx.zeros((1,), mx.int32)], output_shapes=[(32,)], output_dtypes=[mx.int32],
               grid=(32, 1, 1), threadgroup=(32, 1, 1))  # fmt: skip
    assert np.array(out).tolist() == [sum(range(32))] * 32


@cpu_only
def test_the_tier_read_rate_times_the_install_s_own_kernel_over_layers_spread_over_the_tier(emulated_device):
    """`bench families` records, beside the bus's cudaMemcpy, how fast the device install's own
    kernel reads its host tier (the path of a miss): every expert of layers spread from the first
    to the last, through the area kernel; where the install has no kernel (the CPU's operations),
    nothing is timed and nothing is said."""
    from engine.models import registry
    from engine.runtime.engine import open_store
    from harness.bus import tier_gb_s

    model, _, _, path = registry.load("olmoe-tiny", lazy=True)
    store = open_store("olmoe-tiny", model, path)
    try:
        launches = emulated_device.launches
        read = tier_gb_s(store, layers=3)
        first, middle, last = read["layers"]
        assert first == 0 and 0 < middle < last == store.num_layers - 1
        assert read["bytes"] == store.num_experts(0) * sum(t.nbytes for t in store.tensors) and read["gb_s"] > 0
        assert emulated_device.launches - launches == 1 + 3  # the untimed one, then one per layer
        assert "kernel" in read["how"]
    finally:
        store.close()


@cpu_only
def test_the_tier_read_rate_is_not_measured_where_the_install_has_no_kernel():
    from harness.bus import tier_gb_s

    assert device.pinned_unavailable() is not None  # this machine: the CPU
    assert tier_gb_s(store=None) is None


@cpu_only
def test_the_tier_read_rate_says_why_where_the_host_tier_does_not_fit(emulated_device, monkeypatch):
    from engine.models import registry
    from engine.runtime.engine import open_store
    from harness.bus import tier_gb_s

    monkeypatch.setattr(hosttier, "fits", lambda n, margin=0.8: False)
    model, _, _, path = registry.load("olmoe-tiny", lazy=True)
    store = open_store("olmoe-tiny", model, path)
    try:
        read = tier_gb_s(store)
    finally:
        store.close()
    assert read["gb_s"] is None and read["how"].startswith("not measured: --install device cannot run here")
