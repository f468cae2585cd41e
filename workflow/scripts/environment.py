"""Probe this machine (raw, ignored) and regenerate the sanitised inventory."""

from harness import inventory
from harness.report.joblog import logged

with logged(snakemake):
    print(f"probe: {inventory.write_probe()}")
    inv = inventory.update(snakemake.params.inventory, snakemake.params.raw)
    print(f"{snakemake.params.inventory}: {len(inv['machines'])} machines")
