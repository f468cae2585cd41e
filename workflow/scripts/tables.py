"""Tables from every raw file under the output tree's raw root."""

from harness.report import aggregate, docblocks
from harness.report.jobs import logged

with logged(snakemake):
    tables = aggregate.build(snakemake.params.raw, snakemake.wildcards.figdir)
    if snakemake.wildcards.figdir == "figures":  # the published tables: their sentences in the pages
        for page in docblocks.build(tables, raw=snakemake.params.raw):
            print(f"rewrote the generated blocks of {page}")
