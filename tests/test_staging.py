"""The pinned install path (engine.staging): staging records, the copy kernel, batched installs.

On a CUDA GPU these tests run the real path (mapped pinned records and the copy kernel). On the
CPU they run it over `staging.HostMemory`, whose "kernel" is a lazy gather from an MLX array:
the records are read when the graph is evaluated, as on the GPU, so a record handed out again
before its copy has run is caught here too (the control test shows the check can fail).
"""

import concurrent.futures
import gc
import weakref

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from conftest import MODELS, PROMPT, force_pinned, run_with
from mlx_lm.generate import generate_step

from engine import EngineConfig, cudart, device, load, max_abs_diff
from engine.models.registry import load_reference
from engine.predict import predictors
from engine.runtime import installs, staging
from engine.runtime.hostcache import ExpertCache
from engine.runtime.loop import decode
from engine.runtime.prefetch import NoPrefetch, Prefetcher
from engine.runtime.slots import SlotTable
from engine.runtime.store import TensorSpec
from engine.tracing import trace

REAL = device.kind() == "gpu" and device.pinned_unavailable() is None
gpu_only = pytest.mark.skipif(not REAL, reason="GPU-only: needs MLX's CUDA backend and libcudart (the copy kernel)")


@pytest.fixture
def pinned(monkeypatch):
    """`install="pinned"` runs: for real on a CUDA GPU, over HostMemory elsewhere."""
    if REAL:
        return "cuda"
    force_pinned(monkeypatch)
    return "host"


def _memory(records, record_bytes, tensors):
    return (staging.CudaMemory if REAL else staging.HostMemory)(records, record_bytes, tensors)


# A record with a grain of every width: 16-byte, 4-byte and 2-byte tensors, bfloat16 included.
TENSORS = [
    TensorSpec("a", (4, 8), "uint32", 0, 128),
    TensorSpec("b", (3,), "float32", 128, 12),
    TensorSpec("c", (5,), "bfloat16", 140, 10),
    TensorSpec("d", (2, 3), "float16", 150, 12),
]
RECORD = 4096


def _fill(pool, recs, seed):
    rows = np.random.default_rng(seed).integers(0, 256, (len(recs), RECORD), dtype=np.uint8)
    for r, row in zip(recs, rows):
        pool.view(r)[:] = row
    return rows


def _expected(rows, t):
    return [row[t.offset : t.offset + t.nbytes] for row in rows]


def _bytes(a) -> np.ndarray:
    a = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return np.array(a).reshape(-1).view(np.uint8)


# -- the pool ------------------------------------------------------------------------------------
def test_copy_moves_every_tensor_of_every_record_exactly():
    pool = staging.StagingPool(8, RECORD, TENSORS, _memory(8, RECORD, TENSORS))
    recs = pool.acquire(5)
    rows = _fill(pool, recs, 0)
    order = [recs[3], recs[0], recs[4]]  # any records, in any order
    arrays = pool.copy(order)
    mx.eval(arrays)
    for t, a in zip(TENSORS, arrays):
        assert a.shape == (3, *t.shape) and a.dtype == getattr(mx, t.dtype)
        for got, want in zip(a, _expected(rows[[3, 0, 4]], t)):
            assert np.array_equal(_bytes(got), want), t.name
    pool.close()


def test_a_record_is_handed_out_again_only_after_its_copy_has_run():
    pool = staging.StagingPool(8, RECORD, TENSORS, _memory(8, RECORD, TENSORS))
    first = pool.acquire(8)
    rows = _fill(pool, first, 1)
    arrays = pool.copy(first)  # enqueued, not evaluated: the records are still to be read
    assert pool.acquire(1, wait=False) is None  # reusing one now would mean waiting on the copy
    again = pool.acquire(8)  # waits on the fence, so the copy reads the bytes written before
    assert sorted(again) == sorted(first) and pool.waits == 1
    _fill(pool, again, 2)  # overwrite every record after the wait
    for t, a in zip(TENSORS, arrays):
        for got, want in zip(a, _expected(rows, t)):
            assert np.array_equal(_bytes(got), want), t.name
    pool.close()


def test_held_abandoned_and_discarded_records():
    pool = staging.StagingPool(8, RECORD, TENSORS, _memory(8, RECORD, TENSORS))
    held = pool.acquire(6)
    with pytest.raises(RuntimeError, match="not held"):
        pool.view(next(r for r in range(8) if r not in held))
    fut = concurrent.futures.Future()  # a read still running into held[0]
    pool.abandon(held[0], fut)
    pool.discard(held[1:3])  # failed reads: free at once
    assert pool.available() == 4
    assert len(pool.acquire(4)) == 4
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1)  # held records and a running read are never handed out
    fut.set_result(0.0)
    assert pool.acquire(1) == [held[0]]  # once the read is done, its record is free again
    with pytest.raises(ValueError, match="the pool has 8"):
        pool.acquire(9)
    with pytest.raises(ValueError, match="between 8 and 256"):
        staging.StagingPool(4, RECORD, TENSORS, _memory(8, RECORD, TENSORS))
    pool.close()


def test_batched_install_is_one_scatter_per_tensor_into_the_named_slots():
    mem = _memory(8, RECORD, TENSORS)
    pool = staging.StagingPool(8, RECORD, TENSORS, mem)
    table = SlotTable(0, 16, 6, TENSORS, host_views=False)
    recs = pool.acquire(3)
    rows = _fill(pool, recs, 3)
    table.install_batch([5, 0, 2], pool.copy(recs))
    mx.eval(table.buffers)
    for t, buf in zip(TENSORS, table.buffers):
        for slot, want in zip([5, 0, 2], _expected(rows, t)):
            assert np.array_equal(_bytes(buf[slot]), want)
        assert not _bytes(buf[1]).any()  # untouched slots keep their zeros
    pool.close()


# -- the kernel ----------------------------------------------------------------------------------
def test_kernel_loads_each_tensor_at_its_widest_aligned_grain():
    assert [staging.grain(t.offset, t.nbytes, RECORD) for t in TENSORS] == [16, 4, 2, 2]
    src = staging.kernel_source(TENSORS, RECORD)
    assert src.count("for (size_t i = first;") == len(TENSORS)
    assert "(const uint4*)(area + (unsigned long long)recs[r] * 4096ULL + 0ULL)" in src
    assert "(const unsigned short*)(area + (unsigned long long)recs[r] * 4096ULL + 140ULL)" in src
    other = staging.kernel_source(TENSORS[:2], RECORD)
    assert other != src  # one compiled kernel per layout (its name is the source's digest)


@gpu_only
def test_cuda_kernel_reads_pinned_records_across_pcie():
    mem = staging.CudaMemory(8, RECORD, TENSORS)
    assert mem.device_ptr and mem.host.ctypes.data % staging.PAGE == 0
    test_copy_moves_every_tensor_of_every_record_exactly()
    mem.close()


# -- where it cannot run -------------------------------------------------------------------------
@pytest.mark.skipif(REAL, reason="CPU-only: checks the fallback where there is no CUDA backend")
def test_pinned_says_why_and_falls_back_on_the_cpu(capsys):
    assert "CPU" in device.pinned_unavailable()
    assert installs.choose("pinned", 1) is installs.InplaceInstall
    assert "install pinned needs MLX's CUDA backend" in capsys.readouterr().err
    assert installs.choose("auto", 1) is installs.InplaceInstall
    eng = load("olmoe-tiny", EngineConfig(slots=16, install="pinned"))
    try:
        assert {t.host_views for t in eng.cache.tables} == {True} and eng.install.name == "inplace"
    finally:
        eng.close()


def test_no_cuda_runtime_is_a_named_error(tmp_path):
    missing = tmp_path / "libcudart.so.13"
    with pytest.raises(cudart.CudaError, match=f"no CUDA runtime library.*{missing}"):
        cudart.CudaRuntime(str(missing))


# -- the engine on the pinned path ---------------------------------------------------------------
@pytest.mark.parametrize(
    "model_id,slots", [(m, s) for m, d in MODELS.items() for s in (d["experts"], d["experts"] // 2, d["top_k"])]
)
def test_pinned_logits_bit_identical(reference, pinned, model_id, slots):
    ref = reference(model_id)
    eng = load(model_id, EngineConfig(slots=slots, install="pinned"))
    try:
        assert {t.host_views for t in eng.cache.tables} == {False} and eng.install.name == "pinned"
        _, _, logits = decode(eng.model, ref["ids"], len(ref["tokens"]) - 1, forced=ref["tokens"], keep_logits=True)
        counters = eng.counters()
    finally:
        eng.close()
    assert max_abs_diff(ref["logits"], logits) == 0.0
    if slots < MODELS[model_id]["experts"]:
        assert counters["misses"] > 0 and counters["evictions"] > 0


@pytest.mark.parametrize("name,depth", [("oracle", 2), ("popularity", 1)])
def test_pinned_prefetch_bit_identical(reference, fit_traces, pinned, name, depth):
    """Prefetches land in staging and are installed at the drain; the oracle's are useful, and
    popularity wastes some (a wasted read still running is abandoned, not waited for)."""
    ref = reference("qwen3moe-tiny")
    records, logits = run_with("qwen3moe-tiny", ref, name, depth, fit_traces("qwen3moe-tiny"), install="pinned")
    assert max_abs_diff(ref["logits"], logits) == 0.0
    dec = records[1:]
    assert sum(r["useful"] for r in dec) > 0
    if name == "popularity":
        assert sum(r["wasted"] for r in dec) > 0


class OracleAndMore(predictors.Oracle):
    """The next layer's true experts first, then two it will not use: once the true ones are
    installed at S = top_k, every slot holds an expert the layer needs."""

    def predict(self, ctx):
        true = super().predict(ctx)
        more = [e for e in range(len(true) + 2) if e not in true][:2]
        return np.concatenate([true, np.array(more, np.int64)]) if len(true) else true


@pytest.mark.parametrize("install", ["pinned", "copy"])
def test_prefetch_with_no_slot_to_spare_is_exact(reference, pinned, install):
    """S = top_k with a prefetch that names more than the layer uses. Unlike `inplace` (whose
    reads need a slot to start), these paths read into staging first, so an arrival may find
    every slot held by an expert this layer needs; it is dropped at the drain and counted as
    wasted, and decoding goes on (on the H200 it once stopped: "every resident expert is
    protected")."""
    ref = reference("qwen3moe-tiny")
    top_k = MODELS["qwen3moe-tiny"]["top_k"]
    model, _, _ = load_reference("qwen3moe-tiny")
    oracle = OracleAndMore(depth=1, size=top_k)
    eng = load("qwen3moe-tiny", EngineConfig(slots=top_k, install=install), prefetcher=Prefetcher(oracle, 1))
    try:
        oracle.bind(trace.record(model, ref["ids"], len(ref["tokens"]) - 1)["experts"])
        _, records, logits = decode(
            eng.model, ref["ids"], len(ref["tokens"]) - 1, forced=ref["tokens"], keep_logits=True
        )
    finally:
        eng.close()
    assert max_abs_diff(ref["logits"], logits) == 0.0
    dec = records[1:]
    assert sum(r["useful"] for r in dec) > 0 and sum(r["wasted"] for r in dec) > 0


def _scribbling(monkeypatch):
    """Every record is overwritten with garbage the moment it is handed out: a record reused
    before its copy kernel ran would put that garbage into a slot."""
    real = staging.StagingPool.acquire

    def acquire(self, n, wait=True):
        recs = real(self, n, wait)
        for r in recs or ():
            self.memory.row(r)[:] = 0xA5
        return recs

    monkeypatch.setattr(staging.StagingPool, "acquire", acquire)


def _decode_qwen_small(ref):
    eng = load("qwen3moe-tiny", EngineConfig(slots=16, install="pinned", staging_records=8))
    try:
        _, _, logits = decode(eng.model, ref["ids"], len(ref["tokens"]) - 1, forced=ref["tokens"], keep_logits=True)
        return logits, eng.cache.install.pool.waits
    finally:
        eng.close()


def test_staging_reuse_never_comes_before_the_copy(reference, pinned, monkeypatch):
    ref = reference("qwen3moe-tiny")
    _scribbling(monkeypatch)
    logits, waits = _decode_qwen_small(ref)  # 8 records for a layer's 8 misses: every batch reuses them
    assert waits > 0
    assert max_abs_diff(ref["logits"], logits) == 0.0


def test_control_reuse_without_the_fence_corrupts(reference, pinned, monkeypatch):
    """The check above can fail: with records freed as soon as their copy is enqueued, the
    scribbled garbage reaches the slots."""
    ref = reference("qwen3moe-tiny")
    _scribbling(monkeypatch)

    def copy_without_fence(self, recs):
        arrays, _ = self.memory.copy(recs)
        self.held.difference_update(recs)
        self._free.extend(recs)
        return arrays

    monkeypatch.setattr(staging.StagingPool, "copy", copy_without_fence)
    logits, _ = _decode_qwen_small(ref)
    assert not all(np.array_equal(a, b) for a, b in zip(ref["logits"], logits))


def test_stream_generate_gives_mlx_lms_tokens(pinned):
    """Greedy decoding through mlx-lm's own stream_generate on an engine model (pinned, and the
    device's default install) gives the plain model's tokens."""
    model, tok, _ = load_reference("qwen3moe-tiny")
    prompt = "def fibonacci(n):"
    want = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=24)]
    for install in ("pinned", "auto"):
        eng = load("qwen3moe-tiny", EngineConfig(slots=16, install=install, predictor="previous"))
        try:
            got = [r.token for r in mlx_lm.stream_generate(eng.model, eng.tokenizer, prompt, max_tokens=24)]
            assert eng.counters()["misses"] > 0
        finally:
            eng.close()
        assert got == want, install


@pytest.mark.parametrize("install", ["pinned", "auto"])
def test_closing_an_engine_while_its_next_token_is_queued_is_safe(pinned, install):
    """mlx-lm's generate_step queues the next token before it hands over the current one, so a
    caller that stops reading leaves work queued that reads the engine's mapped host memory (the
    pinned records; the device install's host tier, `auto` on a GPU). close() waits for it before
    unregistering that memory, whose later read would be an illegal access on a GPU (one that
    fails every later CUDA call of the process)."""
    eng = load("qwen3moe-tiny", EngineConfig(slots=8, install=install))
    try:
        prompt = mx.array(eng.tokenizer.encode("def fibonacci(n):"))
        for i, _ in enumerate(generate_step(prompt, eng.model, max_tokens=64)):
            if i == 3:
                break
    finally:
        eng.close()
    assert (mx.arange(8) * 2).sum().item() == 56  # the process's device still computes


class _Runtime:
    """The CUDA runtime calls a registration makes, recorded with whether its memory was still there."""

    def __init__(self):
        self.calls, self.memory = [], None

    def host_register(self, ptr, nbytes):
        self.calls.append(("register", nbytes))
        return ptr

    def synchronize(self):
        self.calls.append(("synchronize",))

    def host_unregister(self, ptr):
        self.calls.append(("unregister", self.memory() is not None))


@pytest.mark.parametrize("how", ["release", "collection"])
def test_registered_memory_is_not_freed_before_it_is_unregistered(how):
    """An engine dropped without close() left its pinned range registered over memory NumPy had
    freed; on the H200 a later host allocation that straddled it made MLX's own host-to-device
    copies fail ("invalid argument"). A registration holds its memory, waits for the device's
    queued work, then unregisters it once, whether it is released or collected."""
    rt = _Runtime()
    host = staging.aligned_empty(3 * staging.PAGE)
    rt.memory = weakref.ref(host.base)
    reg = cudart.Registration(host, rt)
    del host
    gc.collect()
    assert rt.memory() is not None and reg.registered
    if how == "release":
        reg.release()
        assert not reg.registered
    del reg
    gc.collect()
    assert rt.calls == [("register", 3 * staging.PAGE), ("synchronize",), ("unregister", True)]
    assert rt.memory() is None


def test_an_engine_dropped_without_close_gives_its_pinned_memory_back(pinned):
    eng = load("qwen3moe-tiny", EngineConfig(slots=8, install="pinned"))
    prompt = mx.array(eng.tokenizer.encode("def fibonacci(n):"))
    for _ in generate_step(prompt, eng.model, max_tokens=4):
        pass
    memory = weakref.ref(eng.cache.install.pool.memory)
    registration = getattr(memory(), "registration", None)  # on a CUDA GPU
    released = registration._release if registration else None
    del eng, registration
    gc.collect()
    assert memory() is None
    assert released is None or not released.alive


def test_pinned_miss_accounting(pinned):
    """A layer's misses through the pinned path count as misses, bytes and stall, once each."""
    eng = load("olmoe-tiny", EngineConfig(slots=8, install="pinned"))
    try:
        cache = eng.cache
        assert isinstance(cache, ExpertCache) and isinstance(cache.prefetcher, NoPrefetch)
        cache.stats.reset()
        cache.read_misses(0, list(range(8)), protected=set(range(8)))
        mx.eval(eng.cache.tables[0].buffers)
        st = cache.stats
        assert (st.misses, st.bytes_read) == (8, 8 * eng.store.expert_bytes)
        assert st.pread_s > 0 and st.stall_s > 0 and st.array_s > 0
        assert sorted(eng.cache.tables[0].expert_in.tolist()) == list(range(8))
    finally:
        eng.close()


@pytest.mark.parametrize("install", ["inplace", "pinned"])
def test_a_decodes_index_arrays_all_leave_the_small_pool(install, monkeypatch, pinned):
    """Every index array a decode hands the device (its slots, its staging records and their
    slots, its tokens) goes through device_indices, so none is small-pool sized."""
    made = []
    real = device.index_block

    def spy(values, dtype=np.uint32):
        block = real(values, dtype)
        made.append(block.nbytes)
        return block

    monkeypatch.setattr(device, "index_block", spy)
    eng = load("qwen3moe-tiny", EngineConfig(slots=16, install=install))
    try:
        decode(eng.model, eng.tokenizer.encode(PROMPT), 4)
        assert eng.counters()["misses"] > 0
    finally:
        eng.close()
    assert made and min(made) > device.SMALL_POOL_BYTES
