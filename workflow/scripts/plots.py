"""Figures from the tables only."""

from harness.report import plotting
from harness.report.joblog import logged

with logged(snakemake):
    plotting.build(snakemake.wildcards.figdir, snakemake.params.trained, jobs=snakemake.threads)
