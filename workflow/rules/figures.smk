rule plots:
    input:
        expand("{{figdir}}/tables/{t}.csv", t=TABLES),
    output:
        report("{figdir}/design.png", caption="../report/design.rst", category="Gate B"),
        report("{figdir}/throughput_vs_slots.png", caption="../report/throughput_vs_slots.rst", category="Gate C"),
        report("{figdir}/stall_vs_slots.png", caption="../report/stall_vs_slots.rst", category="Gate C"),
        report("{figdir}/miss_breakdown.png", caption="../report/miss_breakdown.rst", category="Gate C"),
        report("{figdir}/predictor_recall.png", caption="../report/predictor_recall.rst", category="Gate C"),
        report("{figdir}/routing.png", caption="../report/routing.rst", category="Routing"),
        report("{figdir}/train_loss.png", caption="../report/train_loss.rst", category="Routing"),
        report("{figdir}/placement.png", caption="../report/placement.rst", category="Gate F"),
        report("{figdir}/throughput_vs_memory.png", caption="../report/throughput_vs_memory.rst", category="Gate C"),
        report("{figdir}/prediction_pays.png", caption="../report/prediction_pays.rst", category="Gate C"),
        report("{figdir}/many_rows.png", caption="../report/many_rows.rst", category="Benches"),
        report("{figdir}/families.png", caption="../report/families.rst", category="Benches"),
        expand("{{figdir}}/{f}.pdf", f=FIGURES),
    log:
        "results/logs/plots/{figdir}.log",
    threads: 2  # figures drawn side by side (plotting.build)
    conda:
        "../envs/titan.yaml"
    params:
        # the models whose routing was learnt (prediction_pays): said here, where the registry is
        # read anyway, so that the drawing job imports no engine
        trained=sorted(m for m, s in models.load_registry().items() if "training" in s),
    script:
        "../scripts/plots.py"


rule environment:
    # This machine's raw probe (resources/probes/, never committed) and the sanitised inventory
    # artifacts/environment.json, in which every raw record's host alias resolves.
    log:
        "results/logs/environment.log",
    conda:
        "../envs/titan.yaml"
    params:
        raw="results/raw",
        inventory="artifacts/environment.json",
    script:
        "../scripts/environment.py"
