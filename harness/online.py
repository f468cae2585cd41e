"""Gate C (`prefetch_online`): decode throughput, stall, hit rate and prefetch counts across
slots, predictors and depth, on one model, tier and prompt set, with resident mlx-lm as the
ceiling measured in the same run; and the offline quality of every predictor."""

import sys
import time

import numpy as np

from engine import load
from engine.config import EngineConfig
from engine.models import registry
from engine.models.registry import load_reference
from engine.predict import predictors, prompts
from engine.runtime.loop import PEAKS, decode, model_bytes, totals
from engine.runtime.store import model_digest
from engine.tracing import simulate, trace
from engine.tracing.fitting import get_predictor
from harness.checkpoint import Repetitions
from harness.provenance import code_digest, git_state


def accumulate(acc, records):
    """Add a decode's steps (not its prefill, which is reported apart) to `acc`."""
    for k, v in totals(records).items():
        if k in PEAKS:  # a peak over several decodes is their largest
            acc[k] = max((x for x in (acc.get(k), v) if x is not None), default=None)
        else:
            acc[k] = acc.get(k, 0) + v


def configs(experts, slots, predictor_names, depths, min_probs=(0.0,)):
    """(slots, predictor, depth, min_prob) to run: the ceiling, S = E, then every S < E; a fitted
    predictor at every confidence floor in `min_probs`, the others without one."""
    out = [(experts, "mlx-lm", 0, 0.0), (experts, "none", 0, 0.0)]
    for s in sorted(s for s in slots if s < experts):
        out.append((s, "none", 0, 0.0))
        out += [
            (s, p, d, q)
            for p in predictor_names
            if p != "none"
            for d in depths
            for q in (min_probs if p in predictors.FITTED else (0.0,))
        ]
    return out


def summarize(acc) -> dict:
    n = acc["tokens"]
    res = dict(
        tokens=n,
        seconds=acc["seconds"],
        tok_s=n / acc["seconds"],
        stall_ms_per_token=1e3 * acc["stall_s"] / n,
        late_stall_ms_per_token=1e3 * acc["late_stall_s"] / n,
        sync_ms_per_token=1e3 * acc["sync_s"] / n,
        predict_ms_per_token=1e3 * acc["predict_s"] / n,
        bytes_read_per_token=acc["bytes_read"] / n,
    )
    total = acc["hits"] + acc["misses"]
    res["hit_rate"] = acc["hits"] / total if total else None
    for k in PEAKS:
        res[k] = acc.get(k)
    for k in ("hits", "misses", "issued", "useful", "wasted", "late"):
        res[k] = acc[k]
    if acc["misses"]:
        for k in ("pread", "array", "install", "stall"):
            res[f"per_miss_{k}_ms"] = 1e3 * acc[f"{k}_s"] / acc["misses"]
    return res


TIMED = (
    "tok_s",
    "stall_ms_per_token",
    "late_stall_ms_per_token",
    "sync_ms_per_token",
    "predict_ms_per_token",
    "per_miss_pread_ms",
    "per_miss_array_ms",
    "per_miss_install_ms",
    "per_miss_stall_ms",
)


def summarize_repeats(accs) -> dict:
    """One configuration over its repetitions: counts over all of them; every timed figure the
    median of the repetitions' values, with their minimum and maximum (`<figure>_min`, `_max`)."""
    total = {}
    for acc in accs:
        for k, v in acc.items():
            if k in PEAKS:
                total[k] = max((x for x in (total.get(k), v) if x is not None), default=None)
            else:
                total[k] = total.get(k, 0) + v
    res = summarize(total)
    each = [summarize(acc) for acc in accs]
    for k in TIMED:
        vals = [e[k] for e in each if e.get(k) is not None]
        if vals:
            res[k], res[f"{k}_min"], res[f"{k}_max"] = float(np.median(vals)), min(vals), max(vals)
    res["repeats"] = len(accs)
    return res


def phase_log():
    """A `say(message)` that prints to stderr with the seconds since it was made: a sweep's log
    then tells where its time went even when a time limit cuts it short (its records come last)."""
    start = time.perf_counter()

    def say(msg):
        print(f"[titan] {time.perf_counter() - start:8.1f} s  {msg}", file=sys.stderr, flush=True)

    return say


def run_interleaved(models: dict, inputs, tokens: int, repeats: int, bind=None, say=None, checkpoint=None) -> dict:
    """Every model decodes every input once per repetition, in an order that rotates between
    repetitions; returns per model the list of each repetition's totals. With a `checkpoint`
    (harness.checkpoint.Repetitions) the repetitions an earlier process finished are taken from
    it and each one finished here is saved to it."""
    names = list(models)
    done = checkpoint.load(names) if checkpoint is not None else []
    accs = {n: [rep[n] for rep in done] for n in names}
    for r in range(len(done), repeats):
        if say:
            say(f"repetition {r + 1} of {repeats}: {len(names)} configurations x {len(inputs)} prompts")
        for n in names[r % len(names) :] + names[: r % len(names)]:
            acc = {}
            for i, ids in enumerate(inputs):
                if bind is not None:
                    bind(n, i)
                accumulate(acc, decode(models[n], ids, tokens)[1])
            accs[n].append(acc)
        if checkpoint is not None:
            checkpoint.save([{n: accs[n][k] for n in names} for k in range(r + 1)])
    return accs


def sweep(
    model_id,
    tier,
    prompt_set,
    slots,
    predictor_names,
    depths,
    n_prompts,
    tokens,
    readers=4,
    fit_tokens=32,
    install="auto",
    progress=None,
    size=None,
    repeats=3,
    min_probs=(0.0,),
    checkpoint=None,
):
    """One result dict per configuration (see `configs`): each configuration decodes every
    prompt once per repetition, the configurations interleaved (summarize_repeats). With a
    `checkpoint` path a sweep stopped part way resumes at its next repetition (harness.checkpoint);
    the path is removed once the results are made."""
    say = phase_log()
    reps = None
    if checkpoint is not None:
        key = dict(
            model=model_id,
            tier=tier,
            prompt_set=prompt_set,
            slots=list(slots),
            predictors=list(predictor_names),
            depths=list(depths),
            prompts=n_prompts,
            tokens=tokens,
            readers=readers,
            fit_tokens=fit_tokens,
            install=install,
            size=size,
            min_probs=list(min_probs),
            code=git_state(),
            engine=code_digest(),
            model_digest=model_digest(registry.model_dir(model_id)),  # a retrained model differs
        )
        reps = Repetitions(checkpoint, key, say=say)
    ref, tok, spec = load_reference(model_id)
    E = spec["experts"]
    rows = prompts.load(prompt_set, "eval")[:n_prompts]
    inputs = [tok.encode(p["text"]) for p in rows]
    say(f"reference {model_id} loaded")
    oracle_sets = [trace.record(ref, ids, tokens)["experts"] for ids in inputs]
    decode(ref, inputs[0], 2)  # warm-up
    say(f"oracle traces of {len(inputs)} {prompt_set} prompts recorded")
    engines = {}
    try:
        for S, name, depth, q in configs(E, slots, predictor_names, depths, min_probs):
            c = (S, name, depth, q)
            if name != "mlx-lm":
                t0 = time.perf_counter()
                engines[c] = load(
                    model_id,
                    EngineConfig(
                        slots=S,
                        tier=tier,
                        readers=readers,
                        install=install,
                        predictor=name,
                        depth=max(depth, 1),
                        fit_set=prompt_set,
                        trace_tokens=fit_tokens,
                        predict_size=size,
                        min_prob=q,
                    ),
                )
                engines[c].bind_oracle(oracle_sets[0])
                decode(engines[c].model, inputs[0], min(2, tokens))  # warm-up
                say(f"S={S} {name} d{depth} q{q} loaded and warmed up in {time.perf_counter() - t0:.1f} s")
        models = {(E, "mlx-lm", 0, 0.0): ref, **{c: e.model for c, e in engines.items()}}
        accs = run_interleaved(
            models,
            inputs,
            tokens,
            repeats,
            bind=lambda c, i: c in engines and engines[c].bind_oracle(oracle_sets[i]),
            say=say,
            checkpoint=reps,
        )
        say("decoded")
        resumed = reps.loaded if reps is not None else 0
    finally:
        for eng in engines.values():
            eng.close()
    results = []
    for S, name, depth, q in models:
        eng = engines.get((S, name, depth, q))
        res = dict(
            model=model_id,
            tier=tier,
            prompt_set=prompt_set,
            slots=S,
            experts=E,
            predictor=name,
            depth=depth,
            min_prob=q,
            prompts=len(rows),
            install=None if eng is None else eng.install.name,
            **summarize_repeats(accs[S, name, depth, q]),
            repeats_resumed=resumed,
        )
        # What this configuration would hold running alone: its model (weights not offloaded, slot
        # tables) and the most one decode added (KV cache, activations). Every configuration of the
        # sweep is loaded at once, so the process-wide peak says nothing about any one of them.
        res["model_memory_bytes"] = model_bytes(models[S, name, depth, q])
        res["memory_bytes"] = res["model_memory_bytes"] + (res.get("decode_memory_bytes") or 0)
        results.append(res)
        if progress:
            progress(res)
    if reps is not None:
        reps.clear()
    return results


def quality(model_id, prompt_set, predictor_names, depths, slots, fit_tokens=32, size=None):
    """Offline: precision/recall per predictor and depth on the eval traces, and the hit rate
    each gives in a replay at every S, beside LRU alone and Belady's optimum."""
    ev = trace.load(trace.trace_path(model_id, prompt_set, "eval", fit_tokens))
    size = size or ev.experts.shape[-1]
    out = []
    for S in slots:
        if S >= ev.num_experts:
            continue
        base = dict(model=model_id, prompt_set=prompt_set, slots=S, experts=ev.num_experts)
        out.append(dict(base, predictor="lru", depth=0, **simulate.replay(ev, S)))
        out.append(dict(base, predictor="belady", depth=0, **simulate.belady(ev, S)))
    for name in predictor_names:
        if name == "none":
            continue
        for d in depths:
            pred = get_predictor(model_id, name, d, size, prompt_set, fit_tokens)
            q = predictors.quality(pred, ev)
            for S in slots:
                if S >= ev.num_experts:
                    continue
                r = simulate.replay(ev, S, pred, d)
                out.append(
                    dict(
                        model=model_id,
                        prompt_set=prompt_set,
                        slots=S,
                        experts=ev.num_experts,
                        predictor=name,
                        depth=d,
                        precision=q["precision"],
                        recall=q["recall"],
                        estimate=q["estimate"],
                        used_share=q["used_share"],
                        predictions=q["n"],
                        **r,
                    )
                )
    return out


def sync_ablation(model_id, tier, prompt_set, slots, n_prompts, tokens, installs=("copy",), readers=4, repeats=3):
    """The paper's per-miss synchronisation (one read at a time, the slot table evaluated after
    every miss) against the batched path, demand loading at `slots`, interleaved and repeated."""
    ref, tok, spec = load_reference(model_id)
    rows = prompts.load(prompt_set, "eval")[:n_prompts]
    inputs = [tok.encode(p["text"]) for p in rows]
    variants = [(i, s) for i in installs for s in ("per_miss", "batched")]
    engines = {
        v: load(model_id, EngineConfig(slots=slots, tier=tier, readers=readers, install=v[0], sync=v[1]))
        for v in variants
    }
    try:
        for eng in engines.values():
            decode(eng.model, inputs[0], 2)  # warm-up
        accs = run_interleaved({v: e.model for v, e in engines.items()}, inputs, tokens, repeats)
    finally:
        for eng in engines.values():
            eng.close()
    return [
        dict(
            model=model_id,
            tier=tier,
            prompt_set=prompt_set,
            slots=slots,
            experts=spec["experts"],
            install=i,
            sync=s,
            prompts=len(rows),
            **summarize_repeats(accs[i, s]),
        )
        for i, s in variants
    ]
