"""Figures from the tables only."""

import sys

sys.path.insert(0, snakemake.scriptdir)
import plotting  # noqa: E402
from _common import logged  # noqa: E402

with logged(snakemake):
    plotting.build(snakemake.wildcards.figdir)
