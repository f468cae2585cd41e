"""The rule claims_check: the check's verdicts against the last full run's (harness.report.claims_check)."""

from pathlib import Path

from harness.report import claims_check
from harness.report.joblog import logged

with logged(snakemake):
    claims_check.main(
        ["--check-raw", snakemake.params.check, "--raw", snakemake.params.raw, "--out", snakemake.output[0]]
    )
print(Path(snakemake.output[0]).read_text(), end="")
