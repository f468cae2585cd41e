"""The thread ablation: on this MLX version an array created in one thread cannot be evaluated
in another (streams are thread-local), which is why the engine's reader threads only read into
host buffers and every MLX call is made by the decode thread (checked on the engine itself)."""

import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import PROMPT, force_pinned

from engine import EngineConfig, load
from engine.models.registry import load_reference
from engine.runtime import hostcache, slots, staging
from engine.runtime import store as store_mod
from engine.runtime.loop import decode
from engine.tracing import trace


def test_an_array_made_in_a_reader_thread_cannot_be_evaluated_elsewhere():
    box = {}

    def reader():
        box["a"] = mx.array(np.arange(8, dtype=np.float32)) * 2  # lazy: evaluated later, elsewhere

    t = threading.Thread(target=reader)
    t.start()
    t.join()
    with pytest.raises(RuntimeError, match="no Stream"):
        mx.eval(box["a"])


class _Spy:
    """Stands in for `mlx.core` inside the engine's modules: records the thread of every call."""

    def __init__(self, real, seen):
        self._real, self._seen = real, seen

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if not callable(attr):
            return attr

        def call(*a, **k):
            self._seen.add(threading.current_thread().name)
            return attr(*a, **k)

        return call


@pytest.mark.parametrize("install", ["inplace", "copy", "pinned"])
def test_reader_threads_only_read_and_mlx_runs_in_the_decode_thread(monkeypatch, install):
    """Every MLX call the engine makes (arrays from records, installs, copies) happens in the
    decode thread; the reader threads only read, into host buffers (NumPy or slot memory)."""
    if install == "pinned":
        force_pinned(monkeypatch)
    mlx_threads, read_threads, dest_types = set(), set(), set()
    for mod in (hostcache, staging, slots, store_mod):
        monkeypatch.setattr(mod, "mx", _Spy(mx, mlx_threads))
    real_read = store_mod.Store.read_into

    def read_into(self, layer, expert, dests):
        read_threads.add(threading.current_thread().name)
        dest_types.update(type(d) for d in dests)
        return real_read(self, layer, expert, dests)

    monkeypatch.setattr(store_mod.Store, "read_into", read_into)
    eng = load("qwen3moe-tiny", EngineConfig(slots=16, install=install, readers=4, predictor="oracle"))
    try:
        ids = eng.tokenizer.encode(PROMPT)
        eng.bind_oracle(trace.record(load_reference("qwen3moe-tiny")[0], ids, 4)["experts"])
        mlx_threads.clear()
        decode(eng.model, ids, 4)
        assert eng.counters()["misses"] > 0 and eng.cache.stats.useful > 0
    finally:
        eng.close()
    assert mlx_threads == {threading.main_thread().name}
    assert any(t.startswith("titan-reader") for t in read_threads), read_threads  # prefetches, at least
    assert dest_types <= {np.ndarray, memoryview}, dest_types


def test_control_the_spy_sees_a_call_from_another_thread(monkeypatch):
    seen = set()
    monkeypatch.setattr(hostcache, "mx", _Spy(mx, seen))
    t = threading.Thread(target=lambda: hostcache.mx.array([1.0]), name="titan-reader-x")
    t.start()
    t.join()
    assert seen == {"titan-reader-x"}
