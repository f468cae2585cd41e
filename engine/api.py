"""The public face: load a model as an engine, decode with it."""

import dataclasses
import sys

from . import device, memory
from .config import EngineConfig
from .models import registry
from .predict import fitting
from .runtime import prefetch, store
from .runtime.engine import Engine
from .runtime.store import top_k_of


def load(model_id: str, config: EngineConfig | None = None, prefetcher=None, **options) -> Engine:
    """An `Engine` for a registered model: `config` (or `EngineConfig` fields as keywords) says
    how many slots, which install and prefetch. A fitted predictor is fitted on first use (its
    traces and fit are cached under the resources folder) and reused afterwards."""
    if config is None:
        config = EngineConfig(**options)
    elif options:
        raise TypeError("give either config or EngineConfig fields as keywords, not both")
    model, tokenizer, spec, path = registry.load(model_id, lazy=True)
    plan = None
    if config.memory is not None:
        if config.slots is not None:
            raise ValueError("give either slots or a memory budget, not both")
        top_k = top_k_of(model, store.moe_blocks(model)[0]) or 1
        plan = memory.plan(model, config.memory, top_k, config.context, device.resolve_install(config.install),
                           config.readers, config.staging_records)  # fmt: skip
        print(f"[titan] {plan.describe()}", file=sys.stderr, flush=True)
        config = dataclasses.replace(config, slots=plan.slots)
    if prefetcher is None and config.predictor != "none":
        top_k = top_k_of(model, store.moe_blocks(model)[0]) or 8
        pred = fitting.get_predictor(
            model_id,
            config.predictor,
            config.depth,
            config.predict_size or top_k,
            config.fit_set,
            config.trace_tokens,
            config.min_prob,
        )
        prefetcher = prefetch.make(config.predictor, config.depth, pred)
    eng = Engine(model, tokenizer, spec, path, config, prefetcher)
    eng.plan = plan
    return eng
