"""The trained embedded model: deterministic data and tokenizer, a model that loads through
the registry, and an engine that stays bit-exact on it at S = E/4 (a 3-step training run
through the same code path stands in for the 20-minute one)."""

import mlx.core as mx
import numpy as np
import pytest
import yaml

from engine import EngineConfig, load, max_abs_diff
from engine.models import registry, train
from engine.models.registry import load_reference
from engine.predict import prompts
from engine.runtime.loop import decode


@pytest.fixture(scope="module")
def short_training(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    cfg = yaml.safe_load(registry.config_path().read_text())
    for mid in ("olmoe-trained", "olmoe-trained-f32"):
        cfg["models"][mid]["training"] = dict(cfg["models"][mid]["training"], steps=3, code_bytes=200_000)
    models = tmp / "models.yaml"
    models.write_text(yaml.safe_dump(cfg))
    mp = pytest.MonkeyPatch()
    mp.setenv("TITAN_MODELS", str(models))
    mp.setenv("TITAN_RESOURCES", str(tmp / "resources"))
    out = train.train("olmoe-trained")
    yield out
    mp.undo()


def test_data_and_tokenizer_are_deterministic(tmp_path):
    spec = registry.get_spec("olmoe-trained")
    spec["training"] = dict(spec["training"], code_bytes=200_000)
    a_streams, a = train.data(spec, tmp_path / "a")
    b_streams, b = train.data(spec, tmp_path / "b")
    assert a == b
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert all((a_streams[k] == b_streams[k]).all() for k in a_streams)
    other, c = train.data(dict(spec, training=dict(spec["training"], seed=1)), tmp_path / "c")
    assert c != a  # another seed draws other source files


def test_eval_prompts_are_held_out_of_training():
    general, code = train.corpus(0, 200_000)
    for p in prompts.load("code", "eval"):
        assert p["text"] not in code


def engine_misses_and_diff(model, tok, model_id, prompt, steps, slots):
    """(misses, max |dlogit|) of the engine at `slots` against mlx-lm's own decode of `prompt`."""
    ids = tok.encode(prompt)
    tokens, _, ref = decode(model, ids, steps, keep_logits=True)
    eng = load(model_id, EngineConfig(slots=slots))
    try:
        _, recs, got = decode(eng.model, ids, steps, forced=tokens, keep_logits=True)
    finally:
        eng.close()
    return sum(r["misses"] for r in recs), max_abs_diff(ref, got)


def test_trained_model_loads_and_stays_bit_exact(short_training):
    assert len(short_training["curve"]) == 3
    assert all(np.isfinite(c["loss"]) for c in short_training["curve"])
    for mid, dtype in (("olmoe-trained", "float16"), ("olmoe-trained-f32", "float32")):
        model, tok, spec = load_reference(mid)
        assert str(model.model.norm.weight.dtype).endswith(dtype)
        misses, diff = engine_misses_and_diff(model, tok, mid, "def main():\n    return 0", 8, spec["experts"] // 4)
        assert misses > 0
        assert diff == 0.0


def test_untrained_model_says_how_to_train(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_RESOURCES", str(tmp_path))
    with pytest.raises(registry.RegistryError, match="python -m engine train olmoe-trained"):
        registry.model_dir("olmoe-trained-f32")


def test_warm_up_then_cosine_decay():
    s = train.schedule(dict(lr=1e-3, steps=10, warmup=4))
    lrs = [float(s(mx.array(i))) for i in range(11)]
    assert lrs[:5] == sorted(lrs[:5]) and lrs[0] == pytest.approx(2.5e-4) and lrs[4] == pytest.approx(1e-3)
    assert lrs[4:] == sorted(lrs[4:], reverse=True) and lrs[10] == pytest.approx(1e-4)
    assert float(train.schedule(dict(lr=1e-3, steps=10))(mx.array(0))) == pytest.approx(1e-3)


def test_any_model_with_a_training_block_trains_and_stays_bit_exact(tmp_path, monkeypatch):
    """The wide model's recipe at the small model's widths: one variant (no -f32 in the registry),
    warm-up, the same loader and the same exactness."""
    cfg = yaml.safe_load(registry.config_path().read_text())
    wide = cfg["models"]["olmoe-wide-trained"]
    wide.update(hidden=128, expert_width=64, heads=4, layers=2, vocab=1024)
    wide["training"] = dict(wide["training"], steps=3, warmup=2, batch=4, seq=32, code_bytes=200_000)
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("TITAN_MODELS", str(tmp_path / "models.yaml"))
    monkeypatch.setenv("TITAN_RESOURCES", str(tmp_path / "resources"))
    assert train.variants("olmoe-wide-trained") == ["olmoe-wide-trained"]
    out = train.train("olmoe-wide-trained")
    assert list(out["outputs"]) == ["olmoe-wide-trained"] and len(out["curve"]) == 3
    model, tok, _ = load_reference("olmoe-wide-trained")
    misses, diff = engine_misses_and_diff(model, tok, "olmoe-wide-trained", "import os\n", 6, 16)
    assert misses > 0
    assert diff == 0.0
