"""Aggregation: every raw file under a raw root -> CSV and Markdown tables.

Byte-identical for the same raw logs: records are sorted, numbers formatted to fixed
precision. For every configuration and machine, the runs of the latest commit are tabled, pooled
(`latest`: `runs` counts them, `commit` names the code). The paper's claims against these tables
are claims.py's. A malformed raw line stops everything with its file and line number.
"""

import statistics
from pathlib import Path

import pandas as pd

from harness import rawlog

from .claims import claims_table, write_claims

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


def design_table(recs):
    rows = []
    for r in recs:
        res = r["result"]
        variant = res.get("install") or res.get("variant")
        slots = res.get("slots")
        paper = PAPER.get((res["measure"], variant, slots if res["measure"] == "slot_write" else None))
        parity = res["measure"] == "parity"
        value = res["max_abs_logit_diff"] if parity else res["ms"]
        rows.append(
            dict(
                **machine_cols(r),
                measure=res["measure"],
                variant=variant,
                slots=slots,
                model=res.get("model"),
                dtype=r["config"].get("dtype") if res["measure"] != "parity" else res.get("dtype"),
                value=value,
                value_min=None if parity else res.get("ms_min"),
                value_max=None if parity else res.get("ms_max"),
                unit="max|dlogit|" if parity else "ms",
                paper=paper,
                started_utc=r["started_utc"],
                run_id=r["run_id"],
            )
        )
    return latest(rows, MACHINE + ["measure", "variant", "slots", "model"])


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
    df = prefetch_table(recs)
    keep = MACHINE + ["model", "tier", "prompt_set", "slots", "install"]
    split = ["per_miss_pread_ms", "per_miss_array_ms", "per_miss_install_ms", "per_miss_stall_ms"]
    cols = keep + [f"{c}{x}" for c in split for x in ("", "_min", "_max")] + ["misses", "repeats"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    full = latest(online_rows(recs), ONLINE_KEYS)
    full = full[(full["predictor"] == "none") & (full["slots"] < full["experts"])]
    return full.reindex(columns=cols).reset_index(drop=True)


def quality_table(recs):
    keys = MACHINE + ["model", "prompt_set", "slots", "predictor", "depth"]
    # estimate: the predictor's own mean probability for what it predicted, beside used_share (the
    # share of those used): equal when it is calibrated, what a confidence floor relies on.
    cols = keys + ["precision", "recall", "estimate", "used_share", "hit_rate", "issued", "useful", "runs", "commit"]
    df = latest(online_rows(recs), keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)


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


def throughput_key(rec):
    """A `bench throughput` configuration's name with its install path: a run of one install named
    its offloaded configurations `S=16`, and runs of different days' defaults must not share a
    row. Records from before they named it ran the default of their day (as in online_rows)."""
    installs = rec["result"].get("install") or {}
    default = "copy" if rec["device"] == "gpu" else "inplace"
    # decoded through mlx-lm's own generate_step (`--loop mlx-lm`): another row than the engine's loop
    loop = "@mlx-lm" if rec["result"].get("loop") == "mlx-lm" else ""

    def key(k):
        if k.startswith("S=") and k != "S=E" and "/" not in k:
            return f"{k}/{installs.get(k, default)}{loop}"
        return f"{k}{loop}"

    return key


def bench_table(recs):
    """The engine-core benchmarks, one row per figure: each a ratio measured in one run."""
    rows = []
    for r in recs:
        res, base = (
            r["result"],
            dict(
                **machine_cols(r),
                bench=res_get(r, "bench"),
                model=res_get(r, "model"),
                tokens=res_get(r, "tokens"),  # a decode's length: short ones pay more cold misses a token
                started_utc=r["started_utc"],
                run_id=r["run_id"],
            ),
        )
        figs = {}
        if base["bench"] == "throughput":
            k_ = throughput_key(r)
            figs = {f"tok_s[{k_(k)}]": v for k, v in res["tok_s"].items()}
            for k, sp in res.get("tok_s_spread", {}).items():
                figs[f"tok_s_min[{k_(k)}]"], figs[f"tok_s_max[{k_(k)}]"] = sp["min"], sp["max"]
            figs.update({f"x resident[{k_(k)}]": v for k, v in res.get("ratio_vs_resident", {}).items()})
            runs = res.get("tok_s_runs", {})
            if res.get("ratio_vs_resident") and "S=E" in runs:
                figs[f"repeats[{k_('S=E')}]"] = len(runs["S=E"])
                # Each repeat's ratio to resident decoding in the same repeat (the runs are
                # interleaved): a machine that drifts between repeats moves both sides of it.
                for k, v in runs.items():
                    paired = sorted(a / b for a, b in zip(v, runs["S=E"]))
                    figs[f"x resident paired[{k_(k)}]"] = statistics.median(paired)
                    figs[f"x resident paired_min[{k_(k)}]"] = paired[0]
                    figs[f"x resident paired_max[{k_(k)}]"] = paired[-1]
            figs.update({f"memory_bytes[{k_(k)}]": v for k, v in res.get("memory_bytes", {}).items()})
            # a prompt's prefill (records since it was measured): its speed and what it read
            figs.update({f"prefill_tok_s[{k_(k)}]": v for k, v in res.get("prefill_tok_s", {}).items()})
            figs.update({f"prefill_bytes_read[{k_(k)}]": v for k, v in res.get("prefill_bytes_read", {}).items()})
            if res.get("ratio_engine_full_vs_mlx_lm") is not None:  # None: not decoded resident
                figs["ratio engine S=E / mlx-lm"] = res["ratio_engine_full_vs_mlx_lm"]
        elif base["bench"] == "miss":
            figs = {f"per_miss_ms[{k}]": v for k, v in res["per_miss_ms"].items()}
            figs.update({f"copy_split_ms[{k}]": v for k, v in res.get("copy_split_ms", {}).items()})
            figs.update({f"split_ms[{k}]": v for k, v in res.get("split_ms", {}).items()})
            figs.update({f"x raw_preadv[{k}]": v for k, v in res["ratio_vs_raw"].items()})
            figs.update({f"x raw_preadv_h2d[{k}]": v for k, v in res.get("ratio_vs_raw_h2d", {}).items()})
            figs.update({f"x pinned floor[{k}]": v for k, v in res.get("ratio_vs_floor", {}).items()})
            base["tier"] = res["tier"]
        elif base["bench"] == "install":
            figs = {f"install_ms[{k}]": v for k, v in res["install_ms"].items()}
            figs.update({f"S64/S8[{k}]": v for k, v in res["ratio_S64_vs_S8"].items()})
            figs.update({f"diagnosis_ms[{k}]": v for k, v in res.get("diagnosis_ms", {}).items()})
        elif base["bench"] == "prefetch":
            base["tier"], base["slots"] = res["tier"], res["slots"]
            base["prompt_set"] = res["prompt_set"]
            for k, v in res["results"].items():
                k = k if "install" not in res else f"{k}/{v['install']}"
                figs[f"tok_s[{k}]"] = v["tok_s"]
                figs[f"stall_ms_per_token[{k}]"] = v["stall_ms_per_token"]
                if "tok_s_min" in v:
                    figs[f"tok_s_min[{k}]"], figs[f"tok_s_max[{k}]"] = v["tok_s_min"], v["tok_s_max"]
        elif base["bench"] == "serve":
            base["slots"] = res["slots"]
            for k, v in res["servers"].items():
                figs[f"latency_p50_s[{k}]"], figs[f"latency_p99_s[{k}]"] = v["latency_p50_s"], v["latency_p99_s"]
                figs[f"tok_s[{k}]"] = statistics.median(v["tok_s"])
                figs[f"tok_s_min[{k}]"], figs[f"tok_s_max[{k}]"] = min(v["tok_s"]), max(v["tok_s"])
                if v["peak_rss_bytes"]:
                    figs[f"peak_rss_bytes[{k}]"] = v["peak_rss_bytes"]
            figs["clients"] = res["clients"]
        for name, value in figs.items():
            rows.append(dict(base, figure=name, value=value))
    keys = MACHINE + ["bench", "model", "tier", "slots", "prompt_set", "tokens", "figure"]
    cols = keys + ["value", "runs", "commit", "run_id"]  # run_id: the latest run's, to read one run's figures together
    for row in rows:
        for k in keys:
            row.setdefault(k, None)
    df = latest(rows, keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)


def res_get(rec, key):
    return rec["result"].get(key)


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


def suite_table(recs):
    """Every recorded run of the test suite (python -m harness suite): where it ran, on which
    engine/ tree, and what it found."""
    cols = MACHINE + ["engine_tree", "commit", "dirty", "scope", "passed", "failed", "errors", "skipped", "xfailed"]
    cols += ["seconds", "failures", "started_utc", "run_id"]
    rows = []
    for r in recs:
        res = r["result"]
        args = [a for a in (r.get("config") or {}).get("pytest_args", ["tests"]) if not a.startswith("-")]
        rows.append(
            dict(
                **machine_cols(r),
                scope="the whole suite" if args in (["tests"], ["tests/"]) else f"{len(args)} test files",
                engine_tree=res["engine_tree"][:12],
                dirty=r["dirty"],
                **{k: res[k] for k in ("passed", "failed", "errors", "skipped", "xfailed", "seconds")},
                failures="; ".join(f["test"] for f in res["failures"]),
                started_utc=r["started_utc"],
                run_id=r["run_id"],
            )
        )
    return pd.DataFrame(rows, columns=cols).sort_values(["started_utc", "run_id"], kind="mergesort")


def determinism_table(recs):
    """Plain mlx-lm run again on the same tokens (scripts/determinism.py): per machine, model and
    CUDA-graph setting, the largest |Δlogit| over the latest run's repetitions."""
    keys = MACHINE + ["cuda_graphs", "model"]
    figs = ("cuda_graphs", "model", "deterministic", "max_abs_diff", "nan", "steps")
    rows = [
        dict(**machine_cols(r), **{k: r["result"][k] for k in figs}, repetitions=r["result"]["runs"])
        | dict(started_utc=r["started_utc"], run_id=r["run_id"])
        for r in recs
        if "error" not in r["result"]
    ]
    cols = keys + ["deterministic", "max_abs_diff", "nan", "repetitions", "steps", "commit", "runs"]
    return latest(rows, keys).reindex(columns=cols) if rows else pd.DataFrame(columns=cols)


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
        "train_loss": train_table([r for r in recs if r["gate"] == "train"]),
        "placement_sim": placement_sim_table(of("F", "placement_sim")),
        "multinode": multinode_table(of("F", "multinode")),
        "sync_ablation": sync_table(of("C", "sync_ablation")),
        "wire_ablation": wire_table(of("F", "wire_ablation")),
        "bench": bench_table([r for r in recs if r["gate"] == "bench"]),
        "suite": suite_table(of("tests", "suite")),
        "determinism": determinism_table(of("tests", "determinism")),
    }
    tables["claims"] = claims_table(tables)
    write_claims(tables["claims"], figdir / "claims.md")
    for name, df in tables.items():
        if df.empty and not len(df.columns):
            df = pd.DataFrame(columns=["empty"])
        write(df, figdir / "tables" / f"{name}.csv", figdir / "tables" / f"{name}.md")
    return tables
