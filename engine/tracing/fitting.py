"""Fitted predictors, made once: traced, fitted and saved on first use, then reused.

Above the decode path: tracing runs the model (engine.tracing.trace); the runtime only ever
receives a predictor object (engine.api.load asks here for one)."""

import sys
import time

from .. import device
from ..models.embedded import sha256_file
from ..predict import predictors
from . import trace


def fitted_predictor(
    model_id: str,
    name: str,
    depth: int,
    size: int,
    prompt_set: str = "general",
    tokens: int = 32,
    refit: bool = False,
    stamp=None,
):
    """The `name` predictor fitted on `prompt_set`'s fit trace of `tokens` decode tokens per prompt.

    A saved one is reused only if it was fitted on the very trace file there now (its sha256), so
    the workflow's `fit` jobs serve every later reader and a re-recorded trace is never paired
    with a stale fit. Otherwise it is fitted (tracing the fit prompts first if need be) and saved.
    `stamp` makes a new trace's metadata (engine.tracing.trace.run)."""
    tpath = trace.trace_path(model_id, prompt_set, "fit", tokens)
    if not tpath.exists():
        print(f"[titan] tracing {model_id} over the {prompt_set} fit prompts ...", file=sys.stderr, flush=True)
        trace.run(model_id, prompt_set, "fit", tokens, stamp=stamp)
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
    predictors.save(
        pred,
        path,
        dict(
            model=model_id,
            trace=str(tpath),
            trace_sha256=digest,
            device=device.kind(),
            fit_seconds=time.perf_counter() - t0,
            prompts=tr.meta["result"]["prompts"],
        ),
    )
    return pred


def get_predictor(
    model_id: str,
    name: str,
    depth: int,
    size: int,
    prompt_set: str = "general",
    tokens: int = 32,
    min_prob: float = 0.0,
    stamp=None,
):
    """Predictor `name`: the saved fit for a fitted one (see `fitted_predictor`), else a fresh one.
    `min_prob` is a confidence floor on what it predicts, not part of the fit."""
    pred = predictors.make(name, depth, size, min_prob)  # checks the name and min_prob first
    if name in predictors.FITTED:
        pred = fitted_predictor(model_id, name, depth, size, prompt_set, tokens, stamp=stamp)
        pred.min_prob = min_prob
    return pred
