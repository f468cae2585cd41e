"""Gate F (placement): the simulated grid or the measured multi-node runs of one model."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import command, logged  # noqa: E402

from engine import gate_f, provenance, rawlog, registry  # noqa: E402

s = snakemake.params.settings
wc = snakemake.wildcards
with logged(snakemake):
    started = provenance.utc_now()
    spec = registry.get_spec(wc.model)
    if snakemake.rule == "placement_sim":
        results = gate_f.simulate(wc.model, snakemake.params.fit_tokens, s["nodes"], s["links"], s["capacities"],
                                  s["ssd"], s["hot"], s["every"])
        experiment = "placement_sim"
    else:
        results = gate_f.measure(wc.model, s["measured_nodes"], s["strategies"], s["tokens"],
                                 snakemake.params.fit_tokens, s["measured_capacity"], s["measured_link"], s["ssd"])
        experiment = "multinode"
        bad = [r for r in results if r.get("max_abs_logit_diff", 0.0) != 0.0]
        if bad:  # a run that is not bit-identical to one node is a failure, not a figure
            raise SystemExit(f"multi-node logits differ from one node: {bad}")
    for r in results:
        print(r, flush=True)
    rawlog.write_run("F", experiment, results, config=dict(s, model=wc.model), seed=spec.get("seed"),
                     started=started, path=snakemake.output[0], command=command(snakemake), model=wc.model,
                     revision=spec.get("revision"))
