"""Gate C (`prefetch_online`): decode throughput, stall, hit rate and prefetch counts across
slots, predictors and depth, on one model, tier and prompt set, with resident mlx-lm as the
ceiling measured in the same run; and the offline quality of every predictor."""

from engine import load
from engine.config import EngineConfig
from engine.models.registry import load_reference
from engine.predict import predictors, prompts, simulate, trace
from engine.predict.fitting import get_predictor
from engine.runtime.loop import decode, totals


def accumulate(acc, records):
    """Add a decode's steps (not its prefill, which is reported apart) to `acc`."""
    for k, v in totals(records).items():
        acc[k] = acc.get(k, 0) + v


def configs(experts, slots, predictor_names, depths):
    """(slots, predictor, depth) to run: the ceiling, S = E, then every S < E."""
    out = [(experts, "mlx-lm", 0), (experts, "none", 0)]
    for s in sorted(s for s in slots if s < experts):
        out.append((s, "none", 0))
        out += [(s, p, d) for p in predictor_names if p != "none" for d in depths]
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
        bytes_read_per_token=acc["bytes_read"] / n,
    )
    total = acc["hits"] + acc["misses"]
    res["hit_rate"] = acc["hits"] / total if total else None
    for k in ("hits", "misses", "issued", "useful", "wasted", "late"):
        res[k] = acc[k]
    if acc["misses"]:
        for k in ("pread", "array", "install", "stall"):
            res[f"per_miss_{k}_ms"] = 1e3 * acc[f"{k}_s"] / acc["misses"]
    return res


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
):
    """One result dict per configuration (see `configs`)."""
    ref, tok, spec = load_reference(model_id)
    E = spec["experts"]
    rows = prompts.load(prompt_set, "eval")[:n_prompts]
    inputs = [tok.encode(p["text"]) for p in rows]
    oracle_sets = [trace.record(ref, ids, tokens)["experts"] for ids in inputs]
    decode(ref, inputs[0], 2)  # warm-up
    results = []
    for S, name, depth in configs(E, slots, predictor_names, depths):
        acc = {}
        eng = None
        if name != "mlx-lm":
            eng = load(
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
                ),
            )
        try:
            model = ref if eng is None else eng.model
            for ids, sets in zip(inputs, oracle_sets):
                if eng is not None:
                    eng.bind_oracle(sets)
                accumulate(acc, decode(model, ids, tokens)[1])
        finally:
            if eng is not None:
                eng.close()
        res = dict(
            model=model_id,
            tier=tier,
            prompt_set=prompt_set,
            slots=S,
            experts=E,
            predictor=name,
            depth=depth,
            prompts=len(rows),
            install=None if eng is None else eng.tables[0].install_mode,
            **summarize(acc),
        )
        results.append(res)
        if progress:
            progress(res)
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


def sync_ablation(model_id, tier, prompt_set, slots, n_prompts, tokens, installs=("copy",), readers=4):
    """The paper's per-miss synchronisation (one read at a time, the slot table evaluated after
    every miss) against the batched path, demand loading at `slots`, interleaved per prompt."""
    ref, tok, spec = load_reference(model_id)
    rows = prompts.load(prompt_set, "eval")[:n_prompts]
    inputs = [tok.encode(p["text"]) for p in rows]
    variants = [(i, s) for i in installs for s in ("per_miss", "batched")]
    engines = {
        v: load(model_id, EngineConfig(slots=slots, tier=tier, readers=readers, install=v[0], sync=v[1]))
        for v in variants
    }
    acc = {v: {} for v in variants}
    try:
        for eng in engines.values():
            decode(eng.model, inputs[0], 2)  # warm-up
        for ids in inputs:
            for v, eng in engines.items():
                accumulate(acc[v], decode(eng.model, ids, tokens)[1])
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
            **summarize(acc[(i, s)]),
        )
        for i, s in variants
    ]
