"""The ablations: the paper's per-miss sync against batched reads, and the wire formats between nodes."""

import pandas as pd

from .common import MACHINE, latest
from .online import online_rows


def sync_table(recs):
    keys = MACHINE + ["model", "tier", "prompt_set", "slots", "install", "sync"]
    cols = keys + [
        "tok_s",
        "tok_s_min",
        "tok_s_max",
        "stall_ms_per_token",
        "stall_ms_per_token_min",
        "stall_ms_per_token_max",
        "per_miss_stall_ms",
        "per_miss_array_ms",
        "per_miss_install_ms",
        "misses",
        "tokens",
        "repeats",
        "runs",
        "commit",
    ]
    df = latest(online_rows(recs), keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)


def wire_table(recs):
    keys = MACHINE + ["model", "nodes", "wire"]
    cols = keys + ["dtype", "wire_dtype", "max_abs_logit_diff", "tokens", "remote_share", "runs", "commit"]
    df = latest(online_rows(recs), keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)
