rule prefetch_online:
    input:
        online_inputs,
    output:
        protected(f"{{out}}/raw/C/prefetch_online/{RUN}-{{model}}-{{tier}}-{{pset}}.jsonl"),
    log:
        f"{{out}}/logs/prefetch_online-{RUN}-{{model}}-{{tier}}-{{pset}}.log",
    benchmark:
        f"{{out}}/benchmarks/prefetch_online-{RUN}-{{model}}-{{tier}}-{{pset}}.tsv"
    threads: lambda wc: online(wc.out, wc.model)["readers"]
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        settings=lambda wc: online(wc.out, wc.model),
    script:
        "../scripts/gate_c.py"


rule predictor_quality:
    input:
        fit=lambda wc: trace_file(wc.model, wc.pset, "fit", online(wc.out, wc.model)["fit_tokens"]),
        eval=lambda wc: trace_file(wc.model, wc.pset, "eval", online(wc.out, wc.model)["fit_tokens"]),
        fitted=fitted_inputs,
    output:
        protected(f"{{out}}/raw/C/predictor_quality/{RUN}-{{model}}-{{pset}}.jsonl"),
    log:
        f"{{out}}/logs/predictor_quality-{RUN}-{{model}}-{{pset}}.log",
    benchmark:
        f"{{out}}/benchmarks/predictor_quality-{RUN}-{{model}}-{{pset}}.tsv"
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        settings=lambda wc: online(wc.out, wc.model),
    script:
        "../scripts/quality.py"


rule routing:
    input:
        lambda wc: [
            trace_file(wc.model, pset, split, online(wc.out, wc.model)["fit_tokens"])
            for pset in ("general", "code")
            for split in ("fit", "eval")
        ]
        + fitted_files(wc.model, ["general", "code"], ["transition", "probe"], ROUTING_DEPTHS,
                       online(wc.out, wc.model)),
    output:
        protected(f"{{out}}/raw/C/routing/{RUN}-{{model}}.jsonl"),
    log:
        f"{{out}}/logs/routing-{RUN}-{{model}}.log",
    benchmark:
        f"{{out}}/benchmarks/routing-{RUN}-{{model}}.tsv"
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        settings=lambda wc: online(wc.out, wc.model),
        depths=ROUTING_DEPTHS,
    script:
        "../scripts/routing.py"


rule sync_ablation:
    input:
        lambda wc: model_input(wc.model) + store_input(wc.model),
    output:
        protected(f"{{out}}/raw/C/sync_ablation/{RUN}-{{model}}-{{pset}}.jsonl"),
    log:
        f"{{out}}/logs/sync_ablation-{RUN}-{{model}}-{{pset}}.log",
    benchmark:
        f"{{out}}/benchmarks/sync_ablation-{RUN}-{{model}}-{{pset}}.tsv"
    threads: lambda wc: online(wc.out, wc.model)["readers"]
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        settings=lambda wc: settings(wc.out)["ablations"]["sync"],
    script:
        "../scripts/ablation.py"
