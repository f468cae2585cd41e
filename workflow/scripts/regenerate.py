"""`snakemake figures`: tables and figures from the raw logs already there; no benchmark."""

import sys
from pathlib import Path

sys.path.insert(0, snakemake.scriptdir)
import aggregate  # noqa: E402
import plotting  # noqa: E402
from _common import logged  # noqa: E402

with logged(snakemake):
    figdir = Path(snakemake.params.figdir)
    aggregate.build(snakemake.params.raw, figdir)
    plotting.build(figdir)
