rule design:
    output:
        protected(f"{{out}}/raw/B/design/{RUN}.jsonl"),
    log:
        f"{{out}}/logs/design-{RUN}.log",
    benchmark:
        f"{{out}}/benchmarks/design-{RUN}.tsv"
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        settings=lambda wc: settings(wc.out)["design"],
    script:
        "../scripts/gate_b.py"
