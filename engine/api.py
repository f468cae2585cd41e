"""The public face: load a model as an engine, decode with it."""

import dataclasses
import sys

from . import memory
from .config import EngineConfig
from .models import registry
from .models.anatomy import moe_blocks, top_k_of
from .runtime import installs, prefetch
from .runtime.engine import Engine
from .tracing import fitting


class OptionError(ValueError):
    """An option the model cannot take: the message names the option and what it may be."""


SEED_MAX = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit seed


def check_prediction(shape: dict, depth: int, size: int | None, what="--predict-size", depth_option="--depth"):
    """A prefetch depth and predicted-set size against a model's shape (registry.shape): d within
    1..L (layer l prefetches layer l + d of the same token, wrapping onto the next token's layers;
    d = L fills the very layer of the next token), the size within 1..E."""
    L, E = shape.get("layers"), shape.get("experts")
    if not 1 <= depth or (L is not None and depth > L):
        raise OptionError(f"{depth_option} {depth}: must lie within 1..{L or 'layers'} (the model's layers)")
    if size is not None and (size < 1 or (E is not None and size > E)):
        raise OptionError(f"{what} {size}: must lie within 1..{E or 'experts'} (the model's experts)")


def check_context(model_id: str, prompt: int, tokens: int, option: str):
    """`tokens` generated after a prompt of `prompt` tokens stay within the model's context."""
    context = registry.context_of(model_id)
    if prompt + tokens > context:
        raise OptionError(f"{option} {tokens}: with the prompt's {prompt} tokens, past the model's context of "
                          f"{context} tokens (at most {max(context - prompt, 0)})")  # fmt: skip


def check(model_id: str, config: EngineConfig) -> None:
    """Refuse an option the model cannot take before anything is built, traced, fitted or loaded,
    naming the option and its allowed range. (The engine checks again against the loaded model,
    whose MoE layers may be fewer than its layers.)"""
    shape = registry.shape(model_id)
    E, K = shape.get("experts"), shape.get("top_k")
    if config.slots is not None:
        if K is not None and config.slots < K:
            raise OptionError(f"--slots {config.slots}: below the model's top_k ({K}); every expert a token "
                              f"routes to must be resident at once: give {K}..{E}")  # fmt: skip
        if E is not None and config.slots > E:
            raise OptionError(f"--slots {config.slots}: exceeds the model's {E} experts per layer: give {K or 1}..{E}")
    check_prediction(shape, config.depth, config.predict_size)
    for name, value, low, high in (("--readers", config.readers, 1, 256), ("--context", config.context, 1, None),
                                   ("--staging-records", config.staging_records, 8, 256)):  # fmt: skip
        if value < low or (high is not None and value > high):
            raise OptionError(f"{name} {value}: must lie within {low}..{high if high else 'any'}")


def load(model_id: str, config: EngineConfig | None = None, prefetcher=None, **options) -> Engine:
    """An `Engine` for a registered model: `config` (or `EngineConfig` fields as keywords) says
    how many slots, which install and prefetch. A fitted predictor is fitted on first use (its
    traces and fit are cached under the resources folder) and reused afterwards."""
    if config is None:
        config = EngineConfig(**options)
    elif options:
        raise TypeError("give either config or EngineConfig fields as keywords, not both")
    check(model_id, config)
    model, tokenizer, spec, path = registry.load(model_id, lazy=True)
    plan = install = None
    if config.memory is not None:
        if config.slots is not None:
            raise ValueError("give either slots or a memory budget, not both")
        plan, install = plan_memory(model, config)
        print(f"[titan] {plan.describe()}", file=sys.stderr, flush=True)
        config = dataclasses.replace(config, slots=plan.slots)
    if prefetcher is None and config.predictor != "none":
        top_k = top_k_of(model, moe_blocks(model)[0]) or 8
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
    eng = Engine(model, tokenizer, spec, path, config, prefetcher, install)
    eng.plan = plan
    return eng


def plan_memory(model, config: EngineConfig, card: bool = False):
    """The slots a memory budget holds, planned with the install that will run (installs.choose;
    `card`: the one it would be on a CUDA card): (memory.Plan, the install class)."""
    top_k = top_k_of(model, moe_blocks(model)[0]) or 1
    tier = memory.host_tier_bytes(model)
    install = installs.choose(config.install, tier, card=card)
    sizes = dict(context=config.context, readers=config.readers, staging_records=config.staging_records)
    plan = memory.plan(model, config.memory, top_k, install, **sizes)
    if plan.slots == plan.experts:  # every expert fits: the install for a full table, if that fits too
        full = installs.choose(config.install, tier, full=True, card=card)
        again = memory.plan(model, config.memory, top_k, full, **sizes) if full is not install else plan
        if again.slots == again.experts:
            plan, install = again, full
    return plan, install


def plan(model_id: str, budgets, config: EngineConfig | None = None, card: bool = False) -> dict:
    """Whether a registered model decodes within each memory budget, and how: nothing is loaded
    or built (its parameters' shapes only, engine.models.registry.skeleton), so a 26 GB model is
    planned in a second on any machine. `card`: planned for a CUDA card (the install `auto`
    chooses there), wherever this runs. Returns {"weights": its weights' bytes, "resident": the
    bytes decoding with every expert in memory takes, "install": the install's name, "least": the
    least budget it decodes in, "budgets": {budget: memory.Plan, or why it cannot hold the model}}."""
    config = config or EngineConfig()
    check(model_id, config)
    model = registry.skeleton(model_id)
    top_k = top_k_of(model, moe_blocks(model)[0]) or 1
    install = installs.choose(config.install, memory.host_tier_bytes(model), card=card)
    sizes = dict(context=config.context, readers=config.readers, staging_records=config.staging_records)
    out = dict(weights=memory.weight_bytes(model), resident=memory.resident_bytes(model, config.context),
               install=install.name,
               least=memory.plan(model, 1 << 62, top_k, install, **sizes).least, budgets={})  # fmt: skip
    for b in budgets:
        try:
            out["budgets"][b] = plan_memory(model, dataclasses.replace(config, memory=b, slots=None), card)[0]
        except ValueError as e:
            out["budgets"][b] = str(e)
    return out
