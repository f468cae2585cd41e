"""The engine's logits equal mlx-lm's bit for bit, over the prefill and 32 decode steps, at
every slot count, on both embedded architectures (float16 OLMoE, bfloat16 Qwen3-MoE)."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import HOST_INSTALL, MODELS, run_engine

from engine import EngineConfig, decode, device, load, max_abs_diff
from engine.models import registry
from engine.runtime import moe
from engine.runtime.hostcache import ExpertCache
from engine.tracing import trace
from harness import families

CASES = [(m, s) for m, d in MODELS.items() for s in (d["experts"], d["experts"] // 2, d["experts"] // 4, d["top_k"])]


@pytest.mark.parametrize("model_id,slots", CASES)
def test_logits_bit_identical(reference, model_id, slots):
    ref = reference(model_id)
    records, logits, counters = run_engine(model_id, ref, slots=slots)
    assert len(logits) == 33  # the prefill and 32 decode steps
    assert max_abs_diff(ref["logits"], logits) == 0.0
    if slots < MODELS[model_id]["experts"]:
        assert counters["misses"] > 0 and counters["evictions"] > 0  # the miss path really ran


@pytest.mark.parametrize("model_id", list(MODELS))
def test_copy_install_bit_identical(reference, model_id):
    ref = reference(model_id)
    _, logits, counters = run_engine(model_id, ref, slots=MODELS[model_id]["experts"] // 4, install="copy")
    assert counters["misses"] > 0
    assert max_abs_diff(ref["logits"], logits) == 0.0


def test_cold_tier_bit_identical(reference):
    ref = reference("qwen3moe-tiny")
    _, logits, _ = run_engine("qwen3moe-tiny", ref, slots=16, tier="cold", readers=2)
    assert max_abs_diff(ref["logits"], logits) == 0.0


@pytest.mark.parametrize("install", [HOST_INSTALL, "device"])
def test_a_prompt_larger_than_the_table_is_computed_over_the_area_exactly(reference, install):
    """A prompt whose rows route to more experts than S is computed over the many-rows area, on
    Algorithm 1's path and the device install's, and the logits of the prompt and of the decode
    after it stay mlx-lm's."""
    ref = reference("qwen3moe-tiny")
    records, logits, _ = run_engine("qwen3moe-tiny", ref, slots=8, install=install)
    assert records[0]["phase"] == "prefill" and records[0]["many_rows"] > 0
    assert all(r["many_rows"] == 0 for r in records[1:])  # one row a step fits the table
    assert max_abs_diff(ref["logits"], logits) == 0.0


@pytest.mark.parametrize("slots", [8, 16])
def test_a_prompt_reads_each_expert_once_and_leaves_its_most_named_experts_resident(reference, slots):
    """A prompt whose rows route to more experts than S reads each of a layer's experts once, into
    the area, and leaves in the table the S experts most of its rows named
    (`moe.kept_after_many_rows`): the first decode step starts warm. The logits stay mlx-lm's."""
    ref = reference("qwen3moe-tiny")
    model, _, _ = registry.load_reference("qwen3moe-tiny")
    routed = trace.record(model, ref["ids"], 0)["experts"]  # (prompt rows, layers, K)
    eng = load("qwen3moe-tiny", EngineConfig(slots=slots, install=HOST_INSTALL))  # reads the slot tables' state
    try:
        _, records, logits = decode(eng.model, ref["ids"], 0, keep_logits=True)
        for layer, table in enumerate(eng.cache.tables):
            used, named = np.unique(routed[:, layer], return_counts=True)
            assert len(used) > slots  # the prompt does not fit: the area ran
            kept = {int(e) for e in np.flatnonzero(table.slot_of >= 0)}
            assert len(kept) == slots and kept <= set(used.tolist())
            times = dict(zip(used.tolist(), named.tolist()))
            assert min(times[e] for e in kept) >= max(times[e] for e in set(times) - kept)
            # an empty table: each expert read once into the area, the kept ones once more into slots
            assert table.misses == len(used) + len(kept)
    finally:
        eng.close()
    assert records[0]["many_rows"] == len(eng.cache.tables)
    assert max_abs_diff(ref["logits"][:1], logits) == 0.0


@pytest.mark.parametrize("install", [HOST_INSTALL, "device"])
def test_a_many_rows_call_is_mlx_lms_own_call(reference, monkeypatch, install):
    """Each layer of a prompt on a small table is one call of mlx-lm's SwitchGLU, in mlx-lm's own
    shapes (the MoE block's input and the router's own indices, unmapped), over weights of every
    expert of the layer at its own index: what mlx-lm calls, on any backend."""
    ref = reference("qwen3moe-tiny")
    rows, K = len(ref["ids"]), 8
    calls = []
    eng = load("qwen3moe-tiny", EngineConfig(slots=8, install=install))
    try:
        glu = type(moe.engine_layers(eng.model)[0].glu)
        real = glu.__call__

        def spy(self, x, i):
            calls.append((x.shape, i.shape, self.gate_proj.weight.shape))
            return real(self, x, i)

        monkeypatch.setattr(glu, "__call__", spy)
        decode(eng.model, ref["ids"], 0)
    finally:
        eng.close()
    assert len(calls) == len(eng.cache.tables)  # one call a layer
    E = MODELS["qwen3moe-tiny"]["experts"]
    assert all(xs[:2] == (1, rows) and ix == (1, rows, K) and w[0] == E for xs, ix, w in calls)


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_an_areas_unnamed_experts_are_never_read(dtype, sort):
    """The area holds only the experts the rows name; the others are whatever the memory held.
    `gather_qmm` reads only the experts its indices name: over a stack whose other experts are
    NaN it gives the very bytes it gives over the real stack."""
    dt = getattr(mx, dtype)
    mx.random.seed(3)
    w = mx.random.normal((16, 256, 128)).astype(dt) * 0.05
    wq, scales, biases = mx.quantize(w, 64, 4)
    x = mx.random.normal((64, 1, 128)).astype(dt)
    idx = np.random.default_rng(3).integers(0, 16, 64).astype(np.uint32)
    idx[idx == 5] = 6  # expert 5 is never named
    if sort:  # as mlx-lm's SwitchGLU hands many rows to the kernel
        idx = np.sort(idx)
    named = mx.array(np.isin(np.arange(16), idx))[:, None, None]
    poisoned = [mx.where(named, a, mx.full(a.shape, float("nan"), a.dtype) if a.dtype != mx.uint32 else 7)
                for a in (wq, scales, biases)]  # fmt: skip

    def call(q, s, b):
        y = mx.gather_qmm(x, q, s, b, rhs_indices=mx.array(idx), transpose=True, group_size=64, bits=4,
                          sorted_indices=sort)  # fmt: skip
        return np.array(y.astype(mx.float32))

    assert np.array_equal(call(wq, scales, biases), call(*poisoned))


def test_full_table_never_synchronises(reference, monkeypatch):
    """At S = E the layer goes straight to the kernels: Algorithm 1's host path never runs."""

    def boom(*a, **k):
        raise AssertionError("host path taken at S = E")

    monkeypatch.setattr(ExpertCache, "ensure", boom)
    ref = reference("olmoe-tiny")
    _, logits, counters = run_engine("olmoe-tiny", ref)
    assert counters["misses"] == 0
    assert max_abs_diff(ref["logits"], logits) == 0.0


FAMILIES = families.default_models()  # the set `harness bench families --exactness` runs these for


@pytest.mark.parametrize("model_id", FAMILIES)
def test_each_family_at_full_size_gives_mlx_lms_logits_at_a_quarter_of_its_experts(reference, model_id):
    """The families users run, at their real sizes (`harness bench families` builds them; 4 to 26
    GB, so a run that has not built one skips it, naming the command): the prefill and 4 decode
    steps at 25 % of each layer's experts through the default install, bit for bit mlx-lm's."""
    if device.kind() != "gpu":  # olmoe-1b-7b-shape's ran past 15 minutes on the 2-core CPU
        pytest.skip("a family at full size runs in the GPU suite: MLX's float16/bfloat16 quantized kernels "
                    "take minutes a token on a CPU")  # fmt: skip
    try:
        registry.model_dir(model_id, build=False)
    except registry.RegistryError as e:
        pytest.skip(str(e))
    shape = registry.shape(model_id)
    ref = reference(model_id, steps=4)
    slots = max(shape["top_k"], shape["experts"] // 4)
    _, logits, counters = run_engine(model_id, ref, slots=slots)
    assert counters["misses"] > 0
    assert max_abs_diff(ref["logits"], logits) == 0.0, where_logits_part(ref["logits"], logits)


def where_logits_part(want, got) -> str:
    """For a failure's message (the record of `bench families --exactness` keeps it): the first
    step whose logits differ (0: the prompt's prefill, the many-rows path; later: decode steps
    through the slots), each step's max |Δlogit|, and whether the reference's own were finite."""
    steps = [max_abs_diff([a], [b]) for a, b in zip(want, got)]
    first = next(i for i, d in enumerate(steps) if d != 0)
    finite = all(np.isfinite(np.asarray(a)).all() for a in want)
    return (
        f"logits part from mlx-lm's at step {first} ({'the prefill' if first == 0 else 'a decode step'}); "
        f"max |Δ| a step {[round(d, 4) for d in steps]}; mlx-lm's own logits {'finite' if finite else 'NOT finite'}"
    )


def test_a_failed_exactness_check_says_where_the_logits_part():
    want = [np.zeros((1, 4), np.float32), np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)]
    got = [want[0], want[1] + 0.5, want[2]]
    said = where_logits_part(want, got)
    assert "at step 1 (a decode step)" in said and "[0.0, 0.5, 0.0]" in said and "finite" in said
    said = where_logits_part([np.full((1, 2), np.nan, np.float32)], [np.zeros((1, 2), np.float32)])
    assert "at step 0 (the prefill)" in said and "NOT finite" in said


@pytest.mark.parametrize("install", [HOST_INSTALL, "device"])
def test_several_sequences_at_once_are_mlx_lms_batch_bit_for_bit(install):
    """mlx-lm's batch_generate (what its server's batching runs) over an engine model at S = 16 of
    128: four prompts of different lengths, left-padded into one batch, each decode step's rows
    through a layer at once (more experts than slots: the many-rows area). Every sequence's tokens
    and the log-probability of each, which come from its logits, are mlx-lm's bit for bit."""
    from mlx_lm.generate import batch_generate

    model, tok, _ = registry.load_reference("qwen3moe-tiny")
    prompts = [tok.encode(t) for t in ("def add(a, b):", "import os\n", "class Stack:\n    def push(self", "x")]

    def run(m):
        out = batch_generate(m, tok, prompts, max_tokens=12, return_token_ids=True, return_logprobs=True)
        return out.token_ids, out.logprobs

    want = run(model)
    eng = load("qwen3moe-tiny", EngineConfig(slots=16, install=install))
    try:
        got = run(eng.model)
        many = eng.cache.stats.many_rows  # nothing resets it outside the engine's own loop
    finally:
        eng.close()
    assert got[0] == want[0]
    assert got[1] == want[1]  # floats compared exactly
    assert many > 0  # the batch's rows did not fit the table


def test_what_the_slots_keep_after_many_rows_is_the_share_of_rows_naming_each_expert_decayed_over_calls():
    """`moe.kept_after_many_rows`: the S experts on the device (held, or named by the call) named by
    the largest share of the calls' rows, each earlier call weighed `decay` times less; never one
    the device does not hold; -1 past the experts with a score; alike over numpy's arrays and MLX's."""
    from engine.runtime.moe import kept_after_many_rows

    none = mx.zeros((8,), mx.bool_)
    rows = mx.array([[0, 1], [0, 2], [0, 3], [4, 1]])  # four rows, top 2: 0 named by 3, 1 by 2
    score, keep = kept_after_many_rows(rows, 2, none, None)
    assert keep.tolist() == [0, 1] and score.tolist()[:5] == [0.75, 0.5, 0.25, 0.25, 0.25]
    _, keep = kept_after_many_rows(rows, 6, none, None)
    assert sorted(keep.tolist()) == [-1, 0, 1, 2, 3, 4]  # five named: the sixth slot keeps no one
    # expert 5 named by one row of four at every call outlasts expert 6, named by all four once, two calls ago
    score, every = None, mx.ones((8,), mx.bool_)
    for call in ([[6, 7]] * 4, [[5, 1], [2, 3], [2, 3], [2, 3]], [[5, 4], [2, 3], [2, 3], [2, 3]]):
        score, keep = kept_after_many_rows(mx.array(call), 3, every, score, decay=0.3)
    assert set(keep.tolist()) == {2, 3, 5}
    # 4, 5 and 6 still have a score, but were neither held nor named: their bytes are not on the device
    _, keep = kept_after_many_rows(mx.array([[2, 3]] * 4), 4, mx.array([e in (2, 3) for e in range(8)]), score)
    assert sorted(keep.tolist()) == [-1, -1, 2, 3]
    # a host install asks with numpy arrays, the device install with MLX's: the same experts kept
    rng, scores = np.random.default_rng(0), [None, None]
    for _ in range(50):
        rows, held = rng.integers(0, 64, (4, 8)), rng.random(64) > 0.7
        scores[0], kept_np = kept_after_many_rows(rows, 16, held, scores[0])
        scores[1], kept_mx = kept_after_many_rows(mx.array(rows), 16, mx.array(held), scores[1])
        assert kept_np.tolist() == kept_mx.tolist()


def test_after_a_batched_step_every_install_keeps_the_same_experts():
    """One rule, asked by every install: after batch_generate's steps the host install's tables and
    the device install's slot maps hold the same experts in every layer."""
    from mlx_lm.generate import batch_generate

    _, tok, _ = registry.load_reference("qwen3moe-tiny")
    prompts = [tok.encode(t) for t in ("def add(a, b):", "import os\n", "class Stack:\n    def push(self", "x")]
    held = {}
    for install in (HOST_INSTALL, "device"):
        eng = load("qwen3moe-tiny", EngineConfig(slots=16, install=install))
        try:
            batch_generate(eng.model, tok, prompts, max_tokens=6)
            c = eng.cache
            held[install] = [
                set(np.flatnonzero(c.tables[i].slot_of >= 0).tolist()) if install == HOST_INSTALL
                else set(c.resident(i).tolist()) - {-1} for i in range(len(c.slots))
            ]  # fmt: skip
        finally:
            eng.close()
    assert held[HOST_INSTALL] == held["device"] and all(len(h) == 16 for h in held["device"])
