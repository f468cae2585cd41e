"""Aggregation: every raw file under a raw root -> CSV and Markdown tables.

Byte-identical for the same raw logs: records are sorted, numbers formatted to fixed
precision. For every configuration and machine the latest run is tabled (`runs` counts them
all). A malformed raw line stops everything with its file and line number.
"""

from pathlib import Path

import pandas as pd

from engine import rawlog

# The paper's own figures, quoted from shared/seeds/004_f9dda6381342b645.txt (implementation
# section): for comparison beside what this harness measures, never used as a result.
PAPER = {
    ("slot_write", "inplace", 64): 0.305,
    ("kernel", "loop_quantized_matmul", None): 0.43,
    ("kernel", "gather_qmm", None): 0.26,
    ("kernel", "restack_gather_qmm", None): 0.50,
    ("parity", "unfused", None): 0.0195,
    ("parity", "compiled_swiglu", None): 0.0,
}

MACHINE = ["device", "chip", "host"]


def machine_cols(rec):
    chip = rec.get("gpu") if rec.get("device") == "gpu" and rec.get("gpu") else rec["chip"]
    return dict(device=rec["device"], chip=chip, host=rec["host"])


def latest(rows, keys):
    """One row per key: the latest run (by start time, then run id), with the run count."""
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df = df.sort_values(keys + ["started_utc", "run_id"], kind="mergesort")
    counts = df.groupby(keys, dropna=False, sort=True).size().rename("runs")
    df = df.groupby(keys, dropna=False, sort=True).tail(1).set_index(keys)
    df = df.join(counts).reset_index()
    return df.sort_values(keys, kind="mergesort").reset_index(drop=True)


def design_table(recs):
    rows = []
    for r in recs:
        res = r["result"]
        variant = res.get("install") or res.get("variant")
        slots = res.get("slots")
        paper = PAPER.get((res["measure"], variant, slots if res["measure"] == "slot_write" else None))
        value = res["max_abs_logit_diff"] if res["measure"] == "parity" else res["ms"]
        rows.append(dict(**machine_cols(r), measure=res["measure"], variant=variant,
                         slots=slots, model=res.get("model"), dtype=r["config"].get("dtype") if res["measure"] != "parity" else res.get("dtype"),
                         value=value, unit="max|dlogit|" if res["measure"] == "parity" else "ms",
                         paper=paper, started_utc=r["started_utc"], run_id=r["run_id"]))
    return latest(rows, MACHINE + ["measure", "variant", "slots", "model"])


def online_rows(recs):
    rows = []
    for r in recs:
        res = r["result"]
        rows.append(dict(**machine_cols(r), **{k: v for k, v in res.items()}, started_utc=r["started_utc"],
                         run_id=r["run_id"]))
    return rows


ONLINE_KEYS = MACHINE + ["model", "tier", "prompt_set", "slots", "predictor", "depth"]


def prefetch_table(recs):
    df = latest(online_rows(recs), ONLINE_KEYS)
    cols = ONLINE_KEYS + ["experts", "tok_s", "stall_ms_per_token", "late_stall_ms_per_token", "hit_rate",
                          "issued", "useful", "wasted", "late", "tokens", "runs"]
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)


def miss_table(recs):
    df = prefetch_table(recs)
    keep = MACHINE + ["model", "tier", "prompt_set", "slots"]
    cols = keep + ["per_miss_pread_ms", "per_miss_array_ms", "per_miss_install_ms", "per_miss_stall_ms", "misses"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    full = latest(online_rows(recs), ONLINE_KEYS)
    full = full[(full["predictor"] == "none") & (full["slots"] < full["experts"])]
    return full.reindex(columns=cols).reset_index(drop=True)


def quality_table(recs):
    keys = MACHINE + ["model", "prompt_set", "slots", "predictor", "depth"]
    cols = keys + ["precision", "recall", "hit_rate", "issued", "useful", "runs"]
    df = latest(online_rows(recs), keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)


def routing_table(recs):
    keys = ["model", "kind", "layer", "prompt_set", "predictor", "depth"]
    cols = keys + ["entropy", "top10_share", "unused", "js_code_general_bits", "specialised_share",
                   "precision", "recall", "chance", "runs"]
    rows = []
    for r in recs:
        row = dict.fromkeys(keys)
        row.update(r["result"], started_utc=r["started_utc"], run_id=r["run_id"])
        rows.append(row)
    df = latest(rows, keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)


def train_table(recs):
    cols = ["model", "step", "loss", "cross_entropy", "seconds", "run_id"]
    if not recs:
        return pd.DataFrame(columns=cols)
    last = max(recs, key=lambda r: (r["started_utc"], r["run_id"]))["run_id"]
    rows = [dict(model=r["config"]["model"], run_id=r["run_id"], **r["result"]) for r in recs if r["run_id"] == last]
    return pd.DataFrame(rows).sort_values("step").reindex(columns=cols).reset_index(drop=True)


def placement_sim_table(recs):
    keys = ["model", "nodes", "link", "capacity_share", "strategy"]
    cols = keys + ["expected", "replayed", "shifted", "remote_share", "ssd_share", "moves", "ssd", "hot", "runs"]
    rows = [dict(**r["result"], started_utc=r["started_utc"], run_id=r["run_id"]) for r in recs]
    df = latest(rows, keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)


def multinode_table(recs):
    """Measured runs, with the simulated ranking beside the measured one per node count."""
    keys = MACHINE + ["model", "kind", "nodes", "strategy"]
    cols = keys + ["expected", "ms_per_token", "expected_rank", "measured_rank", "max_abs_logit_diff",
                   "bytes_per_token", "rtt_ms_median", "bare_rtt_ms_median", "rtt_vs_bare", "remote_share", "wire",
                   "runs"]
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
    meas["bare_rtt_ms_median"] = [bare.get(tuple(r[k] for k in MACHINE + ["model", "nodes"])) for _, r in meas.iterrows()]
    meas["rtt_vs_bare"] = meas["rtt_ms_median"] / meas["bare_rtt_ms_median"]
    grp = meas.groupby(MACHINE + ["model", "nodes"])
    meas["expected_rank"] = grp["expected"].rank(method="min")
    meas["measured_rank"] = grp["ms_per_token"].rank(method="min")
    return meas.reindex(columns=cols).sort_values(keys, kind="mergesort").reset_index(drop=True)


def _fmt(v):
    if v is None or (isinstance(v, float) and v != v):
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def write(df: pd.DataFrame, out_csv: Path, out_md: Path):
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    cells = [[_fmt(v) for v in row] for row in df.itertuples(index=False)]
    cols = [str(c) for c in df.columns]
    with open(out_csv, "w") as f:
        f.write(",".join(cols) + "\n")
        for row in cells:
            f.write(",".join('"' + c + '"' if "," in c else c for c in row) + "\n")
    with open(out_md, "w") as f:
        f.write("| " + " | ".join(cols) + " |\n")
        f.write("|" + "---|" * len(cols) + "\n")
        for row in cells:
            f.write("| " + " | ".join(row) + " |\n")


def build(raw_root, figdir):
    """Read every raw file under `raw_root` and write every table into `figdir`/tables."""
    raw_root, figdir = Path(raw_root), Path(figdir)
    recs = rawlog.read([raw_root]) if raw_root.exists() else []

    def of(gate, experiment):
        return [r for r in recs if r["gate"] == gate and r["experiment"] == experiment]

    tables = {
        "design": design_table(of("B", "design")),
        "prefetch_online": prefetch_table(of("C", "prefetch_online")),
        "miss_breakdown": miss_table(of("C", "prefetch_online")),
        "predictor_quality": quality_table(of("C", "predictor_quality")),
        "routing": routing_table(of("C", "routing")),
        "train_loss": train_table(of("train", "olmoe_trained")),
        "placement_sim": placement_sim_table(of("F", "placement_sim")),
        "multinode": multinode_table(of("F", "multinode")),
    }
    for name, df in tables.items():
        if df.empty and not len(df.columns):
            df = pd.DataFrame(columns=["empty"])
        write(df, figdir / "tables" / f"{name}.csv", figdir / "tables" / f"{name}.md")
    return tables
