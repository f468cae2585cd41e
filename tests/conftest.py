import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"
MODELS = {"olmoe-tiny": dict(experts=64, top_k=8), "qwen3moe-tiny": dict(experts=128, top_k=8)}


@pytest.fixture(scope="session")
def reference():
    """Per model: the unmodified mlx-lm model's greedy tokens and logits over PROMPT."""
    from engine.runtime import decode, load_reference

    cache = {}

    def get(model_id, steps=32):
        key = (model_id, steps)
        if key not in cache:
            model, tok, spec = load_reference(model_id)
            ids = tok.encode(PROMPT)
            tokens, _, logits = decode(model, ids, steps, keep_logits=True)
            cache[key] = dict(ids=ids, tokens=tokens, logits=logits, spec=spec)
        return cache[key]

    return get
