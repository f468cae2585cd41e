"""Tables from every raw file under the output tree's raw root."""

import sys

sys.path.insert(0, snakemake.scriptdir)
import aggregate  # noqa: E402
from _common import logged  # noqa: E402

with logged(snakemake):
    aggregate.build(snakemake.params.raw, snakemake.wildcards.figdir)
