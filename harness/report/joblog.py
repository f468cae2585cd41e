"""A rule's script writes what it prints to the rule's log (Snakemake runs scripts in a
subprocess of its own). Apart from jobs.py so that the table and figure jobs import no engine."""

import contextlib


@contextlib.contextmanager
def logged(snakemake):
    with open(snakemake.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield log
