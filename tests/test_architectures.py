"""Every MoE architecture of mlx-lm 0.32.2, offloaded: one tiny embedded model per architecture
(engine/data/architectures.yaml), its logits bit-identical to mlx-lm's at S = E, E/2 and top-k,
and mlx-lm's own stream_generate giving mlx-lm's greedy tokens through the engine. An
architecture that cannot be checked is declared `exact: false` with its reason and fails here as
expected (strictly: should it start to pass, this says so)."""

from pathlib import Path

import mlx.nn as nn
import mlx_lm
import pytest
from conftest import PROMPT, ROOT

from engine import EngineConfig, load, max_abs_diff
from engine.cli import architectures_table
from engine.models import registry
from engine.models.anatomy import expert_params, moe_blocks, top_k_of
from engine.models.registry import load_reference
from engine.runtime.loop import decode

# Quantized layers outside the experts (the experts' own take mlx-lm's gather_qmm, which is sound)
QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)
ARCHS = {m: s for m, s in registry.load_registry().items() if s["source"] == str(registry.ARCHITECTURES)}
STEPS = 6


def _param(mid, spec):
    if spec.get("exact", True):
        return mid
    return pytest.param(mid, marks=pytest.mark.xfail(strict=True, reason=spec["reason"]))


def test_every_moe_architecture_of_mlx_lm_has_a_tiny_model():
    """43 model files of mlx-lm 0.32.2 hold their experts in a SwitchGLU or SwitchMLP; each has one."""
    models = Path(mlx_lm.__file__).parent / "models"
    moe = {
        p.stem
        for p in models.glob("*.py")
        if p.stem != "switch_layers" and ("SwitchGLU" in p.read_text() or "SwitchMLP" in p.read_text())
    }
    assert len(moe) == 43
    assert {s["architecture"] for s in ARCHS.values()} == moe
    assert len([m for m, s in ARCHS.items() if s.get("exact", True)]) >= 35


@pytest.mark.parametrize("model_id", [_param(m, s) for m, s in ARCHS.items()])
def test_architecture_offloaded_bit_exact(model_id):
    model, tok, _ = load_reference(model_id)
    narrow = [
        n for n, m in model.named_modules() if isinstance(m, QUANTIZED) and m.scales.shape[-1] * m.group_size == 64
    ]
    assert not narrow, f"quantized layers of 64 inputs, which MLX's CUDA backend computes wrongly: {narrow}"
    ids = tok.encode(PROMPT)
    tokens, _, ref = decode(model, ids, STEPS, keep_logits=True)
    _, _, again = decode(model, ids, STEPS, forced=tokens, keep_logits=True)
    assert max_abs_diff(ref, again) == 0.0, "mlx-lm itself gives other logits when run again here"
    block = moe_blocks(model)[0]
    E, K = expert_params(block.switch)[0][1].shape[0], top_k_of(model, block)
    assert K is not None and K < E, (E, K)
    for S in sorted({E, max(E // 2, K), K}, reverse=True):
        eng = load(model_id, EngineConfig(slots=S))
        try:
            _, _, got = decode(eng.model, ids, STEPS, forced=tokens, keep_logits=True)
            misses = eng.counters()["misses"]
        finally:
            eng.close()
        assert max_abs_diff(ref, got) == 0.0, f"S={S}"
        assert S == E or misses > 0, f"S={S}: the miss path never ran"
    want = [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=STEPS)]
    eng = load(model_id, EngineConfig(slots=K))
    try:
        got = [r.token for r in mlx_lm.stream_generate(eng.model, eng.tokenizer, PROMPT, max_tokens=STEPS)]
    finally:
        eng.close()
    assert got == want


LONG = [("tiny-exaone-moe", "E", "copy"), ("tiny-exaone-moe", "K", "auto"), ("tiny-deepseek", "K", "auto"),
        ("tiny-bailing-moe-linear", "E", "auto"), ("tiny-qwen3-moe", "K", "copy")]  # fmt: skip


@pytest.mark.parametrize("model_id,which,install", LONG)
def test_a_long_prompt_gives_mlx_lms_greedy_tokens(model_id, which, install):
    """A 300-token prompt (a prefill of many rows, on a table of every expert or of top-k slots)
    through mlx-lm's own stream_generate: the engine's greedy tokens are plain mlx-lm's. (On the
    H200 at c505412 these differed for tiny-exaone-moe at S = E, copy install, and tiny-deepseek
    at S = top-k; issue 28.)"""
    if model_id not in ARCHS:
        pytest.skip(f"{model_id} is not registered")
    model, tok, _ = load_reference(model_id)
    text = " ".join(["def f(x): return x * 2 if x > 0 else -x"] * 40)
    ids = tok.encode(text)[:300]
    assert len(ids) == 300
    want = [r.token for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=8)]
    block = moe_blocks(model)[0]
    E, K = expert_params(block.switch)[0][1].shape[0], top_k_of(model, block)
    eng = load(model_id, EngineConfig(slots=E if which == "E" else K, install=install))
    try:
        got = [r.token for r in mlx_lm.stream_generate(eng.model, eng.tokenizer, ids, max_tokens=8)]
    finally:
        eng.close()
    assert got == want


def test_the_coverage_table_is_generated():
    """docs/architectures.md is `python -m engine architectures`, as the registry and the built
    models say it (every `yes` in it is a test above)."""
    doc = (ROOT / "docs" / "architectures.md").read_text()
    assert architectures_table() in doc
