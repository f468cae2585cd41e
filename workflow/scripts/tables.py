"""Tables from every raw file under the output tree's raw root."""

import sys

sys.path.insert(0, snakemake.scriptdir)
import aggregate  # noqa: E402
import docblocks  # noqa: E402
from _common import logged  # noqa: E402

with logged(snakemake):
    tables = aggregate.build(snakemake.params.raw, snakemake.wildcards.figdir)
    if snakemake.wildcards.figdir == "figures":  # the published tables: their sentences in the pages
        for page in docblocks.build(tables, raw=snakemake.params.raw):
            print(f"rewrote the generated blocks of {page}")
