rule train:
    # `snakemake train`: every trained model this configuration uses.
    input:
        [f"resources/models/{m}/titan-build.json" for m in trained_models()],


rule train_model:
    # One training run writes the model and its float32 variant, if it has one (model_input).
    output:
        "resources/models/{model}/titan-build.json",
    wildcard_constraints:
        model="|".join(TRAINED),
    log:
        "results/logs/train-{model}.log",
    benchmark:
        "results/benchmarks/train-{model}.tsv"
    threads: 2
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        python=PYTHON,
    shell:
        "{params.python} -m harness train {wildcards.model} > {log} 2>&1"


rule trace:
    input:
        lambda wc: model_input(wc.model),
    output:
        "resources/traces/{model}/{pset}-{split}-t{tokens}.npz",
    log:
        "results/logs/trace/{model}-{pset}-{split}-t{tokens}.log",
    benchmark:
        "results/benchmarks/trace/{model}-{pset}-{split}-t{tokens}.tsv"
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        python=PYTHON,
    shell:
        "{params.python} -m engine trace --model {wildcards.model} --set {wildcards.pset}"
        " --split {wildcards.split} --tokens {wildcards.tokens} > {log} 2>&1"


rule store:
    # Its own job, not the first engine's load inside a timed one: a store takes minutes to write
    # at real expert sizes, and a sweep cut short by a time limit then resumes without rewriting it.
    input:
        lambda wc: model_input(wc.model),
    output:
        "resources/stores/{model}/index.json",
    log:
        "results/logs/store/{model}.log",
    benchmark:
        "results/benchmarks/store/{model}.tsv"
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        python=PYTHON,
    shell:
        # Rebuilt only if built from another model (a retrained one): a job that opened the
        # store on its own meanwhile (its first engine load builds it) keeps reading it.
        "{params.python} -m engine store build {wildcards.model} > {log} 2>&1"


rule fit:
    input:
        fit="resources/traces/{model}/{pset}-fit-t{tokens}.npz",
        eval="resources/traces/{model}/{pset}-eval-t{tokens}.npz",
    output:
        "resources/predictors/{model}/{pset}-{predictor}-d{depth}-m{size}-t{tokens}.npz",
    log:
        "results/logs/fit/{model}-{pset}-{predictor}-d{depth}-m{size}-t{tokens}.log",
    benchmark:
        "results/benchmarks/fit/{model}-{pset}-{predictor}-d{depth}-m{size}-t{tokens}.tsv"
    resources:
        timing=1,
    conda:
        "../envs/titan.yaml"
    params:
        python=PYTHON,
    shell:
        "{params.python} -m engine fit --model {wildcards.model} --set {wildcards.pset}"
        " --predictor {wildcards.predictor} --depth {wildcards.depth} --size {wildcards.size}"
        " --tokens {wildcards.tokens} > {log} 2>&1"
