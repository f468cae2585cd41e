"""Predictor quality on held-out traces: precision, recall and replayed hit rate beside LRU
and Belady at every S; one raw file per model and prompt set."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import command, logged  # noqa: E402

from engine import online, provenance, rawlog, registry  # noqa: E402

s = snakemake.params.settings
wc = snakemake.wildcards
with logged(snakemake):
    started = provenance.utc_now()
    spec = registry.get_spec(wc.model)
    results = online.quality(wc.model, wc.pset, s["predictors"], s["depths"], s["slots"], s["fit_tokens"],
                             s["predict_size"])
    for r in results:
        print(r, flush=True)
    rawlog.write_run("C", "predictor_quality", results, config=dict(s, model=wc.model, prompt_set=wc.pset),
                     seed=spec.get("seed"), started=started, path=snakemake.output[0], command=command(snakemake),
                     model=wc.model, revision=spec.get("revision"))
