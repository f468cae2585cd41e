"""The engine's logits equal mlx-lm's bit for bit, over the prefill and 32 decode steps, at
every slot count, on both embedded architectures (float16 OLMoE, bfloat16 Qwen3-MoE)."""

import pytest
from conftest import MODELS, run_engine

from engine import max_abs_diff
from engine.runtime.moe import ExpertCache

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


def test_prefill_larger_than_table_is_chunked(reference):
    """A prompt whose rows route to more experts than S runs in row groups, still exactly."""
    ref = reference("qwen3moe-tiny")
    records, logits, _ = run_engine("qwen3moe-tiny", ref, slots=8)
    assert records[0]["phase"] == "prefill" and records[0]["chunks"] > 0
    assert max_abs_diff(ref["logits"], logits) == 0.0


def test_full_table_never_synchronises(reference, monkeypatch):
    """At S = E the layer goes straight to the kernels: Algorithm 1's host path never runs."""

    def boom(*a, **k):
        raise AssertionError("host path taken at S = E")

    monkeypatch.setattr(ExpertCache, "ensure", boom)
    ref = reference("olmoe-tiny")
    _, logits, counters = run_engine("olmoe-tiny", ref)
    assert counters["misses"] == 0
    assert max_abs_diff(ref["logits"], logits) == 0.0
