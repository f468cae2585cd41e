rule core_throughput:
    output:
        "results/core/throughput.json",
    log:
        "results/logs/core_throughput.log",
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        python=PYTHON,
        model=config["core"]["throughput_model"],
        tokens=config["core"]["tokens"],
        repeats=config["core"]["repeats"],
    shell:
        "{params.python} -m engine bench throughput --model {params.model} --tokens {params.tokens}"
        " --repeats {params.repeats} --out {output} > {log} 2>&1"


rule core_miss:
    output:
        "results/core/miss.json",
    log:
        "results/logs/core_miss.log",
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        python=PYTHON,
        model=config["core"]["miss_model"],
        repeats=config["core"]["repeats"],
    shell:
        "{params.python} -m engine bench miss --model {params.model} --repeats {params.repeats}"
        " --out {output} > {log} 2>&1"
