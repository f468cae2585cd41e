rule plots:
    input:
        expand("{{figdir}}/tables/{t}.csv", t=TABLES),
    output:
        report(
            expand("{{figdir}}/{f}.png", f=FIGURES),
            caption="../report/figures.rst",
            category="Figures",
        ),
        expand("{{figdir}}/{f}.pdf", f=FIGURES),
    log:
        "results/logs/plots/{figdir}.log",
    conda:
        "../envs/titan.yaml"
    script:
        "../scripts/plots.py"


rule figures:
    # Tables and figures from the raw logs already under results/raw/; runs no benchmark.
    log:
        "results/logs/figures.log",
    conda:
        "../envs/titan.yaml"
    params:
        raw="results/raw",
        figdir="figures",
    script:
        "../scripts/regenerate.py"
