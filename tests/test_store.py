"""The expert store: round trip, tiers, and a clear error for every damaged store."""

import json
import os
import shutil
import threading

import mlx.core as mx
import numpy as np
import pytest

from engine.models import registry
from engine.models.anatomy import moe_layers
from engine.runtime.engine import open_store, store_dir
from engine.runtime.store import Store, StoreError


@pytest.fixture(scope="module")
def tiny():
    model, _, spec, path = registry.load("olmoe-tiny", lazy=True)
    open_store("olmoe-tiny", model, path).close()  # built if absent
    return model, path


@pytest.fixture
def store_copy(tmp_path, tiny):
    dst = tmp_path / "store"
    shutil.copytree(store_dir("olmoe-tiny"), dst)
    return dst


@pytest.mark.parametrize("tier", ["page_cache", "cold"])
def test_round_trip(tiny, tier):
    model, path = tiny
    with Store(store_dir("olmoe-tiny"), model_path=path, tier=tier, verify="always") as s:
        assert s.expert_bytes == sum(t.nbytes for t in s.tensors)
        for layer, (_, glu) in enumerate(moe_layers(model)):
            experts = [0, 17, 63]
            views, seconds = s.read_batch(layer, experts)
            assert len(seconds) == 3
            for e in experts:
                for t, v in zip(s.tensors, views[e]):
                    proj, part = t.name.split(".")
                    want = mx.contiguous(getattr(glu, proj)[part][e])
                    assert v.tobytes() == bytes(memoryview(want).cast("B"))


def test_layout_is_nine_tensors_per_expert(tiny):
    with Store(store_dir("olmoe-tiny")) as s:
        assert [t.name for t in s.tensors] == [
            f"{p}.{q}" for p in ("gate_proj", "up_proj", "down_proj") for q in ("weight", "scales", "biases")
        ]
        assert s.record_bytes % 4096 == 0


def test_corrupt_expert_is_named(store_copy):
    f = store_copy / "layer_001.bin"
    with Store(store_copy) as s:
        off = 5 * s.record_bytes + 100
    data = bytearray(f.read_bytes())
    data[off] ^= 0xFF
    f.write_bytes(bytes(data))
    with Store(store_copy) as s:
        s.read_batch(1, [4])  # a neighbour is intact
        with pytest.raises(StoreError, match=r"layer_001\.bin: checksum mismatch for expert 5 of MoE layer 1"):
            s.read_batch(1, [5])
        with pytest.raises(StoreError, match="expert 5"):
            s.verify_all()


def test_truncated_file_is_named(store_copy):
    f = store_copy / "layer_002.bin"
    with Store(store_copy) as s:
        keep = 10 * s.record_bytes + 7
    with open(f, "r+b") as fh:
        fh.truncate(keep)
    with pytest.raises(StoreError, match=r"layer_002\.bin: truncated .* experts 10\.\.63 of MoE layer 2 are missing"):
        Store(store_copy)


def test_a_file_longer_than_its_index_says_is_damaged(store_copy):
    """Bytes appended to a layer file (its experts' records all intact) are bytes its index does not
    account for: the store refuses to open, naming the file, rather than `store verify` passing."""
    f = store_copy / "layer_001.bin"
    with open(f, "ab") as fh:
        fh.write(b"\0" * 100)
    with pytest.raises(
        StoreError, match=r"layer_001\.bin: damaged: \d+ bytes, 100 past the \d+ its index gives MoE layer 1"
    ):
        Store(store_copy)


def test_missing_file_is_named(store_copy):
    (store_copy / "layer_003.bin").unlink()
    with pytest.raises(StoreError, match=r"layer_003\.bin: missing store file of MoE layer 3"):
        Store(store_copy)


def test_malformed_index_is_named(store_copy):
    idx = store_copy / "index.json"
    idx.write_text(idx.read_text()[:-40])
    with pytest.raises(StoreError, match=r"index\.json: malformed store index"):
        Store(store_copy)
    data = {"format": "titan-expert-store", "version": 1}
    idx.write_text(json.dumps(data))
    with pytest.raises(StoreError, match=r"malformed store index \('tensors'\)"):
        Store(store_copy)


def test_store_of_another_model_is_refused(store_copy):
    other = registry.model_dir("qwen3moe-tiny")
    with pytest.raises(StoreError, match="built from another model"):
        Store(store_copy, model_path=other)


def test_missing_store_says_how_to_build(tmp_path):
    with pytest.raises(StoreError, match="python -m engine store build"):
        Store(tmp_path / "nowhere")


def test_read_into_slot_memory(tiny):
    """One preadv scatters an expert straight into nine destination buffers."""
    with Store(store_dir("olmoe-tiny")) as s:
        dests = [np.empty(t.nbytes, np.uint8) for t in s.tensors]
        s.read_into(0, 9, dests)
        views, _ = s.read_batch(0, [9])
        assert b"".join(d.tobytes() for d in dests) == b"".join(v.tobytes() for v in views[9])


def test_store_build_rewrites_only_a_store_of_another_model(tmp_path, monkeypatch, tiny):
    """The workflow's `store` job runs when the store is missing or older than its model; a store
    that another job built from this very model meanwhile is kept (it may be being read), one
    built from another model (a retrained one) is written again."""
    from engine import cli
    from engine.config import resources_dir
    from engine.runtime.store import built_from

    _, path = tiny
    (tmp_path / "models").symlink_to(resources_dir() / "models")
    shutil.copytree(store_dir("olmoe-tiny"), tmp_path / "stores" / "olmoe-tiny")
    monkeypatch.setenv("TITAN_RESOURCES", str(tmp_path))
    built = tmp_path / "stores" / "olmoe-tiny"
    layer = built / "layer_000.bin"
    assert built_from(built, path) and not built_from(built, registry.model_dir("qwen3moe-tiny"))
    before = layer.stat().st_ino
    os.utime(built / "index.json", (0, 0))  # older than its model, as the DAG would find it
    cli.main(["store", "build", "olmoe-tiny"])
    assert layer.stat().st_ino == before  # kept
    assert (built / "index.json").stat().st_mtime > (path / "titan-build.json").stat().st_mtime  # and fresh
    idx = json.loads((built / "index.json").read_text())
    (built / "index.json").write_text(json.dumps({**idx, "model_digest": "0" * 64}))
    assert not built_from(built, path)
    cli.main(["store", "build", "olmoe-tiny"])
    assert built_from(built, path) and layer.stat().st_ino != before
    assert not built_from(tmp_path / "nowhere", path)


def test_many_reads_are_handed_to_at_most_readers_threads_and_each_has_its_future(tiny, monkeypatch):
    """A prefetch's reads go to the reader threads in at most `readers` hand-offs (each wakes a
    thread); each read still has its own future, lands its own bytes and fails on its own."""
    with Store(store_dir("olmoe-tiny"), readers=3) as s:
        handoffs = []
        real = s._prefetch_pool.submit
        monkeypatch.setattr(s._prefetch_pool, "submit", lambda *a: handoffs.append(a) or real(*a))
        experts = [5, 9, 1, 33, 60, 2, 17, 40]
        records = [s.empty_record() for _ in experts]
        futures = s.submit_many(2, [(e, [r]) for e, r in zip(experts, records)], prefetch=True)
        assert len(futures) == len(experts) and all(f.result() >= 0 for f in futures)
        assert len(handoffs) == 3
        want, _ = s.read_block(2, experts)
        assert all(r.tobytes() == w[: s.expert_bytes].tobytes() for r, w in zip(records, want))

        bad = s.submit_many(2, [(7, [s.empty_record()]), (999, [s.empty_record()]), (8, [s.empty_record()])])
        assert bad[1].exception() is not None and "out of range" in str(bad[1].exception())
        assert bad[0].exception() is None and bad[2].exception() is None


def test_a_read_cancelled_before_it_starts_is_never_made(tiny):
    with Store(store_dir("olmoe-tiny"), readers=1) as s:
        gate = threading.Event()
        s._prefetch_pool.submit(gate.wait)  # the one reader thread is busy
        rec = s.empty_record()
        rec[:] = 0xAB
        (fut,) = s.submit_many(1, [(3, [rec])], prefetch=True)
        assert fut.cancel()
        gate.set()
        s._prefetch_pool.submit(lambda: None).result()  # the hand-off has run
        assert fut.cancelled() and (rec == 0xAB).all()


@pytest.mark.timeout(30)
def test_closing_the_store_leaves_no_read_pending(tiny):
    s = Store(store_dir("olmoe-tiny"), readers=1)
    gate = threading.Event()
    s._prefetch_pool.submit(gate.wait)
    futures = s.submit_many(0, [(e, [s.empty_record()]) for e in range(4)], prefetch=True)
    threading.Timer(0.2, gate.set).start()
    s.close()  # the queued hand-off is cancelled, and with it its reads
    assert all(f.done() for f in futures)
