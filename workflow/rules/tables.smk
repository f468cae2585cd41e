rule tables:
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
        raw=lambda wc: f"{out_of(wc.figdir)}/raw",
    script:
        "../scripts/tables.py"
