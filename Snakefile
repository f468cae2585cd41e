# Titan's experiment harness. The gates' rules arrive in workflow/rules/*.smk; until then `all`
# runs the engine-core benchmark on the embedded default model.

configfile: "workflow/config/default.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/core.smk"


rule all:
    input:
        "results/core/throughput.json",
        "results/core/miss.json",
