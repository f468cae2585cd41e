"""Aggregation: every raw file under a raw root -> CSV and Markdown tables.

Byte-identical for the same raw logs: records are sorted, numbers formatted to fixed
precision. For every configuration and machine, the runs of the latest commit are tabled, pooled
(`tables.common.latest`: `runs` counts them, `commit` names the code). Each table is made by its
own module of `tables/`; the paper's claims against them are claims.py's. A malformed raw line
stops everything with its file and line number.
"""

import csv
from pathlib import Path

import pandas as pd

from harness import records

from .claims import write_claims
from .tables import make


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
    with open(out_csv, "w", newline="") as f:
        # the csv module quotes a cell with a comma, a quote or a line break (a test id can hold all three)
        w = csv.writer(f, lineterminator="\n")
        w.writerow(cols)
        w.writerows(cells)
    with open(out_md, "w") as f:
        f.write("| " + " | ".join(cols) + " |\n")
        f.write("|" + "---|" * len(cols) + "\n")
        for row in cells:
            f.write("| " + " | ".join(row) + " |\n")


def write_all(tables: dict, figdir: Path):
    """Every table into `figdir`/tables (CSV and Markdown) and the claims table into `figdir`."""
    figdir = Path(figdir)
    write_claims(tables["claims"], figdir / "claims.md")
    for name, df in tables.items():
        if df.empty and not len(df.columns):
            df = pd.DataFrame(columns=["empty"])
        write(df, figdir / "tables" / f"{name}.csv", figdir / "tables" / f"{name}.md")


def build(raw_root, figdir, recs=None):
    """Read every raw file under `raw_root` (or take its records, already read) and write every
    table into `figdir`/tables; returns the tables."""
    raw_root = Path(raw_root)
    if recs is None:
        recs = records.read([raw_root]) if raw_root.exists() else []
    tables = make(recs)
    write_all(tables, figdir)
    return tables
