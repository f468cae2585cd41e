"""Did a change move a paper claim's verdict? The claims a small, quick run measures (`snakemake
claims_check`: the ablations at reduced size) against the same claims of the last full run of `all`
on this machine, as that run left them; every verdict that changed is printed with the commits
between the two runs.

    python -m harness.report.claims_check --check-raw DIR [--raw results/raw] [--host ALIAS]

`DIR` holds the check's raw files (the rule's own, or those of any run, e.g. one made at another
commit). A reduced run is noisier: a verdict that becomes `unresolved` may be its spread; one that
goes from yes to no (or back) is what a change to the engine shows.
"""

import argparse
import subprocess
from pathlib import Path

import pandas as pd

from harness import provenance, records

from . import compare_runs, docblocks, tables

VERDICTS = compare_runs.VERDICTS


def last_full_run(raw: Path, by_file: dict, host: str | None) -> str | None:
    """The full run of `all` on `host` (None: on any machine) whose records (`by_file`: the raw
    files' under `raw`) ended last."""
    runs = {r: h for r, (h, _) in docblocks.full_runs(raw).items() if host is None or h == host}
    if not runs:
        return None
    ends = compare_runs.run_ends(by_file, list(runs))
    return max(runs, key=lambda r: ends[r])


def check(raw: Path, check_raw: Path, host: str | None) -> tuple[str | None, pd.DataFrame]:
    """(the full run compared with, one row per claim both measured: both verdicts and ratio
    ranges, `changed`, `reversed`). `host`: the machine whose last full run is the reference (None:
    the last full run of any machine)."""
    by_file = compare_runs.read_by_file(raw)
    full = last_full_run(raw, by_file, host)
    if full is None:
        return None, pd.DataFrame()
    a = compare_runs.claims_as_of(by_file, full, "")
    b = tables.claims(records.read([check_raw]) if Path(check_raw).exists() else [])
    # the full run's own machine(s) only (the tables also hold other machines' rows); the same
    # host alias may have changed chips, so the claims are matched by name and both machines said
    a = a[a["machine"].isin(compare_runs.machines_of(raw, by_file, full))]
    cols = VERDICTS + ["ratio", "ratio_low", "ratio_high", "machine"]
    df = a[["claim"] + cols].merge(b[["claim"] + cols], on="claim", how="inner", suffixes=("_full", "_check"))
    df["changed"] = (df["direction_full"] != df["direction_check"]) | (
        df["within_tolerance_full"] != df["within_tolerance_check"]
    )
    df["reversed"] = df["direction_full"].isin(["yes", "no"]) & df["direction_check"].isin(["yes", "no"])
    df["reversed"] &= df["direction_full"] != df["direction_check"]
    return full, df.sort_values(["claim", "machine_full"]).reset_index(drop=True)


def commits_between(full_run: str, root=provenance.REPO_ROOT) -> list:
    """`git log --oneline` from the full run's commit to this checkout's HEAD."""
    commit = full_run.split("-", 1)[0]
    r = subprocess.run(["git", "log", "--oneline", f"{commit}..HEAD"], cwd=root, capture_output=True, text=True)
    return r.stdout.splitlines() if r.returncode == 0 else [f"(no git history here: {r.stderr.strip()})"]


def report(full: str | None, df: pd.DataFrame, commits: list, check_raw) -> str:
    if full is None:
        return f"No full run of `all` on this machine to compare {check_raw} with: run `snakemake --cores 2 all` once."
    lines = [f"# Claims check: {check_raw} against the full run {full}", ""]
    changed = df[df["changed"]]
    other = sorted({f"{r.machine_full} (full run) / {r.machine_check} (check)" for r in df.itertuples()
                    if r.machine_full != r.machine_check})  # fmt: skip
    if other:
        lines += [f"Machines differ: {'; '.join(other)}: timings may differ for that reason alone.", ""]
    lines.append(
        f"{len(df)} claims compared; {len(changed)} verdicts changed, {int(df['reversed'].sum())} of them from yes "
        "to no or back."
    )
    for r in changed.itertuples():
        flag = "REVERSED " if r.reversed else ""
        lines.append(
            f"- {flag}{r.claim} [{r.machine_check}]: direction {r.direction_full} -> {r.direction_check} "
            f"(x{r.ratio_full:.3g} [{r.ratio_low_full:.3g}, {r.ratio_high_full:.3g}] -> x{r.ratio_check:.3g} "
            f"[{r.ratio_low_check:.3g}, {r.ratio_high_check:.3g}]), within tolerance {r.within_tolerance_full} -> "
            f"{r.within_tolerance_check}"
        )
    if len(changed):
        lines += ["", f"Commits since the full run ({len(commits)}):"] + [f"    {c}" for c in commits]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check-raw", type=Path, required=True, help="the check run's raw files")
    ap.add_argument("--raw", type=Path, default=Path("results/raw"), help="where the full runs' raw files are")
    ap.add_argument(
        "--host",
        default=None,
        help="the host alias whose last full run is the reference (default: this machine's, else any machine's)",
    )
    ap.add_argument("--out", type=Path, help="also write the report here")
    a = ap.parse_args(argv)
    full, df = check(a.raw, a.check_raw, a.host or provenance.host_alias())
    if full is None and a.host is None:  # no full run on this machine (a CI runner): the latest of any
        full, df = check(a.raw, a.check_raw, None)
    text = report(full, df, commits_between(full) if full else [], a.check_raw)
    print(text, end="")
    if a.out:
        a.out.write_text(text)
    return df


if __name__ == "__main__":
    main()
