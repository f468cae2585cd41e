"""Routing statistics of the models, and the training runs that taught the trained ones to route."""

import pandas as pd

from .common import latest, machine_cols


def routing_table(recs):
    keys = ["model", "kind", "layer", "prompt_set", "predictor", "depth"]
    cols = keys + [
        "entropy",
        "top10_share",
        "unused",
        "js_code_general_bits",
        "specialised_share",
        "precision",
        "recall",
        "chance",
        "runs",
        "commit",
    ]
    rows = []
    for r in recs:
        row = dict.fromkeys(keys)
        row.update(r["result"], started_utc=r["started_utc"], run_id=r["run_id"])
        rows.append(row)
    df = latest(rows, keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)


def train_table(recs):
    """Every trained model's latest training run, step by step."""
    cols = ["model", "device", "chip", "step", "loss", "cross_entropy", "seconds", "run_id"]
    if not recs:
        return pd.DataFrame(columns=cols)
    last = {}
    for r in recs:
        m = r["config"]["model"]
        if m not in last or (r["started_utc"], r["run_id"]) > last[m]:
            last[m] = (r["started_utc"], r["run_id"])
    rows = [
        dict(model=r["config"]["model"], **machine_cols(r), run_id=r["run_id"], **r["result"])
        for r in recs
        if r["run_id"] == last[r["config"]["model"]][1]
    ]
    return pd.DataFrame(rows).sort_values(["model", "step"]).reindex(columns=cols).reset_index(drop=True)
