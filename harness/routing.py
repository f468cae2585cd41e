"""Routing statistics from traces: how skewed expert popularity is per layer, how predictable
a layer's experts are from earlier layers, and how differently code and prose route."""

import numpy as np

from engine.predict import predictors
from engine.tracing import trace
from engine.tracing.fitting import fitted_predictor


def _js_bits(p, q):
    m = (p + q) / 2

    def kl(a, b):
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / b[nz])))

    return (kl(p, m) + kl(q, m)) / 2


def stats(model_id: str, tokens: int = 32, size: int = 8, depths=(1, 2, 3)) -> list:
    traces = {
        (ps, sp): trace.load(trace.trace_path(model_id, ps, sp, tokens))
        for ps in ("general", "code")
        for sp in ("fit", "eval")
    }
    L, E = traces["general", "fit"].num_layers, traces["general", "fit"].num_experts
    top = max(1, int(np.ceil(0.1 * E)))
    out = []
    for l in range(L):
        counts = {
            ps: sum(
                np.bincount(traces[ps, sp].experts[:, l].reshape(-1).astype(np.int64), minlength=E)
                for sp in ("fit", "eval")
            )
            for ps in ("general", "code")
        }
        total = counts["general"] + counts["code"]
        p = total / total.sum()
        nz = p > 0
        pg, pc = counts["general"] / counts["general"].sum(), counts["code"] / counts["code"].sum()
        used = (pg > 0) | (pc > 0)
        ratio = (pg[used] + 1e-12) / (pc[used] + 1e-12)
        out.append(
            dict(
                kind="layer",
                model=model_id,
                layer=l,
                experts=E,
                entropy=float(-(p[nz] * np.log(p[nz])).sum() / np.log(E)),
                top10_share=float(np.sort(p)[::-1][:top].sum()),
                unused=int((total == 0).sum()),
                js_code_general_bits=_js_bits(pg, pc),
                specialised_share=float(((ratio > 2) | (ratio < 0.5)).mean()),
            )
        )
    for ps in ("general", "code"):
        for name in ("transition", "probe"):
            for d in depths:
                pred = fitted_predictor(model_id, name, d, size, ps, tokens)
                q = predictors.quality(pred, traces[ps, "eval"])
                out.append(
                    dict(
                        kind="predictability",
                        model=model_id,
                        prompt_set=ps,
                        predictor=name,
                        depth=d,
                        precision=q["precision"],
                        recall=q["recall"],
                        chance=size / E,
                    )
                )
    return out
