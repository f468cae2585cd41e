"""The runtime: wraps an mlx-lm model, swaps its MoE blocks' experts for slot tables backed by
the expert store, and runs greedy decoding with per-token figures."""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from . import device, registry, store as store_mod
from .moe import ExpertCache, SlotSwitchGLU, StepStats
from . import predictors, prefetch
from .prefetch import NoPrefetch
from .slots import SlotTable


@dataclass
class EngineConfig:
    slots: int | None = None  # None: every expert resident (S = E)
    tier: str = "page_cache"
    install: str = "auto"  # inplace on the CPU, copy on a GPU (engine.device says why)
    sync: str = "batched"  # or per_miss: the paper's first version, for its ablation
    readers: int = 4
    eviction: str = "lru"
    verify: str = "first"
    predictor: str = "none"
    depth: int = 1
    predict_size: int | None = None  # None: top_k
    min_prob: float = 0.0  # fitted predictors issue only experts at least this likely (0: all predicted)
    fit_set: str = "general"  # the prompt set whose fit traces fitted predictors learn from
    trace_tokens: int = 32  # decode tokens per prompt in those traces
    staging_records: int = 64  # pinned install: host records in the staging pool (8 to 256)
    overlap: bool = True  # start each MoE layer's compute at once (async) rather than at the next sync


def store_dir(model_id: str) -> Path:
    return registry.resources_dir() / "stores" / model_id


def open_store(model_id: str, model, model_path, tier="page_cache", readers=4, verify="first", build=True):
    """Open a model's expert store, building it first if it does not exist."""
    path = store_dir(model_id)
    if not (path / "index.json").exists():
        if not build:
            raise store_mod.StoreError(f"{path}: no store; run `python -m engine store build {model_id}`")
        print(f"[titan] building the expert store of {model_id} into {path} ...", file=sys.stderr, flush=True)
        store_mod.build(model, model_path, path, model_id)
    return store_mod.Store(path, model_path=model_path, tier=tier, readers=readers, verify=verify)


class Engine:
    """An mlx-lm model whose experts live in slot tables filled from the expert store."""

    def __init__(self, model, tokenizer, spec, model_path, config: EngineConfig, prefetcher=None):
        self.model, self.tokenizer, self.spec, self.config = model, tokenizer, spec, config
        blocks = store_mod.moe_layers(model)
        first = blocks[0][1]
        num_experts = first.gate_proj["weight"].shape[0]
        top_k = model.layers[blocks[0][0]].mlp.top_k
        slots = num_experts if config.slots is None else config.slots
        if slots < top_k:
            raise ValueError(
                f"slots ({slots}) < top_k ({top_k}): every expert a token routes to must be resident at once"
            )
        if slots > num_experts:
            raise ValueError(f"slots ({slots}) exceeds the number of experts per layer ({num_experts})")
        self.num_experts, self.top_k, self.slots = num_experts, top_k, slots
        self.store = open_store(spec["id"], model, model_path, config.tier, config.readers, config.verify)
        if self.store.num_layers != len(blocks):
            raise store_mod.StoreError(f"{self.store.path}: {self.store.num_layers} MoE layers, model has {len(blocks)}")
        install = device.resolve_install(config.install)
        self.tables = [
            SlotTable(o, num_experts, slots, self.store.tensors, config.eviction, install)
            for o in range(len(blocks))
        ]
        self.cache = ExpertCache(self.store, self.tables, prefetcher or NoPrefetch(), config.sync,
                                 config.staging_records, config.overlap)
        for o, (li, glu) in enumerate(blocks):
            model.layers[li].mlp.switch_mlp = SlotSwitchGLU(glu, self.tables[o], self.cache, o)
            if self.tables[o].full:
                self.cache.fill(o)
        # Everything but the experts (which were never materialised) loads now.
        mx.eval(model.parameters())

    @classmethod
    def load(cls, model_id: str, config: EngineConfig | None = None, prefetcher=None):
        config = config or EngineConfig()
        model, tokenizer, spec, path = registry.load(model_id, lazy=True)
        if prefetcher is None:
            top_k = next(model.layers[li].mlp.top_k for li, _ in store_mod.moe_layers(model))
            prefetcher = prefetch.make(config.predictor, config.depth, make_predictor(model_id, config, top_k))
        return cls(model, tokenizer, spec, path, config, prefetcher)

    @property
    def predictor(self):
        return getattr(self.cache.prefetcher, "predictor", None)

    def bind_oracle(self, experts):
        """Give the oracle predictor the (T, L, K) expert sets of the run about to decode."""
        if isinstance(self.predictor, predictors.Oracle):
            self.predictor.bind(experts)

    def counters(self) -> dict:
        total = {}
        for t in self.tables:
            for k, v in t.counters().items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self):
        self.cache.close()
        self.store.close()


def fitted_predictor(model_id: str, name: str, depth: int, size: int, prompt_set: str = "general",
                     tokens: int = 32, refit: bool = False):
    """The `name` predictor fitted on `prompt_set`'s fit trace of `tokens` decode tokens per prompt.

    A saved one is reused only if it was fitted on the very trace file there now (its sha256), so
    the workflow's `fit` jobs serve every later reader and a re-recorded trace is never paired
    with a stale fit. Otherwise it is fitted (tracing the fit prompts first if need be) and saved."""
    from . import trace
    from .embedded import sha256_file

    tpath = trace.trace_path(model_id, prompt_set, "fit", tokens)
    if not tpath.exists():
        print(f"[titan] tracing {model_id} over the {prompt_set} fit prompts ...", file=sys.stderr, flush=True)
        trace.run(model_id, prompt_set, "fit", tokens)
    path = predictors.fitted_path(model_id, prompt_set, name, depth, size, tokens)
    digest = sha256_file(tpath)
    if path.exists() and not refit:
        meta = predictors.sidecar(path)
        if meta.get("trace_sha256") == digest and meta.get("format") == predictors.FORMAT:
            return predictors.load(path)
        why = "another " + tpath.name if meta.get("trace_sha256") != digest else "an older engine's format"
        print(f"[titan] {path} was fitted on {why}; fitting again", file=sys.stderr, flush=True)
    tr = trace.load(tpath)
    if tr.meta.get("model") != model_id:
        raise trace.TraceError(f"{tpath}: a trace of {tr.meta.get('model')!r}, not of {model_id!r}")
    t0 = time.perf_counter()
    pred = predictors.make(name, depth, size).fit(tr)
    predictors.save(pred, path, dict(model=model_id, trace=str(tpath), trace_sha256=digest, device=device.kind(),
                                     fit_seconds=time.perf_counter() - t0, prompts=tr.meta["result"]["prompts"]))
    return pred


def get_predictor(model_id: str, name: str, depth: int, size: int, prompt_set: str = "general", tokens: int = 32,
                  min_prob: float = 0.0):
    """Predictor `name`: the saved fit for a fitted one (see `fitted_predictor`), else a fresh one.
    `min_prob` is a confidence floor on what it predicts, not part of the fit."""
    pred = predictors.make(name, depth, size, min_prob)  # checks the name and min_prob first
    if name in predictors.FITTED:
        pred = fitted_predictor(model_id, name, depth, size, prompt_set, tokens)
        pred.min_prob = min_prob
    return pred


def make_predictor(model_id: str, config: EngineConfig, top_k: int):
    return get_predictor(model_id, config.predictor, config.depth, config.predict_size or top_k, config.fit_set,
                         config.trace_tokens, config.min_prob)


def load_reference(model_id: str):
    """The unmodified mlx-lm model, every expert in memory: the bit-exactness reference."""
    model, tokenizer, spec, _ = registry.load(model_id)
    return model, tokenizer, spec


def expert_cache(model) -> ExpertCache | None:
    """The ExpertCache of an engine model; None for plain mlx-lm."""
    for layer in model.layers:
        sw = getattr(layer.mlp, "switch_mlp", None)
        if isinstance(sw, SlotSwitchGLU):
            return sw._cache
    return None


def decode(model, prompt_ids, max_tokens: int, forced=None, keep_logits=False, eos_id=None):
    """Greedy decoding: one prefill over the prompt, then `max_tokens` single-token steps.

    Works on an engine model and on plain mlx-lm alike. With `forced`, those tokens are fed
    instead of the model's own choices (teacher forcing, to compare two models step by step).
    Returns the generated tokens, one record per step (index 0 is the prefill) and, with
    `keep_logits`, the float32 logits of every step.
    """
    cache = make_prompt_cache(model)
    experts = expert_cache(model)
    stats = experts.stats if experts is not None else StepStats()
    records, logits_out, tokens = [], [], []
    inp = mx.array(prompt_ids, dtype=mx.uint32)[None]
    position = 0
    for step in range(max_tokens + 1):
        if experts is not None:
            experts.begin_step(position, inp.shape[1])
        position += inp.shape[1]
        t0 = time.perf_counter()
        logits = model(inp, cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y, logits)
        dt = time.perf_counter() - t0
        rec = dict(step=step, phase="prefill" if step == 0 else "decode", rows=inp.shape[1], seconds=dt)
        rec.update(stats.as_dict())
        records.append(rec)
        if keep_logits:
            logits_out.append(np.array(logits.astype(mx.float32))[0])
        tok = int(y.item()) if forced is None else int(forced[step])
        tokens.append(tok)
        if eos_id is not None and tok == eos_id:
            break
        inp = mx.array([[tok]], dtype=mx.uint32)
    return tokens, records, logits_out


def summarize(records) -> dict:
    """Decode-phase figures: tokens/s, hit rate, bytes and stall per token, per-miss split."""
    dec = [r for r in records if r["phase"] == "decode"]
    if not dec:
        return {}
    n = len(dec)
    secs = sum(r["seconds"] for r in dec)
    hits, misses = sum(r["hits"] for r in dec), sum(r["misses"] for r in dec)
    out = dict(
        tokens=n,
        tok_s=n / secs,
        hits=hits,
        misses=misses,
        hit_rate=hits / (hits + misses) if hits + misses else None,
        bytes_read_per_token=sum(r["bytes_read"] for r in dec) / n,
        stall_s_per_token=sum(r["stall_s"] for r in dec) / n,
    )
    if misses:
        for k in ("pread_s", "array_s", "install_s", "stall_s"):
            out[f"per_miss_{k[:-2]}_ms"] = 1e3 * sum(r[k] for r in dec) / misses
    return out


SPLIT = ("sync_s", "stall_s", "array_s", "install_s")


def time_split(records) -> dict:
    """Where a decode token's time goes, in ms per token: waiting at the host synchronisations
    (the device's compute up to each MoE layer, and the synchronisation itself), waiting for reads,
    making arrays or enqueueing copy kernels, installs, and the rest (the host building the graph)."""
    dec = [r for r in records if r["phase"] == "decode"]
    if not dec:
        return {}
    n = len(dec)
    out = {k[:-2]: 1e3 * sum(r.get(k, 0.0) for r in dec) / n for k in SPLIT}
    total = 1e3 * sum(r["seconds"] for r in dec) / n
    out["other"] = total - sum(out.values())
    out["total"] = total
    return out


