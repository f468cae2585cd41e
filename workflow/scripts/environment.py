"""Probe this machine (raw, ignored) and regenerate the sanitised inventory."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import logged  # noqa: E402

from harness import inventory  # noqa: E402

with logged(snakemake):
    print(f"probe: {inventory.write_probe()}")
    inv = inventory.update(snakemake.params.inventory, snakemake.params.raw)
    print(f"{snakemake.params.inventory}: {len(inv['machines'])} machines")
