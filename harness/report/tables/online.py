"""Gate C: online prefetching (throughput, stalls, the miss breakdown) and predictor quality."""

import pandas as pd

from .common import MACHINE, latest, machine_cols


def online_rows(recs):
    rows = []
    for r in recs:
        res = r["result"]
        # Runs before confidence floors existed ran without one: min_prob 0. Runs before records
        # named their install path ran the default of their day: inplace on a CPU, the paper's copy
        # path on a GPU (engine/device.py before the pinned path); mlx-lm's own rows have none.
        if res.get("install") is None and res.get("predictor") != "mlx-lm":
            res = dict(res, install="copy" if r["device"] == "gpu" else "inplace")
        rows.append(
            dict(
                **machine_cols(r),
                **{"min_prob": 0.0, **res},
                started_utc=r["started_utc"],
                run_id=r["run_id"],
            )
        )
    return rows


ONLINE_KEYS = MACHINE + ["model", "tier", "prompt_set", "slots", "predictor", "depth", "min_prob", "install"]


def prefetch_table(recs):
    df = latest(online_rows(recs), ONLINE_KEYS)
    cols = ONLINE_KEYS + [
        "experts",
        "tok_s",
        "tok_s_min",
        "tok_s_max",
        "stall_ms_per_token",
        "stall_ms_per_token_min",
        "stall_ms_per_token_max",
        "late_stall_ms_per_token",
        "sync_ms_per_token",
        "predict_ms_per_token",
        "hit_rate",
        "issued",
        "useful",
        "wasted",
        "late",
        "tokens",
        "model_memory_bytes",
        "decode_memory_bytes",
        "memory_bytes",
        "repeats",
        "runs",
        "commit",
    ]
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)


def miss_table(recs):
    full = latest(online_rows(recs), ONLINE_KEYS)
    keep = MACHINE + ["model", "tier", "prompt_set", "slots", "install"]
    split = ["per_miss_pread_ms", "per_miss_array_ms", "per_miss_install_ms", "per_miss_stall_ms"]
    cols = keep + [f"{c}{x}" for c in split for x in ("", "_min", "_max")] + ["misses", "repeats"]
    if full.empty:
        return pd.DataFrame(columns=cols)
    full = full[(full["predictor"] == "none") & (full["slots"] < full["experts"])]
    return full.reindex(columns=cols).reset_index(drop=True)


def quality_table(recs):
    keys = MACHINE + ["model", "prompt_set", "slots", "predictor", "depth"]
    # estimate: the predictor's own mean probability for what it predicted, beside used_share (the
    # share of those used): equal when it is calibrated, what a confidence floor relies on.
    cols = keys + ["precision", "recall", "estimate", "used_share", "hit_rate", "issued", "useful", "runs", "commit"]
    df = latest(online_rows(recs), keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)
