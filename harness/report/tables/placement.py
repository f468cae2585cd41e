"""Gate F: expert placement across nodes, simulated and measured."""

import pandas as pd

from .common import MACHINE, latest, machine_cols


def placement_sim_table(recs):
    keys = ["model", "nodes", "link", "capacity_share", "strategy"]
    cols = keys + ["expected", "replayed", "shifted", "remote_share", "ssd_share", "moves", "ssd", "hot", "runs"]
    rows = [dict(**r["result"], started_utc=r["started_utc"], run_id=r["run_id"]) for r in recs]
    df = latest(rows, keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)


def multinode_table(recs):
    """Measured runs, with the simulated ranking beside the measured one per node count."""
    keys = MACHINE + ["model", "kind", "nodes", "strategy"]
    cols = keys + [
        "expected",
        "ms_per_token",
        "expected_rank",
        "measured_rank",
        "max_abs_logit_diff",
        "bytes_per_token",
        "rtt_ms_median",
        "bare_rtt_ms_median",
        "rtt_vs_bare",
        "remote_share",
        "wire",
        "moves",
        "replacements",
        "runs",
        "commit",
    ]
    rows = []
    for r in recs:
        row = dict.fromkeys(["strategy"])
        row.update(**machine_cols(r), **r["result"], started_utc=r["started_utc"], run_id=r["run_id"])
        rows.append(row)
    df = latest(rows, keys)
    if df.empty:
        return pd.DataFrame(columns=cols)
    bare = df[df["kind"] == "bare_exchange"].set_index(MACHINE + ["model", "nodes"])["rtt_ms_median"]
    meas = df[df["kind"] == "measured"].copy()
    meas["bare_rtt_ms_median"] = [
        bare.get(tuple(r[k] for k in MACHINE + ["model", "nodes"])) for _, r in meas.iterrows()
    ]
    meas["rtt_vs_bare"] = meas["rtt_ms_median"] / meas["bare_rtt_ms_median"]
    grp = meas.groupby(MACHINE + ["model", "nodes"])
    meas["expected_rank"] = grp["expected"].rank(method="min")
    meas["measured_rank"] = grp["ms_per_token"].rank(method="min")
    return meas.reindex(columns=cols).sort_values(keys, kind="mergesort").reset_index(drop=True)
