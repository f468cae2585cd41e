"""`bench prefill` and `bench batch`: many rows through a layer at once, each configuration beside
resident decoding (the model's own mlx-lm model) in the same repeat, interleaved.

- `prefill`: time to first token through mlx-lm's own `generate_step` for prompts of each
  `--lengths` (capped at the model's context), the decode tok/s after the longest prompt, and
  what each configuration held at its peak (its model's bytes and the most a prompt added);
- `batch`: the aggregate generation tok/s of mlx-lm's `batch_generate` at each `--batches` B, and
  the bus's limit at each B: resident's time a step over the larger of that time and the bus's
  time for every expert the step's rows can name (min(E, B x top-k) a layer), read once, at the
  bandwidth measured in the same run (`harness.bus`). Where B x top-k reaches E, that is every
  expert of every layer a step: the bytes the many-rows path cannot read less of. On an untimed
  run of resident's model it also counts the experts each step's rows name, and the fewest any
  cache of S slots must bring in over the steps (`named_experts`, `fewest_misses`).

A configuration is S (`--slots`) x install (`--installs`) x, for the device install, whether a
prompt copies the next layer's area during this one's compute (`--area-ahead`). Every repeat runs
each configuration once per length (or B) in a rotating order, and each figure is also given as
its ratio to resident's in the same repeat (median, min, max over the repeats). The greedy tokens
of every run are compared with resident's and the comparison recorded. Speed is reported, never
asserted: the machines are noisy."""

import statistics
import time
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import batch_generate, generate_step

from engine import EngineConfig, load, memory
from engine.models import registry
from engine.models.anatomy import moe_blocks
from engine.predict import prompts
from engine.runtime.installs import choose as choose_install
from engine.runtime.loop import model_bytes

from .bus import bus_gb_s
from .report.tables.bench import config_slots, named_limit
from .report.tables.common import paired

AHEAD = {"auto": [None], "on": [True], "off": [False], "both": [True, False]}


def spread(xs) -> dict:
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs), n=len(xs))


def configurations(a, mid) -> dict:
    """name -> EngineConfig of the engines to run (resident, mlx-lm's own model, beside them)."""
    out = {}
    installs = a.installs or ["auto"]
    for s in a.slots or [8, 16, 32]:
        for inst in installs:
            for ahead in AHEAD[a.area_ahead]:
                name = f"S={s}" + ("" if len(installs) == 1 else f"/{inst}")
                name += "" if ahead is None else ("/ahead" if ahead else "/union")
                out[name] = EngineConfig(slots=s, tier=a.tier, install=inst, area_ahead=ahead)
    return out


def long_ids(tok, n: int, prompt_set: str) -> list:
    """`n` tokens of `prompt_set`'s eval prompts joined, the text repeated where it is shorter."""
    text = "\n\n".join(p["text"] for p in prompts.load(prompt_set, "eval"))
    ids = tok.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def timed_generate(model, ids, decode_tokens: int) -> dict:
    """One prompt through mlx-lm's `generate_step`: `ttft` (seconds to its first token), `tok_s`
    of the `decode_tokens` after it (None if 0), `intervals` (each decode token's seconds after
    the one before: work the prompt left queued shows in the first), the greedy `tokens`, and
    `grew`, the most memory it added."""
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    t0 = time.perf_counter()
    times, tokens = [], []
    for token, _ in generate_step(mx.array(ids, mx.uint32), model, max_tokens=decode_tokens + 1):
        times.append(time.perf_counter())
        tokens.append(int(token))
    tok_s = (len(times) - 1) / (times[-1] - times[0]) if decode_tokens else None
    return dict(ttft=times[0] - t0, tok_s=tok_s, intervals=[b - a for a, b in zip(times, times[1:])],
                tokens=tokens, grew=max(0, mx.get_peak_memory() - start))  # fmt: skip


def first_apart(seconds: list) -> tuple[float, float] | None:
    """A decode's first token's seconds and the mean of the rest's (None with fewer than two): what
    a prompt left queued is waited for in the first."""
    return (seconds[0], statistics.mean(seconds[1:])) if len(seconds) > 1 else None


def first_token(model, ids, decode_tokens: int):
    """`timed_generate`'s seconds to the first token, tok/s, tokens and memory added, as a tuple."""
    t = timed_generate(model, ids, decode_tokens)
    return t["ttft"], t["tok_s"], t["tokens"], t["grew"]


def _load(mid, configs):
    ref, tok, _ = registry.load_reference(mid)
    engines = {k: load(mid, c) for k, c in configs.items()}
    models = {"resident": ref, **{k: e.model for k, e in engines.items()}}
    return tok, engines, models


def default_install(models) -> str:
    """The install `--install auto` gives on this machine (what a user gets): the reports set it
    first where a run measured several."""
    return choose_install("auto", memory.host_tier_bytes(models["resident"])).name


def _rotated(names, i):
    return names[i % len(names) :] + names[: i % len(names)]


def prefill(a):
    mid = a.model or "olmoe-1b-7b-shape"
    context = registry.context_of(mid)
    lengths = sorted({min(n, context - a.tokens - 1) for n in a.lengths})
    tok, engines, models = _load(mid, configurations(a, mid))
    names = list(models)
    try:
        ids = {n: long_ids(tok, n, a.set) for n in lengths}
        for m in models.values():  # warm-up: first-call compilation, at every shape's first use
            for n in lengths:
                first_token(m, ids[n][: max(8, n // 8)], 2)
        ttft = {k: {n: [] for n in lengths} for k in names}
        decode, grew, tokens = {k: [] for k in names}, dict.fromkeys(names, 0), {k: {} for k in names}
        for r in range(a.repeats):
            for n in lengths:
                for k in _rotated(names, r):
                    more = a.tokens if n == lengths[-1] else 0
                    s, tok_s, toks, peak = first_token(models[k], ids[n], more)
                    ttft[k][n].append(s)
                    grew[k] = max(grew[k], peak)
                    tokens[k].setdefault(n, toks)
                    if tok_s is not None:
                        decode[k].append(tok_s)
        installs = {k: e.install.name for k, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()
    res = ttft["resident"]
    out = dict(
        bench="prefill",
        model=mid,
        lengths=lengths,
        repeats=a.repeats,
        decode_tokens=a.tokens,
        install=installs,
        default_install=default_install(models),
        ttft_s={k: {str(n): spread(v) for n, v in per.items()} for k, per in ttft.items()},
        # a configuration's speed over resident's in the same repeat: resident's seconds over its own
        x_resident={k: {str(n): paired(res[n], v) for n, v in per.items()} for k, per in ttft.items()},
        decode_tok_s={k: spread(v) for k, v in decode.items()},
        decode_x_resident={k: paired(v, decode["resident"]) for k, v in decode.items()},
        memory_bytes={k: model_bytes(m) + grew[k] for k, m in models.items()},
        tokens_match={k: tokens[k] == tokens["resident"] for k in names},
    )
    out["memory_x_resident"] = {k: v / out["memory_bytes"]["resident"] for k, v in out["memory_bytes"].items()}
    show_prefill(out)
    return out


def show_prefill(out):
    print(
        f"{out['model']}: time to first token over {out['repeats']} interleaved repeats, through mlx-lm's generate_step"
    )
    print("  (x resident: resident's time over this one's, paired in each repeat: median [min, max])")
    for k, per in out["ttft_s"].items():
        parts = []
        for n, sp in per.items():
            x = out["x_resident"][k][n]
            parts.append(f"{n}: {1e3 * sp['median']:.0f} ms x{x['median']:.2f} [{x['min']:.2f}, {x['max']:.2f}]")
        dec, dx = out["decode_tok_s"][k], out["decode_x_resident"][k]
        print(f"  {k:14s} " + "; ".join(parts))
        print(
            f"  {'':14s} decode after {out['lengths'][-1]}: {dec['median']:.1f} tok/s x{dx['median']:.2f} "
            f"[{dx['min']:.2f}, {dx['max']:.2f}]; memory {out['memory_bytes'][k] / 1e9:.2f} GB "
            f"(x{out['memory_x_resident'][k]:.2f}); tokens {'= resident' if out['tokens_match'][k] else 'DIFFER'}"
        )


def batch(a):
    mid = a.model or "olmoe-1b-7b-shape"
    tok, engines, models = _load(mid, configurations(a, mid))
    names = list(models)
    texts = [p["text"] for p in prompts.load(a.set, "eval")]
    batches = sorted(set(a.batches))
    sets = {b: [tok.encode(texts[i % len(texts)])[: a.prompt_tokens or 64] for i in range(b)] for b in batches}
    try:
        for m in models.values():  # warm-up
            batch_generate(m, tok, sets[batches[-1]], max_tokens=2)
        tps = {k: {b: [] for b in batches} for k in names}
        ids = {k: {} for k in names}
        for r in range(a.repeats):
            for b in batches:
                for k in _rotated(names, r):
                    resp = batch_generate(models[k], tok, sets[b], max_tokens=a.tokens, return_token_ids=True)
                    tps[k][b].append(resp.stats.generation_tps)
                    ids[k].setdefault(b, resp.token_ids)
        slots = [config_slots(k) for k in names if k.startswith("S=")]
        named = {b: named_experts(models["resident"], tok, sets[b], a.tokens, slots) for b in batches}
        installs = {k: e.install.name for k, e in engines.items()}
        store = next(iter(engines.values())).store  # every configuration reads the same store
        bus, experts, expert_bytes = bus_gb_s(store), [n["experts"] for n in store.layers], store.expert_bytes
    finally:
        for e in engines.values():
            e.close()
    res = tps["resident"]
    out = dict(
        bench="batch",
        model=mid,
        batches=batches,
        repeats=a.repeats,
        tokens=a.tokens,
        prompt_tokens=a.prompt_tokens or 64,
        install=installs,
        default_install=default_install(models),
        tok_s={k: {str(b): spread(v) for b, v in per.items()} for k, per in tps.items()},
        x_resident={k: {str(b): paired(v, res[b]) for b, v in per.items()} for k, per in tps.items()},
        tokens_match={k: all(ids[k][b] == ids["resident"][b] for b in batches) for k in names},
        named_experts={str(b): v for b, v in named.items()},
    )
    top_k = registry.shape(mid)["top_k"]
    out.update(bus_limit(bus, experts, expert_bytes, top_k, {b: statistics.median(res[b]) for b in batches}))
    print(f"{mid}: batch_generate aggregate tok/s, {a.tokens} tokens a sequence, {a.repeats} interleaved repeats")
    for k, per in out["tok_s"].items():
        parts = [
            f"B={b}: {sp['median']:.1f} x{out['x_resident'][k][b]['median']:.2f} "
            f"[{out['x_resident'][k][b]['min']:.2f}, {out['x_resident'][k][b]['max']:.2f}]"
            for b, sp in per.items()
        ]
        print(f"  {k:14s} " + "; ".join(parts) + ("" if out["tokens_match"][k] else "  tokens DIFFER"))
    print(f"  {'bus limit':14s} " + "; ".join(f"B={b}: x{x:.2f}" for b, x in out["bus_limit_x_resident"].items())
          + f"  ({bus['gb_s']:.1f} GB/s, {bus['how']})")  # fmt: skip
    for k in (k for k in names if k.startswith("S=")):  # what the experts the rows named allow S held
        lim = [named_limit(out["named_experts"][str(b)], config_slots(k), expert_bytes, bus["gb_s"],
                           statistics.median(res[b])) for b in batches]  # fmt: skip
        print(f"  {'  at ' + k:14s} " + "; ".join(f"B={b}: x{x:.2f}" for b, x in zip(batches, lim)))
    return out


class _NamedCounter(nn.Module):
    """Stands in for a switch module while a batch decodes: keeps the expert indices of each call
    of at most `rows` rows (a decode step's, one a sequence; a prompt's are more), then runs the
    original."""

    def __init__(self, switch, rows: int, sink: list):
        super().__init__()
        self.switch, self._rows, self._sink = switch, rows, sink

    def __call__(self, x, indices, *args, **kwargs):
        if indices.size // indices.shape[-1] <= self._rows:
            self._sink.append(indices)
        return self.switch(x, indices, *args, **kwargs)


def fewest_misses(steps: list, slots: int) -> int:
    """The fewest experts a cache of `slots` experts must bring in over `steps` (each the set of
    experts one call's rows name, in order), whatever it keeps, starting from the best it could
    hold: a step brings in what it names that the cache does not hold, and afterwards the cache may
    keep any `slots` of those it held and those just named (all on the device then). Keeping the
    ones named again soonest is Belady's rule, optimal for such a cache (bringing in is the only
    cost, and leaving an expert out is free)."""
    brought, nxt = 0, [{} for _ in steps]
    later = {}  # expert -> the next step naming it, filled from the end
    for t in range(len(steps) - 1, -1, -1):
        nxt[t] = dict(later)
        for e in steps[t]:
            later[e] = t
    # it starts warm: holding the experts named first, as the best a prompt could leave
    held = set(sorted(later, key=lambda e: (later[e], e))[:slots])
    for t, named in enumerate(steps):
        brought += len(named - held)
        pool = held | named
        if len(pool) > slots:
            pool = set(sorted(pool, key=lambda e: (nxt[t].get(e, len(steps)), e))[:slots])
        held = pool
    return brought


def named_experts(model, tok, ids: list, tokens: int, slots=()) -> dict:
    """How many distinct experts the rows of a decode step name, per MoE layer, over one untimed
    `batch_generate` of `ids` on `model` (resident's: every configuration's tokens are compared with
    its): `counts` maps a count u to the (step, layer) pairs that named u experts, `steps` and `rows`
    are the decode steps and their rows (tokens) a layer. A path holding S of a layer's experts
    must bring max(0, u - S) of them across the bus, whatever it does: the bus's limit where the
    rows name fewer than every expert. `fewest_misses` maps each S of `slots` to the experts a
    cache of S a layer must bring in over the steps at the least (`fewest_misses`), summed over the
    layers: the tighter limit, since what one step's rows name is not what the next step's name.
    Needs prompts of at least 3 tokens (a prompt's rows are then more than the batch's)."""
    blocks, sinks = moe_blocks(model), []
    for b in blocks:
        sinks.append([])
        setattr(b.parent, b.attr, _NamedCounter(b.switch, len(ids), sinks[-1]))
    try:
        batch_generate(model, tok, ids, max_tokens=tokens)
    finally:
        for b in blocks:
            setattr(b.parent, b.attr, b.switch)
    named = [[set(np.unique(np.array(i)).tolist()) for i in sink] for sink in sinks]
    counts = Counter(len(u) for layer in named for u in layer)
    first = sinks[0] if sinks else []
    least = {str(s): sum(fewest_misses(layer, s) for layer in named) for s in sorted(set(slots))}
    return dict(steps=len(first), rows=sum(i.size // i.shape[-1] for i in first), layers=len(blocks),
                counts={str(u): n for u, n in sorted(counts.items())}, fewest_misses=least)  # fmt: skip


def bus_limit(bus: dict, experts: list, expert_bytes: int, top_k: int, resident_tok_s: dict) -> dict:
    """The bus's limit at each batch size B (the module docstring) from the bandwidth `bus`, each
    MoE layer's expert count, an expert's bytes and resident's median tok/s at B: the bytes a step
    if every expert its rows can name crossed the bus once, and resident's time a step (B tokens)
    over the larger of its own and the bus's time for those bytes."""
    step_bytes, limit = {}, {}
    for b, tok_s in resident_tok_s.items():
        step_bytes[str(b)] = sum(min(e, b * top_k) for e in experts) * expert_bytes
        resident_s, bus_s = b / tok_s, step_bytes[str(b)] / (bus["gb_s"] * 1e9)
        limit[str(b)] = resident_s / max(resident_s, bus_s)
    return dict(bus=bus, top_k=top_k, experts=max(experts), expert_bytes=expert_bytes, step_bytes=step_bytes,
                bus_limit_x_resident=limit)  # fmt: skip
