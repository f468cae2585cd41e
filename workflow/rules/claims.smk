rule claims_check:
    # The sync ablation at reduced size (config `claims_check`) under this run id, its claims'
    # verdicts compared with the last full run's on this machine, each change printed with the
    # commits since (harness/report/claims_check.py). Run it whenever engine/runtime/ changes.
    input:
        expand(f"{CHECK}/raw/C/sync_ablation/{RUN}-{{model}}-{{pset}}.jsonl",
               model=config.get("claims_check", {}).get("sync", {}).get("models", []),
               pset=config.get("claims_check", {}).get("sync", {}).get("prompt_sets", [])),
    output:
        f"{CHECK}/{RUN}.md",
    log:
        f"{CHECK}/logs/claims_check-{RUN}.log",
    conda:
        "../envs/titan.yaml"
    params:
        raw="results/raw",
        check=lambda wc, input: str(Path(input[0]).parents[2]),  # the check's raw root
    script:
        "../scripts/claims_check.py"
