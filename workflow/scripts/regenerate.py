"""`snakemake figures`: tables and figures from the raw logs already there; no benchmark."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import logged  # noqa: E402

import aggregate  # noqa: E402
import plotting  # noqa: E402

with logged(snakemake):
    aggregate.build(snakemake.params.raw, snakemake.params.figdir)
    plotting.build(snakemake.params.figdir)
