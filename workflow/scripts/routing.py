"""Routing statistics of one model from its traces: popularity skew per layer, cross-layer
predictability by depth, and code-versus-general specialisation; one raw file."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import command, logged  # noqa: E402

from engine import provenance, rawlog, registry, routing  # noqa: E402

s = snakemake.params.settings
wc = snakemake.wildcards
with logged(snakemake):
    started = provenance.utc_now()
    spec = registry.get_spec(wc.model)
    results = routing.stats(wc.model, s["fit_tokens"], s["predict_size"])
    for r in results:
        print(r, flush=True)
    rawlog.write_run("C", "routing", results, config=dict(s, model=wc.model), seed=spec.get("seed"),
                     started=started, path=snakemake.output[0], command=command(snakemake),
                     model=wc.model, revision=spec.get("revision"))
