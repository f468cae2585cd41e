"""Tables from every raw file under the output tree's raw root."""

from pathlib import Path

from harness.report import aggregate, compare_runs, docblocks
from harness.report.joblog import logged

with logged(snakemake):
    raw = Path(snakemake.params.raw)
    by_file = compare_runs.read_by_file(raw) if raw.exists() else {}  # each raw file read once
    recs = [r for rs in by_file.values() for r in rs]
    tables = aggregate.build(raw, snakemake.wildcards.figdir, recs=recs)
    if snakemake.wildcards.figdir == "figures":  # the published tables: their sentences in the pages
        for page in docblocks.build(tables, raw=raw, by_file=by_file):
            print(f"rewrote the generated blocks of {page}")
