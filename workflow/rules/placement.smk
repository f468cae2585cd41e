rule placement_sim:
    input:
        lambda wc: [
            trace_file(wc.model, pset, split, online(wc.out, wc.model)["fit_tokens"])
            for pset, split in (("general", "fit"), ("general", "eval"), ("code", "eval"))
        ],
    output:
        protected(f"{{out}}/raw/F/placement_sim/{RUN}-{{model}}.jsonl"),
    log:
        f"{{out}}/logs/placement_sim-{RUN}-{{model}}.log",
    conda:
        "../envs/titan.yaml"
    params:
        settings=lambda wc: settings(wc.out)["placement"],
        fit_tokens=lambda wc: online(wc.out, wc.model)["fit_tokens"],
    script:
        "../scripts/gate_f.py"


rule multinode:
    input:
        lambda wc: trace_file(wc.model, "general", "fit", online(wc.out, wc.model)["fit_tokens"]),
    output:
        protected(f"{{out}}/raw/F/multinode/{RUN}-{{model}}.jsonl"),
    log:
        f"{{out}}/logs/multinode-{RUN}-{{model}}.log",
    benchmark:
        f"{{out}}/benchmarks/multinode-{RUN}-{{model}}.tsv"
    threads: lambda wc: max(settings(wc.out)["placement"]["measured_nodes"], default=1)
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        settings=lambda wc: settings(wc.out)["placement"],
        fit_tokens=lambda wc: online(wc.out, wc.model)["fit_tokens"],
    script:
        "../scripts/gate_f.py"


rule wire_ablation:
    input:
        lambda wc: model_input(wc.model),
    output:
        protected(f"{{out}}/raw/F/wire_ablation/{RUN}-{{model}}.jsonl"),
    log:
        f"{{out}}/logs/wire_ablation-{RUN}-{{model}}.log",
    benchmark:
        f"{{out}}/benchmarks/wire_ablation-{RUN}-{{model}}.tsv"
    threads: lambda wc: settings(wc.out)["ablations"]["wire"]["nodes"]
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        settings=lambda wc: settings(wc.out)["ablations"]["wire"],
    script:
        "../scripts/ablation.py"
