"""Titan: decode Mixture-of-Experts models whose experts do not all fit in fast memory.

    import engine
    eng = engine.load("olmoe-tiny", slots=16, predictor="previous")
    tokens, steps, _ = engine.decode(eng.model, eng.tokenizer.encode("def main():"), 32)
    print(engine.summarize(steps))
    eng.close()

An engine's `model` is an mlx-lm model: mlx-lm's own `stream_generate` runs on it too.
`engine.plan("qwen3-30b-a3b-shape", [16e9], card=True)` says whether a model decodes within a
memory budget, and with how many experts a layer, without loading or building it.
"""

import os

# Titan never downloads: models are pinned and cached, or built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from .api import load, plan  # noqa: E402
from .config import EngineConfig, resources_dir  # noqa: E402
from .runtime.engine import Engine  # noqa: E402
from .runtime.loop import decode, max_abs_diff, summarize, time_split  # noqa: E402
from .versions import __version__  # noqa: E402

__all__ = [
    "Engine",
    "EngineConfig",
    "load",
    "plan",
    "decode",
    "summarize",
    "time_split",
    "max_abs_diff",
    "resources_dir",
    "__version__",
]
