"""The engine: an mlx-lm model whose MoE blocks compute over slot tables filled from the expert
store. `build_cache` makes the store's tables and the cache for any user of them (the engine,
the benches, a remote node of a multi-node run)."""

import sys

import mlx.core as mx

from .. import device
from ..config import EngineConfig, build_lock, resolved_overlap, resources_dir
from ..models.anatomy import expert_params, moe_blocks, top_k_of
from ..predict import predictors
from . import hosttier
from . import store as store_mod
from .devicemap import DeviceCache, DeviceSwitchGLU
from .deviceprefetch import DevicePrefetch
from .moe import ExpertCache, SlotSwitchGLU
from .prefetch import NoPrefetch
from .slots import SlotTable


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


def build_cache(
    store,
    slots,
    eviction="lru",
    install="auto",
    prefetcher=None,
    sync="batched",
    staging_records=64,
    overlap=True,
    layers=None,
) -> ExpertCache:
    """One slot table per MoE layer of `store` (`slots` per layer: one number, or one per layer)
    and the cache over them. `install` is resolved for this device (engine.device)."""
    layers = list(range(store.num_layers)) if layers is None else list(layers)
    per_layer = [slots] * len(layers) if isinstance(slots, int) else list(slots)
    mode = device.resolve_install(install)
    tables = [SlotTable(o, store.num_experts(o), s, store.tensors, eviction, mode) for o, s in zip(layers, per_layer)]
    return ExpertCache(store, tables, prefetcher or NoPrefetch(), sync, staging_records, overlap)


class Engine:
    """An mlx-lm model whose experts live in slot tables filled from the expert store.

    Made by `engine.load(model_id, config)`, or from an already loaded (lazy) mlx-lm model."""

    def __init__(self, model, tokenizer, spec, model_path, config: EngineConfig | None = None, prefetcher=None):
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
        self.install = self._choose_install(config, prefetcher)
        overlap = resolved_overlap(config.overlap, self.install)
        if self.install == "device":
            try:
                device_pf = None
                if prefetcher is not None and not isinstance(prefetcher, NoPrefetch):
                    device_pf = DevicePrefetch(prefetcher.predictor, prefetcher.depth, len(blocks), num_experts)
                self.cache = DeviceCache(self.store, slots, prefetcher=device_pf, overlap=overlap)
            except BaseException:
                self.store.close()
                raise
            self.tables = self.cache.tables
            for o, b in enumerate(blocks):
                setattr(b.parent, b.attr, DeviceSwitchGLU(b.switch, self.cache, o))
        else:
            self.cache = build_cache(
                self.store,
                slots,
                config.eviction,
                self.install,
                prefetcher,
                config.sync,
                config.staging_records,
                overlap,
            )
            self.tables = self.cache.tables
            for o, b in enumerate(blocks):
                setattr(b.parent, b.attr, SlotSwitchGLU(b.switch, self.tables[o], self.cache, o))
                if self.tables[o].full:
                    self.cache.fill(o)
        # Everything but the experts (which were never materialised) loads now.
        mx.eval(model.parameters())

    def _choose_install(self, config, prefetcher) -> str:
        """The install that runs: `auto` per device (engine.device), and on a CUDA GPU the `device`
        install only when the host tier fits in host memory; said on stderr when `auto` steps back."""
        mode = device.resolve_install(config.install)
        if mode != "device":
            return mode
        if config.install == "auto" and self.slots == self.num_experts:
            return device.resolve_install("pinned")  # every expert resident: no miss, no host tier needed
        need = self.store.num_layers * self.num_experts * self.store.record_bytes
        why = None
        if not hosttier.fits(need):
            why = f"its host tier ({need / 1e9:.2f} GB) does not fit in this machine's available memory"
        if why is None:
            return mode
        if config.install == "device":
            self.store.close()
            raise ValueError(f"--install device cannot run here: {why}")
        fallback = device.resolve_install("pinned")
        print(f"[titan] install auto: {fallback}, not device: {why}", file=sys.stderr, flush=True)
        return fallback

    @property
    def predictor(self):
        return getattr(self.cache.prefetcher, "predictor", None)

    def bind_oracle(self, experts):
        """Give the oracle predictor the (T, L, K) expert sets of the run about to decode."""
        if isinstance(self.predictor, predictors.Oracle):
            self.predictor.bind(experts)
            if self.install == "device" and self.cache.prefetcher is not None:
                self.cache.prefetcher.rows(experts)  # uploaded now, not inside the first decode token

    def counters(self) -> dict:
        if self.install == "device":
            return self.cache.counters()
        total = {}
        for t in self.tables:
            for k, v in t.counters().items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self):
        self.cache.close()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
