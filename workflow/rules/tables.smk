rule tables:
    # For the published folder (figures/) the job also rewrites the generated blocks of README.md
    # and docs/*.md (harness/report/docblocks.py): hand-written pages, so not outputs Snakemake
    # could own; CI makes them again and fails on any difference.
    # Every raw file the folder's tables are made from (common.smk, raw_inputs): a new raw file
    # is a new input, so Snakemake says why the tables are made again.
    input:
        lambda wc: raw_inputs(wc.figdir),
    output:
        expand("{{figdir}}/tables/{t}.{ext}", t=TABLES, ext=["csv", "md"]),
        "{figdir}/claims.md",
    log:
        "results/logs/tables/{figdir}.log",
    conda:
        "../envs/titan.yaml"
    params:
        raw="results/raw",
    script:
        "../scripts/tables.py"
