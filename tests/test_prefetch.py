"""Prefetching and predictors: exact logits with every predictor, eviction policy and depth;
predictors that learn what they should; errors that surface; shutdowns that end."""

import json
import sys
import threading

import numpy as np
import pytest
from conftest import HOST_INSTALL, MODELS, ON_GPU, run_with

from engine import EngineConfig, load, max_abs_diff
from engine.models import registry
from engine.models.embedded import sha256_file
from engine.predict import predictors, prompts
from engine.predict.predictors import Context
from engine.runtime import installs
from engine.runtime.loop import decode, time_split
from engine.runtime.prefetch import Prefetcher
from engine.runtime.store import Store, StoreError
from engine.tracing import simulate, trace
from engine.tracing.fitting import fitted_predictor


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("name", list(predictors.NAMES))
def test_qwen_bit_identical_with_every_predictor_and_depth(reference, fit_traces, name, depth):
    ref = reference("qwen3moe-tiny")
    records, logits = run_with("qwen3moe-tiny", ref, name, depth, fit_traces("qwen3moe-tiny"))
    assert max_abs_diff(ref["logits"], logits) == 0.0
    if name in ("oracle", "probe", "transition", "popularity"):
        assert sum(r["issued"] for r in records) > 0  # prefetching really happened


@pytest.mark.parametrize("name", list(predictors.NAMES))
def test_olmoe_bit_identical_with_every_predictor(reference, fit_traces, name):
    ref = reference("olmoe-tiny")
    _, logits = run_with("olmoe-tiny", ref, name, 2, fit_traces("olmoe-tiny"))
    assert max_abs_diff(ref["logits"], logits) == 0.0


@pytest.mark.parametrize("model_id", list(MODELS))
@pytest.mark.parametrize("eviction", ["lru", "lfu", "lru-predicted"])
def test_bit_identical_with_every_eviction_policy(reference, fit_traces, model_id, eviction):
    ref = reference(model_id)
    _, logits = run_with(model_id, ref, "transition", 1, fit_traces(model_id), eviction=eviction)
    assert max_abs_diff(ref["logits"], logits) == 0.0


def test_copy_install_with_prefetch_bit_identical(reference, fit_traces):
    ref = reference("qwen3moe-tiny")
    records, logits = run_with("qwen3moe-tiny", ref, "probe", 1, fit_traces("qwen3moe-tiny"), install="copy")
    assert sum(r["useful"] for r in records) > 0
    assert max_abs_diff(ref["logits"], logits) == 0.0


def test_a_tokens_time_split_names_the_predictors_host_work(reference, fit_traces):
    """The probe reads the MoE input back and predicts on the host at every decode layer: that
    time is its own part of the split (on the H200 it is what a fitted predictor's stall saving
    is weighed against), and demand loading has none."""
    ref = reference("qwen3moe-tiny")
    probe, _ = run_with("qwen3moe-tiny", ref, "probe", 1, fit_traces("qwen3moe-tiny"))
    demand, _ = run_with("qwen3moe-tiny", ref, "none", 1, fit_traces("qwen3moe-tiny"))
    assert probe[0]["predict_s"] == 0.0  # the prefill predicts nothing
    assert all(r["predict_s"] > 0 for r in probe[1:])
    assert all(r["predict_s"] == 0.0 for r in demand)
    split = time_split(probe)
    assert split["predict"] > 0 and split["total"] == pytest.approx(sum(v for k, v in split.items() if k != "total"))


def test_the_probe_scores_each_token_on_the_device_with_the_routers_indices(reference, fit_traces):
    """At every decode layer the probe is handed its scores of the token being decoded, computed
    on the device from that token's MoE input and read back in the synchronisation that brought
    the router's indices (on the H200, reading the MoE input back and scoring it on the host cost
    the probe more than its stall saving). They are the host's scores of the same input to float32
    rounding, and pick the same experts."""
    ref = reference("qwen3moe-tiny")
    pred = predictors.make("probe", 1, 8).fit(fit_traces("qwen3moe-tiny"))
    seen, handed = [], []
    predict = pred.predict
    pred.predict = lambda ctx: seen.append((ctx.position, ctx.layer, ctx.scores, ctx.hidden)) or predict(ctx)

    class Spy(Prefetcher):
        def predict_and_issue(self, layer, experts, scores, cache):
            if cache.rows == 1:
                handed.append(scores)
            return super().predict_and_issue(layer, experts, scores, cache)

    eng = load("qwen3moe-tiny", EngineConfig(slots=32, install=HOST_INSTALL), prefetcher=Spy(pred, 1))
    layers = len(eng.cache.tables)
    try:
        tokens, _, _ = decode(eng.model, ref["ids"], 6)
    finally:
        eng.close()
    model, _, _ = registry.load_reference("qwen3moe-tiny")
    tr = trace.record(model, ref["ids"], 6)
    assert tokens == tr["generated"]
    assert handed and all(isinstance(s, np.ndarray) for s in handed)
    # every token decoded after the prompt, at every layer (the prefill predicts nothing)
    decoded = np.flatnonzero(tr["decode"])
    assert sorted((p, l) for p, l, _, _ in seen) == [(p, l) for p in decoded for l in range(layers)]
    for position, layer, scores, hidden in seen:
        assert hidden is None  # the MoE input itself never comes back
        assert scores.dtype == np.float32 and scores.shape == tr["probs"].shape[-1:]
        # the trace keeps the MoE input as float16, the very values the device scored
        host = pred.scores(layer, tr["hidden"][position, layer])
        np.testing.assert_allclose(scores, host, rtol=1e-5, atol=1e-5)
        assert np.array_equal(predictors._top(scores, 8), predictors._top(host, 8))


def test_oracle_prefetch_leaves_no_demand_miss_after_warmup(reference, fit_traces):
    ref = reference("qwen3moe-tiny")
    records, _ = run_with("qwen3moe-tiny", ref, "oracle", 1, fit_traces("qwen3moe-tiny"), slots=32)
    dec = records[2:]  # past the prefill and the first decode step
    assert sum(r["useful"] for r in dec) > 0
    assert sum(r["wasted"] for r in dec) == 0
    assert sum(r["misses"] for r in dec) == 0


def test_oracle_reaches_recall_one(fit_traces):
    tr = fit_traces("qwen3moe-tiny")
    for depth in (1, 2, 3):
        q = predictors.quality(predictors.make("oracle", depth, 8), tr)
        assert q["recall"] == 1.0 and q["precision"] == 1.0


def planted_trace(seed=0, L=3, E=16, K=2, T=400):
    """Layer l+1's experts are a fixed permutation of layer l's, in every token."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(E)
    experts = np.zeros((T, L, K), np.int16)
    for t in range(T):
        experts[t, 0] = np.sort(rng.choice(E, K, replace=False))
        for l in range(1, L):
            experts[t, l] = np.sort(perm[experts[t, l - 1]])
    z = np.zeros((T, L, 4), np.float16)
    return trace.Trace(
        experts=experts,
        probs=np.zeros((T, L, E), np.float16),
        hidden=z,
        tokens=np.zeros(T, np.int32),
        prompt=np.zeros(T, np.int32),
        decode=np.ones(T, bool),
        meta={},
    ), perm


def test_transition_recovers_a_planted_map():
    tr, perm = planted_trace()
    pred = predictors.make("transition", 1, 2).fit(tr)
    for l in (0, 1):  # pairs within a token (the last layer's pairs wrap to a random next token)
        for e in range(16):
            others = [x for x in range(16) if x != e][:1]
            ctx = Context(0, l, l + 1, 0, np.array([e] + others), None, [None] * 3)
            assert set(pred.predict(ctx).tolist()) == {int(perm[e]), int(perm[others[0]])}


def test_depth_two_composes_the_map():
    tr, perm = planted_trace(seed=1)
    pred = predictors.make("transition", 2, 2).fit(tr)
    ctx = Context(0, 0, 2, 0, np.array([3, 7]), None, [None] * 3)
    assert set(pred.predict(ctx).tolist()) == {int(perm[perm[3]]), int(perm[perm[7]])}


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_probe_learns_a_linear_rule(backend):
    """Hidden states that encode the next layer's experts linearly are read back by the probe,
    fitted in NumPy (the CPU's default) or in MLX (a GPU's)."""
    rng = np.random.default_rng(0)
    T, L, E, K, D = 600, 2, 8, 2, 16
    hidden = rng.normal(size=(T, L, D)).astype(np.float16)
    proj = rng.normal(size=(D, E))
    experts = np.zeros((T, L, K), np.int16)
    for t in range(T):
        for l in range(L):
            src = hidden[t, l - 1] if l else rng.normal(size=D)
            experts[t, l] = np.sort(np.argsort(-(src.astype(float) @ proj))[:K])
    tr = trace.Trace(
        experts=experts,
        probs=np.zeros((T, L, E), np.float16),
        hidden=hidden,
        tokens=np.zeros(T, np.int32),
        prompt=np.zeros(T, np.int32),
        decode=np.ones(T, bool),
        meta={},
    )
    pred = predictors.make("probe", 1, K)
    pred.backend = backend
    pred.fit(tr)
    ctxs = [(c, a) for _, c, a in predictors.contexts(tr, 1) if c.layer == 0]
    recall = np.mean([len(set(pred.predict(c).tolist()) & set(a.tolist())) / K for c, a in ctxs])
    assert recall > 0.9


def test_logistic_backends_agree():
    """The MLX fit a GPU runs is the NumPy fit up to float32 rounding (to 1e-4 on the CPU; to 1e-3
    on a CUDA GPU, whose float32 matrix products round differently: beyond 1e-4 on the H200)."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 32)).astype(np.float32)
    Y = (rng.random((200, 8)) < 0.25).astype(np.float32)
    (Wn, bn), (Wm, bm) = (predictors._logistic(X, Y, 50, 0.05, 1e-4, b) for b in ("numpy", "mlx"))
    assert np.abs(Wn).max() > 0.1
    tol = 1e-3 if ON_GPU else 1e-4
    assert np.allclose(Wn, Wm, atol=tol) and np.allclose(bn, bm, atol=tol)
    with pytest.raises(ValueError, match="backend"):
        predictors._logistic(X, Y, 1, 0.05, 1e-4, "torch")


def test_fitted_state_round_trips(tmp_path, fit_traces):
    tr = fit_traces("qwen3moe-tiny")
    for name in predictors.FITTED:
        pred = predictors.make(name, 2, 8).fit(tr)
        predictors.save(pred, tmp_path / f"{name}.npz", {"model": "qwen3moe-tiny"})
        back = predictors.load(tmp_path / f"{name}.npz")
        assert (back.name, back.depth, back.size) == (name, 2, 8)
        assert predictors.quality(back, tr) == predictors.quality(pred, tr)


def test_a_saved_fit_is_reused_only_for_the_trace_it_was_fitted_on(tmp_path, fit_traces, monkeypatch):
    """The workflow's `fit` jobs serve every later reader; a re-recorded trace is fitted again."""
    monkeypatch.setattr(registry, "resources_dir", lambda: tmp_path)
    tr = fit_traces("qwen3moe-tiny")
    tpath = trace.trace_path("qwen3moe-tiny", "code", "fit", 8)

    def record(rows):
        tpath.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            tpath, **{k: getattr(tr, k)[rows] for k in ("experts", "probs", "hidden", "tokens", "prompt", "decode")}
        )
        tpath.with_suffix(".json").write_text(json.dumps({"model": "qwen3moe-tiny", "result": {"prompts": ["p"]}}))

    record(slice(None))
    first = fitted_predictor("qwen3moe-tiny", "transition", 1, 8, "code", 8)
    saved = predictors.fitted_path("qwen3moe-tiny", "code", "transition", 1, 8, 8)
    assert predictors.load(saved).meta["trace_sha256"] == sha256_file(tpath)

    def refuse(self, trace):
        raise AssertionError("fitted again")

    with monkeypatch.context() as m:
        m.setattr(predictors.Transition, "fit", refuse)
        again = fitted_predictor("qwen3moe-tiny", "transition", 1, 8, "code", 8)
    assert np.array_equal(again.counts, first.counts)

    record(slice(0, len(tr.tokens) // 2))  # the same file name, other tokens
    refit = fitted_predictor("qwen3moe-tiny", "transition", 1, 8, "code", 8)
    assert refit.counts.sum() < first.counts.sum()
    assert predictors.load(saved).meta["trace_sha256"] == sha256_file(tpath)


def test_a_saved_fit_of_an_older_format_is_fitted_again(tmp_path, fit_traces, monkeypatch):
    """A fit saved before its state gained a field (format 1 had no top_k) is never misread."""
    monkeypatch.setattr(registry, "resources_dir", lambda: tmp_path)
    tr = fit_traces("qwen3moe-tiny")
    tpath = trace.trace_path("qwen3moe-tiny", "code", "fit", 8)
    tpath.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        tpath, **{k: getattr(tr, k) for k in ("experts", "probs", "hidden", "tokens", "prompt", "decode")}
    )
    tpath.with_suffix(".json").write_text(json.dumps({"model": "qwen3moe-tiny", "result": {"prompts": ["p"]}}))
    first = fitted_predictor("qwen3moe-tiny", "popularity", 1, 8, "code", 8)
    saved = predictors.fitted_path("qwen3moe-tiny", "code", "popularity", 1, 8, 8)
    np.savez_compressed(saved, counts=first.counts)  # as format 1 wrote it
    meta = predictors.sidecar(saved)
    meta.pop("format")
    saved.with_suffix(".json").write_text(json.dumps(meta))
    again = fitted_predictor("qwen3moe-tiny", "popularity", 1, 8, "code", 8)
    assert again.top_k == tr.experts.shape[-1]
    assert predictors.sidecar(saved)["format"] == predictors.FORMAT
    assert "top_k" in np.load(saved).files


@pytest.mark.parametrize("name", predictors.FITTED)
def test_a_confidence_floor_keeps_only_the_sure_part_of_a_prediction(fit_traces, name):
    """`min_prob` q predicts the experts of the plain top-k prediction whose estimated probability
    reaches q, in the same order: q = 0 is the plain prediction, and a higher floor predicts less."""
    tr = fit_traces("qwen3moe-tiny")
    K = tr.experts.shape[-1]
    plain = predictors.make(name, 1, K).fit(tr)
    floors = {q: predictors.make(name, 1, K, min_prob=q) for q in (0.0, 0.3, 0.6, 1.0)}
    for pred in floors.values():
        pred.load_state(plain.state())
    sizes = {q: 0 for q in floors}
    for _, ctx, _ in predictors.contexts(tr, 1):
        prob, top = plain.prob(ctx), plain.predict(ctx)
        assert prob.min() >= 0 and prob.max() <= 1 + 1e-9
        if name != "probe":  # counted shares: every token used top_k experts
            assert prob.sum() == pytest.approx(K)
        for q, pred in floors.items():
            got = pred.predict(ctx)
            assert got.tolist() == [e for e in top.tolist() if prob[e] >= q]
            sizes[q] += len(got)
    assert sizes[0.0] > sizes[0.3] >= sizes[0.6] >= sizes[1.0]


def test_quality_reports_how_sure_a_predictor_was_beside_how_right():
    """`estimate` (the mean probability a predictor gave what it predicted) equals `used_share` for
    a calibrated one: popularity scored on the very trace it counted. The oracle estimates nothing."""
    rng = np.random.default_rng(2)
    T, L, E, K = 400, 2, 8, 2
    experts = np.sort(
        np.stack([rng.choice(E, K, replace=False, p=np.arange(1, E + 1) / 36) for _ in range(T * L)]).reshape(T, L, K),
        axis=-1,
    ).astype(np.int16)
    tr = trace.Trace(
        experts=experts,
        probs=np.zeros((T, L, E), np.float16),
        hidden=np.zeros((T, L, 4), np.float16),
        tokens=np.zeros(T, np.int32),
        prompt=np.zeros(T, np.int32),
        decode=np.ones(T, bool),
        meta={},
    )
    q = predictors.quality(predictors.make("popularity", 1, K).fit(tr), tr)
    assert 0.2 < q["used_share"] < 1
    assert q["estimate"] == pytest.approx(q["used_share"], abs=0.01)
    assert predictors.quality(predictors.make("oracle", 1, K).bind(experts), tr)["estimate"] is None


def test_a_confidence_floor_is_checked():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        predictors.make("probe", 1, 8, min_prob=1.5)
    with pytest.raises(ValueError, match="fitted predictors"):
        predictors.make("oracle", 1, 8, min_prob=0.5)


def test_bit_identical_with_a_confidence_floor(reference, fit_traces):
    """Prefetching fewer experts changes what is resident, never the logits."""
    ref = reference("qwen3moe-tiny")
    spec = MODELS["qwen3moe-tiny"]
    issued = {}
    for q in (0.0, 0.2):
        pred = predictors.make("transition", 1, spec["top_k"], min_prob=q).fit(fit_traces("qwen3moe-tiny"))
        eng = load("qwen3moe-tiny", EngineConfig(slots=spec["experts"] // 4), prefetcher=Prefetcher(pred, 1))
        try:
            _, records, logits = decode(
                eng.model, ref["ids"], len(ref["tokens"]) - 1, forced=ref["tokens"], keep_logits=True
            )
        finally:
            eng.close()
        issued[q] = sum(r["issued"] for r in records)
        assert max_abs_diff(logits, ref["logits"]) == 0.0
    assert 0 < issued[0.2] < issued[0.0]


def test_fit_and_eval_prompts_are_disjoint():
    for name in prompts.SETS:
        fit, ev = prompts.load(name, "fit"), prompts.load(name, "eval")
        assert fit and ev
        assert not {p["text"] for p in fit} & {p["text"] for p in ev}
        assert not {p["source"] for p in fit} & {p["source"] for p in ev}
        assert not {p["id"] for p in fit} & {p["id"] for p in ev}


def test_the_shipped_prompt_sets_are_what_the_corpus_makes(tmp_path):
    """engine/data/prompts/*.jsonl are made from engine.predict.corpus (prompts.write): made
    again here, byte for byte (a change to the corpus or the cutting shows as a changed file),
    on the Python that made them; another Python (the GPU machine's 3.12) is refused by name, and
    nothing is written."""
    if sys.version_info[:2] != prompts.MADE_WITH:
        with pytest.raises(ValueError, match=r"cut from Python 3\.11's standard library"):
            prompts.write(tmp_path)
        assert not list(tmp_path.iterdir())
        return
    prompts.write(tmp_path)
    for name in prompts.SETS:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (prompts.PROMPT_DIR / f"{name}.jsonl").read_bytes()


def test_replay_bounds(fit_traces):
    """Belady bounds LRU from above; the oracle's prefetching beats demand loading."""
    tr = fit_traces("qwen3moe-tiny")
    lru = simulate.replay(tr, 32)["hit_rate"]
    opt = simulate.belady(tr, 32)["hit_rate"]
    oracle = simulate.replay(tr, 32, predictors.make("oracle", 1, 8), 1)["hit_rate"]
    assert lru <= opt and oracle > opt


def test_reader_error_reaches_the_decode_thread(reference, fit_traces, monkeypatch):
    real = Store.read_into

    def failing(self, layer, expert, dests):
        if threading.current_thread().name.startswith("titan-reader") and layer == 1 and expert % 2:
            raise StoreError(f"injected read failure: layer {layer} expert {expert}")
        return real(self, layer, expert, dests)

    monkeypatch.setattr(Store, "read_into", failing)
    ref = reference("qwen3moe-tiny")
    with pytest.raises(StoreError, match="injected read failure"):
        run_with("qwen3moe-tiny", ref, "oracle", 1, fit_traces("qwen3moe-tiny"))


@pytest.mark.timeout(60)
def test_shutdown_with_reads_in_flight_does_not_hang(fit_traces):
    tr = fit_traces("qwen3moe-tiny")
    eng = load(
        "qwen3moe-tiny",
        EngineConfig(slots=32, readers=1, install=HOST_INSTALL),  # the host prefetcher's reads
        prefetcher=Prefetcher(predictors.make("popularity", 1, 16).fit(tr), 1),
    )
    cache = eng.cache
    cache.begin_step(0, 1)
    for layer in range(len(eng.cache.tables)):  # issue without ever draining
        cache.prefetcher.issue(layer, np.arange(16), cache)
    assert sum(len(f) for f in cache.prefetcher.inflight.values()) > 0
    eng.close()
    assert not cache.prefetcher.inflight


@pytest.mark.parametrize("slots", [8, 12])
def test_depth_wrapping_onto_its_own_layer_is_exact(reference, fit_traces, slots):
    """qwen3moe-tiny has 3 MoE layers, so depth 3 prefetches into the very table the current
    layer is about to compute from (next token's). Such a prefetch must not evict what this
    layer uses, and this layer's demand reads must not take a slot a prefetch is writing."""
    ref = reference("qwen3moe-tiny")
    for _ in range(3):  # a race, when there is one, does not lose every time
        records, logits = run_with("qwen3moe-tiny", ref, "oracle", 3, fit_traces("qwen3moe-tiny"), slots=slots)
        assert max_abs_diff(ref["logits"], logits) == 0.0
    issued = sum(r["issued"] for r in records)
    # with S = top_k every slot holds an expert this layer uses: an install that claims its slot
    # before it reads (inplace) has no room to prefetch into; one that reads into staging first
    # (pinned, which inplace is on a GPU) issues its reads, and they find no slot
    claims_first = installs.choose("inplace", 1).claims_first
    assert issued == 0 if slots == MODELS["qwen3moe-tiny"]["top_k"] and claims_first else issued > 0
