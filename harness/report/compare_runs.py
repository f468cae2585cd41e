"""Do two runs of the workflow reach the same verdicts? Each run's claims table is made from the raw
logs as they stood when that run ended, without the other run (so that, for every configuration
both measured, each table is that run's own, whatever ran later), and the verdicts of the claims
the runs measured are compared.

    python -m harness.report.compare_runs RUN_A RUN_B [--raw results/raw] [--csv OUT.csv]

Claims made only from records neither run wrote (the benches, another machine) are left out: they
agree by construction.
"""

import argparse
from pathlib import Path

import pandas as pd

from harness import records

from . import tables
from .tables.common import machine_cols

VERDICTS = ["direction", "within_tolerance"]


def of_run(name: str, run: str) -> bool:
    return name == f"{run}.jsonl" or name.startswith(f"{run}-")


def claims_as_of(by_file: dict, run: str, other: str) -> pd.DataFrame:
    """The claims table from the raw files (`by_file`: file -> its records) that had begun by the
    time `run` ended, except the other run's."""
    end = max(r["finished_utc"] for f, recs in by_file.items() if of_run(f.name, run) for r in recs)
    kept = [
        r
        for f, recs in sorted(by_file.items())
        if not of_run(f.name, other) and min(r["started_utc"] for r in recs) <= end
        for r in recs
    ]
    return tables.claims(kept)


def read_by_file(raw: Path) -> dict:
    """{file: its records} for every raw file under `raw`, each read once."""
    return {f: records.read([f]) for f in sorted(raw.rglob("*.jsonl"))}


def run_ends(by_file: dict, runs: list) -> dict:
    """{run: when its last record finished} from the raw files' records (`read_by_file`)."""
    ends = dict.fromkeys(runs, "")
    for f, recs in by_file.items():
        for run in runs:
            if of_run(f.name, run):
                ends[run] = max([ends[run]] + [r["finished_utc"] for r in recs])
    return ends


def machines_of(raw: Path, by_file: dict, run: str) -> set:
    recs = [r for f, rs in by_file.items() if of_run(f.name, run) for r in rs]
    if not recs:
        raise SystemExit(f"no raw file of run {run!r} under {raw}")
    return {f"{r['device']} {machine_cols(r)['chip']}" for r in recs}


def compare(raw: Path, run_a: str, run_b: str, by_file: dict | None = None) -> pd.DataFrame:
    """Both runs' verdicts on every claim both measured on a machine they share (`by_file`: the
    raw files' records, if already read)."""
    by_file = read_by_file(raw) if by_file is None else by_file
    machines = machines_of(raw, by_file, run_a) & machines_of(raw, by_file, run_b)
    a = claims_as_of(by_file, run_a, run_b)
    b = claims_as_of(by_file, run_b, run_a)
    keys = ["claim", "machine"]
    a = a[a["machine"].isin(machines) & (a["source"] != "tables/bench")]
    b = b[b["machine"].isin(machines) & (b["source"] != "tables/bench")]
    df = a[keys + VERDICTS + ["ratio_low", "ratio_high"]].merge(
        b[keys + VERDICTS + ["ratio_low", "ratio_high"]], on=keys, how="outer", suffixes=("_a", "_b")
    )
    df["same"] = (df["direction_a"] == df["direction_b"]) & (df["within_tolerance_a"] == df["within_tolerance_b"])
    return df.sort_values(keys).reset_index(drop=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--raw", default="results/raw", type=Path)
    ap.add_argument("--csv", type=Path, help="write every compared claim with both verdicts here")
    a = ap.parse_args(argv)
    df = compare(a.raw, a.run_a, a.run_b)
    if a.csv:
        df.to_csv(a.csv, index=False)
    for col in VERDICTS:
        same = (df[f"{col}_a"] == df[f"{col}_b"]).sum()
        decided = df[f"{col}_a"].isin(["yes", "no", "exact"]).sum()
        print(f"{col}: {same} of {len(df)} claims the same in both runs ({decided} decided in {a.run_a})")
    for r in df[~df["same"]].itertuples():
        print(
            f"  changed: {r.claim} [{r.machine}]: direction {r.direction_a} -> {r.direction_b}, "
            f"within tolerance {r.within_tolerance_a} -> {r.within_tolerance_b}"
        )
    return df


if __name__ == "__main__":
    main()
