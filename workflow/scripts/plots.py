"""Figures from the tables only."""

from harness.report import plotting
from harness.report.jobs import logged

with logged(snakemake):
    plotting.build(snakemake.wildcards.figdir)
