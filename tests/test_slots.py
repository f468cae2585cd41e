"""Slot tables: one expert per slot, installed bytes equal the store's, LRU eviction."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import PROMPT

from engine import EngineConfig, device, load
from engine.device import device_indices, index_block
from engine.runtime.loop import decode
from engine.runtime.slots import LRU, SlotTable
from engine.runtime.store import TensorSpec

TENSORS = [TensorSpec("w", (4,), "float32", 0, 16)]


def check_consistent(table):
    mapped = np.flatnonzero(table.slot_of >= 0)
    slots = table.slot_of[mapped]
    assert len(mapped) <= table.slots
    assert len(set(slots.tolist())) == len(slots), "a slot holds two experts"
    for e in mapped:
        assert table.expert_in[table.slot_of[e]] == e
    for s in np.flatnonzero(table.expert_in >= 0):
        assert table.slot_of[table.expert_in[s]] == s


@pytest.mark.parametrize("install", ["inplace", "copy"])
def test_slots_hold_store_bytes_after_decoding(install):
    eng = load("olmoe-tiny", EngineConfig(slots=16, install=install))
    try:
        ids = eng.tokenizer.encode(PROMPT)
        decode(eng.model, ids, 8)
        assert eng.counters()["evictions"] > 0
        for layer, table in enumerate(eng.cache.tables):
            check_consistent(table)
            mx.eval(table.buffers)
            resident = np.flatnonzero(table.slot_of >= 0)
            views, _ = eng.store.read_batch(layer, resident)
            for e in resident:
                s = table.slot_of[e]
                for buf, want in zip(table.buffers, views[e]):
                    got = bytes(memoryview(mx.contiguous(buf[int(s)])).cast("B"))
                    assert got == want.tobytes(), f"layer {layer} slot {s} differs from expert {e} in the store"
    finally:
        eng.close()


def test_claim_evicts_least_recently_used_outside_protected():
    t = SlotTable(0, num_experts=8, slots=3, tensors=TENSORS)
    for e in (0, 1, 2):
        t.claim(e)
    t.touch([0])  # order now 1, 2, 0
    assert t.claim(3, protected={3}) == 1  # expert 1's slot
    assert not t.resident(1) and t.resident(3)
    assert t.claim(4, protected={2, 4}) == 0  # 2 protected, so 0 goes
    assert t.evictions == 2
    check_consistent(t)


def test_every_expert_protected_is_refused():
    t = SlotTable(0, num_experts=4, slots=2, tensors=TENSORS)
    t.claim(0)
    t.claim(1)
    with pytest.raises(RuntimeError, match="protected"):
        t.claim(2, protected={0, 1, 2})


def test_release_frees_the_slot():
    t = SlotTable(0, num_experts=4, slots=2, tensors=TENSORS)
    s = t.claim(3)
    t.release(3)
    assert not t.resident(3) and t.expert_in[s] == -1
    assert t.claim(1) == s


def test_the_lowest_free_slot_is_taken_first():
    """Trace replay (simulate.py) and the engine place experts alike, whatever order slots freed in."""
    t = SlotTable(0, num_experts=8, slots=6, tensors=TENSORS)
    for e in range(6):
        assert t.claim(e) == e
    for e in (4, 1, 5):
        t.release(e)
    assert [t.claim(e) for e in (6, 7, 4)] == [1, 4, 5]
    assert t.claim(1, protected={2, 3, 4, 6, 7}) == 0  # full again: expert 0's slot
    check_consistent(t)


def test_inplace_write_is_seen_by_mlx():
    t = SlotTable(0, num_experts=4, slots=2, tensors=TENSORS)
    (dest,) = t.dests(1)
    dest[:] = np.arange(4, dtype=np.float32).tobytes()
    assert t.buffers[0][1].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert t.buffers[0][0].tolist() == [0.0] * 4


def test_lru_order():
    p = LRU(3)
    for e in (5, 6, 7):
        p.touch(e)
    p.touch(5)
    assert p.victim(set()) == 6
    p.remove(6)
    assert p.victim({7}) == 5


def test_slot_indices_refuse_non_resident():
    t = SlotTable(0, num_experts=4, slots=2, tensors=TENSORS)
    t.claim(2)
    assert t.slot_indices(np.array([[2]])).tolist() == [[0]]
    with pytest.raises(RuntimeError, match=r"experts \[3\] are not resident"):
        t.slot_indices(np.array([[2, 3]]))


@pytest.mark.parametrize(
    "policy,uses,hint,protected,victim",
    [
        # lru: the least recently touched goes (touch order 0, 1, 2, then 0 again: 1 is oldest)
        ("lru", [0, 1, 2, 0], (), set(), 1),
        ("lru", [0, 1, 2, 0], (), {1}, 2),
        # lfu: the least used since it became resident; ties go to the least recently used
        ("lfu", [0, 1, 2, 0, 0, 2], (), set(), 1),
        ("lfu", [0, 1, 2, 0, 1, 1], (), set(), 2),
        ("lfu", [0, 1, 2], (), set(), 0),  # all once: the least recent
        # lru-predicted: LRU, sparing the experts last predicted for the layer while another can go
        ("lru-predicted", [0, 1, 2, 0], (1,), set(), 2),
        ("lru-predicted", [0, 1, 2, 0], (1, 2), set(), 0),
        ("lru-predicted", [0, 1, 2], (0, 1, 2), set(), 0),  # every expert predicted: plain LRU
    ],
)
def test_each_policy_evicts_its_victim(policy, uses, hint, protected, victim):
    """Equal logits cannot reveal a wrong victim, so each policy's choice is pinned here."""
    t = SlotTable(0, num_experts=8, slots=3, tensors=TENSORS, policy=policy)
    for e in dict.fromkeys(uses):
        t.claim(e)  # first use: becomes resident (counted once)
    seen = set()
    for e in uses:
        if e in seen:
            t.touch([e])
        seen.add(e)
    t.hint(hint)
    slot = t.slot_of[victim]
    assert t.claim(7, protected=protected | {7}) == slot
    assert not t.resident(victim) and t.resident(7)
    check_consistent(t)


@pytest.mark.parametrize("shape", [(1,), (2,), (1, 1), (2, 1), (3,), (1, 1, 2), (1, 1, 8), (4, 2)])
def test_device_indices_are_the_values_in_a_block_above_the_small_pool(shape):
    """What the device reads as indices is uint32 of the given shape and values, and its host
    block is never 8 bytes or fewer, the size MLX's CUDA allocator serves from its small pool
    (on the H200 a gather's uint8 slot indices there once read outside the slot buffer)."""
    values = np.arange(1, int(np.prod(shape)) + 1).reshape(shape)
    a = device_indices(values)
    assert a.dtype == mx.uint32 and a.shape == shape
    assert np.array(a).tolist() == values.tolist()
    block = index_block(values)
    assert block.nbytes > device.SMALL_POOL_BYTES
    assert block[: values.size].tolist() == values.reshape(-1).tolist()


def test_an_address_keeps_its_64_bits():
    a = device_indices([2**40 + 3], np.uint64)
    assert a.dtype == mx.uint64 and np.array(a).tolist() == [2**40 + 3]
    assert index_block([2**40 + 3], np.uint64).nbytes > device.SMALL_POOL_BYTES
