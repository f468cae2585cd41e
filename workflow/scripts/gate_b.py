"""Gate B (design): slot writes, kernel sequences and activation parity; one raw file."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import command, logged  # noqa: E402

from engine import design, provenance, rawlog  # noqa: E402

s = snakemake.params.settings
with logged(snakemake):
    started = provenance.utc_now()
    results = design.slot_write(s["hidden"], s["width"], s["dtype"], s["slots"], s["experts"], s["repeats"])
    results += design.kernels(s["hidden"], s["width"], s["dtype"], s["experts"], s["top_k"], s["repeats"])
    for m in s["parity_models"]:
        results += design.parity(m, design.PARITY_PROMPT, s["parity_steps"])
    for r in results:
        print(r, flush=True)
    rawlog.write_run("B", "design", results, config=dict(s), seed=0, started=started,
                     path=snakemake.output[0], command=command(snakemake), model=None, revision=None)
