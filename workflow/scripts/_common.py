"""Shared by the workflow's scripts: logging to the rule's log, and the command line that a
raw record names (Snakemake runs scripts in a subprocess of its own)."""

import contextlib
import sys


@contextlib.contextmanager
def logged(snakemake):
    with open(snakemake.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield log


def command(snakemake) -> str:
    wc = " ".join(f"{k}={v}" for k, v in snakemake.wildcards.items())
    return f"snakemake {snakemake.rule} ({wc}) -> {' '.join(snakemake.output)}".replace("  ", " ")
