"""Gate C (prefetch_online): the sweep of one model, tier and prompt set; one raw file."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import command, logged  # noqa: E402

from engine import online, provenance, rawlog, registry  # noqa: E402

s = snakemake.params.settings
wc = snakemake.wildcards
with logged(snakemake):
    started = provenance.utc_now()
    spec = registry.get_spec(wc.model)
    results = online.sweep(wc.model, wc.tier, wc.pset, s["slots"], s["predictors"], s["depths"], s["prompts"],
                           s["tokens"], readers=s["readers"], fit_tokens=s["fit_tokens"],
                           progress=lambda r: print(r, flush=True))
    rawlog.write_run("C", "prefetch_online", results, config=dict(s, model=wc.model, tier=wc.tier, prompt_set=wc.pset),
                     seed=spec.get("seed"), started=started, path=snakemake.output[0], command=command(snakemake),
                     model=wc.model, revision=spec.get("revision"))
