"""`snakemake figures`: tables and figures from the raw logs already there; no benchmark."""

from pathlib import Path

from harness.report import aggregate, plotting
from harness.report.jobs import logged

with logged(snakemake):
    figdir = Path(snakemake.params.figdir)
    aggregate.build(snakemake.params.raw, figdir)
    plotting.build(figdir)
