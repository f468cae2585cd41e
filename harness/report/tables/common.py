"""What every table shares: the machine columns and the pooling of runs (`latest`)."""

import statistics

import pandas as pd

MACHINE = ["device", "chip", "host"]


def machine_cols(rec):
    chip = rec.get("gpu") if rec.get("device") == "gpu" and rec.get("gpu") else rec["chip"]
    return dict(device=rec["device"], chip=chip, host=rec["host"], commit=(rec.get("commit") or "")[:12])


def latest(rows, keys):
    """One row per key, from the latest run (by start time, then run id) and every other run of
    its commit on that key, pooled: a figure with a spread (`X` beside `X_min` and `X_max`) takes
    the median of the runs' figures and the widest range, so that a verdict rests on every run of
    the code it is about; `runs` says how many, `commit` which code. Runs of older commits are
    history, not evidence about this one: they are left out."""
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    if "commit" not in df.columns:
        df["commit"] = ""
    df["commit"] = df["commit"].fillna("")
    df = df.sort_values(keys + ["started_utc", "run_id"], kind="mergesort")
    spread = [c for c in df.columns if f"{c}_min" in df.columns and f"{c}_max" in df.columns]
    last = df.groupby(keys, dropna=False, sort=True).tail(1)
    same = df.merge(last[keys + ["commit"]], on=keys + ["commit"], how="inner")  # the latest commit's runs
    g = same.groupby(keys, dropna=False, sort=True)
    out = last.set_index(keys)
    out = out.join(g.size().rename("runs"))
    for c in spread:
        pooled = g.agg(**{c: (c, "median"), f"{c}_min": (f"{c}_min", "min"), f"{c}_max": (f"{c}_max", "max")})
        multi = out["runs"] > 1  # one run keeps its own figures exactly
        for col in pooled.columns:
            out.loc[multi, col] = pooled.loc[out.index[multi], col].to_numpy()
    return out.reset_index().sort_values(keys, kind="mergesort").reset_index(drop=True)


def res_get(rec, key):
    return rec["result"].get(key)


def paired(runs: list, against: list) -> dict:
    """Run i's ratio to run i of `against` (decoded beside it, interleaved), as median, min and max:
    a machine that drifts between runs moves both sides of each ratio."""
    ratios = sorted(x / y for x, y in zip(runs, against))
    return dict(median=statistics.median(ratios), min=ratios[0], max=ratios[-1])
