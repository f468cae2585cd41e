"""The engine: an mlx-lm model whose MoE blocks compute over slot tables filled from the expert
store. `build_cache` makes a store's cache for any user of one (the benches, a remote node of a
multi-node run)."""

import sys

import mlx.core as mx

from ..config import EngineConfig, build_lock, resources_dir
from ..models.anatomy import expert_params, moe_blocks, top_k_of
from . import installs
from . import store as store_mod
from .moe import SlotSwitchGLU


def store_dir(model_id: str):
    return resources_dir() / "stores" / model_id


def open_store(model_id: str, model, model_path, tier="page_cache", readers=4, verify="first", build=True):
    """Open a model's expert store, building it first if it does not exist."""
    path = store_dir(model_id)
    if not (path / "index.json").exists():
        if not build:
            raise store_mod.StoreError(f"{path}: no store; run `python -m engine store build {model_id}`")
        with build_lock(path):
            if not (path / "index.json").exists():  # another process may have built it meanwhile
                print(f"[titan] building the expert store of {model_id} into {path} ...", file=sys.stderr, flush=True)
                store_mod.build(model, model_path, path, model_id)
    return store_mod.Store(path, model_path=model_path, tier=tier, readers=readers, verify=verify)


def host_tier_bytes(store) -> int:
    """What the device install's host tier of `store` takes: every expert's record."""
    return sum(store.num_experts(o) for o in range(store.num_layers)) * store.record_bytes


def build_cache(store, slots, config: EngineConfig | None = None, prefetcher=None, layers=None, device_ok=False):
    """The cache of a store's `layers` (all by default) with `slots` per layer (one number, or one
    per layer), its install chosen for this device from `config.install` (a host install unless
    `device_ok`)."""
    config = config or EngineConfig()
    full = all(s == store.num_experts(0) for s in ([slots] if isinstance(slots, int) else slots))
    chosen = installs.choose(config.install, host_tier_bytes(store), full, device_ok)
    return chosen(store, config).cache(slots, config, prefetcher, layers)


class Engine:
    """An mlx-lm model whose experts live in slot tables filled from the expert store.

    Made by `engine.load(model_id, config)`, or from an already loaded (lazy) mlx-lm model.
    `install`: the install class (installs.choose) where the caller chose it (a memory plan);
    otherwise it is chosen here, from `config.install`."""

    def __init__(self, model, tokenizer, spec, model_path, config: EngineConfig | None = None, prefetcher=None,
                 install=None):  # fmt: skip
        config = config or EngineConfig()
        self.model, self.tokenizer, self.spec, self.config = model, tokenizer, spec, config
        blocks = moe_blocks(model)
        if not blocks:
            raise ValueError(f"model '{spec['id']}' has no MoE layer (no SwitchGLU or SwitchMLP): nothing to offload")
        num_experts = expert_params(blocks[0].switch)[0][1].shape[0]
        top_k = top_k_of(model, blocks[0])
        slots = num_experts if config.slots is None else config.slots
        if top_k is not None and slots < top_k:
            raise ValueError(
                f"slots ({slots}) < top_k ({top_k}): every expert a token routes to must be resident at once"
            )
        if slots > num_experts:
            raise ValueError(f"slots ({slots}) exceeds the number of experts per layer ({num_experts})")
        depth = getattr(prefetcher, "depth", 0)
        if depth > len(blocks):
            raise ValueError(f"--depth {depth}: must lie within 1..{len(blocks)} (the model's MoE layers)")
        self.num_experts, self.top_k, self.slots = num_experts, top_k, slots
        self.store = open_store(spec["id"], model, model_path, config.tier, config.readers, config.verify)
        if self.store.num_layers != len(blocks):
            self.store.close()
            raise store_mod.StoreError(
                f"{self.store.path}: {self.store.num_layers} MoE layers, model has {len(blocks)}"
            )
        try:
            chosen = install or installs.choose(config.install, host_tier_bytes(self.store), slots == num_experts)
            self.install = chosen(self.store, config)
            self.cache = self.install.cache(slots, config, prefetcher)
        except BaseException:
            self.store.close()
            raise
        for o, b in enumerate(blocks):
            setattr(b.parent, b.attr, SlotSwitchGLU(b.switch, self.cache, o))
        # Everything but the experts (which were never materialised) loads now.
        mx.eval(model.parameters())

    @property
    def predictor(self):
        return getattr(self.cache.prefetcher, "predictor", None)

    def bind_oracle(self, experts):
        """Give a predictor that reads the run's own trace (the oracle) the (T, L, K) expert sets of
        the run about to decode."""
        if self.predictor is not None:
            self.predictor.bind(experts)
            self.cache.prepare()

    def counters(self) -> dict:
        return self.cache.counters()

    def close(self):
        self.cache.close()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
