rule tables:
    input:
        lambda wc: raw_outputs(out_of(wc.figdir)),
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
