"""The thread ablation: on this MLX version an array created in one thread cannot be evaluated
in another (streams are thread-local), which is why the engine's reader threads return NumPy
views and only the decode thread creates MLX arrays."""

import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import PROMPT

from engine import EngineConfig, load
from engine.models.registry import load_reference
from engine.predict import trace
from engine.runtime import moe
from engine.runtime.loop import decode


def test_an_array_made_in_a_reader_thread_cannot_be_evaluated_elsewhere():
    box = {}

    def reader():
        box["a"] = mx.array(np.arange(8, dtype=np.float32)) * 2  # lazy: evaluated later, elsewhere

    t = threading.Thread(target=reader)
    t.start()
    t.join()
    with pytest.raises(RuntimeError, match="no Stream"):
        mx.eval(box["a"])


def test_numpy_views_from_a_reader_thread_are_safe():
    box = {}

    def reader():
        box["v"] = np.arange(8, dtype=np.float32)  # what the store's readers hand over

    t = threading.Thread(target=reader)
    t.start()
    t.join()
    assert (np.array(mx.array(box["v"]) * 2) == np.arange(8) * 2).all()


@pytest.mark.parametrize("install", ["copy", "inplace"])
def test_engine_makes_mlx_arrays_only_in_the_decode_thread(monkeypatch, install):
    threads = set()
    real = moe.records_to_mx

    def spy(block, tensors, one_array):
        threads.add(threading.current_thread().name)
        assert isinstance(block, np.ndarray)
        return real(block, tensors, one_array)

    monkeypatch.setattr(moe, "records_to_mx", spy)
    eng = load("olmoe-tiny", EngineConfig(slots=16, install=install, readers=4, predictor="oracle"))
    try:
        ids = eng.tokenizer.encode(PROMPT)

        eng.bind_oracle(trace.record(load_reference("olmoe-tiny")[0], ids, 4)["experts"])
        decode(eng.model, ids, 4)
        assert eng.counters()["misses"] > 0
    finally:
        eng.close()
    assert threads <= {threading.main_thread().name}
    if install == "copy":
        assert threads, "copy mode made its arrays through records_to_mx"
