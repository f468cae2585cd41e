"""Generated sentences inside hand-written pages.

README.md and docs/*.md are written by hand, but a sentence that states a result must come from
the raw records, never be typed. Such a sentence sits in a block

    <!-- generated:NAME -->
    ...
    <!-- /generated:NAME -->

whose inside only the published tables job writes (`snakemake figures`, from figures/tables/);
everything outside the blocks is left byte for byte. CI makes the tables again and fails on any
difference, so a block can never fall behind its records.
"""

import re
from pathlib import Path

import pandas as pd


class BlockError(ValueError):
    """A page's generated block is malformed (unclosed, or opened twice)."""


def fill(text: str, name: str, body: str, where="the page") -> str:
    """`text` with the inside of block `name` replaced by `body` (unchanged if it has no such block)."""
    start, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
    if text.count(start) != text.count(end) or text.count(start) > 1:
        raise BlockError(f"{where}: block '{name}' must be opened and closed once ({start} ... {end})")
    if start not in text:
        return text
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: f"{start}\n{body.strip()}\n{end}", text, count=1)


def update(path, blocks: dict) -> bool:
    """Fill every named block of the page at `path`; returns whether the file changed."""
    path = Path(path)
    old = path.read_text()
    new = old
    for name, body in blocks.items():
        new = fill(new, name, body, where=str(path))
    if new != old:
        path.write_text(new)
    return new != old


def gpu_exactness(suite: pd.DataFrame) -> str:
    """The README's sentence on the latest run of the test suite on a GPU."""
    gpu = suite[suite["device"] == "gpu"] if len(suite) else suite
    if not len(gpu):
        return (
            "No run of the test suite on a CUDA GPU is recorded yet (`scripts/device_gpu.sh OUT tests` makes one; "
            "[docs/gpu.md](docs/gpu.md#the-test-suite-on-a-gpu))."
        )
    r = gpu.iloc[-1]
    verdict = "no failure" if not (r["failed"] or r["errors"]) else f"{r['failed'] + r['errors']} failed"
    text = (
        f"The suite's latest run on a GPU ({r['chip']}, `engine/` tree `{r['engine_tree']}` at commit "
        f"`{r['commit']}`, [record](results/raw/tests/suite/{r['run_id']}.jsonl)): {r['passed']} passed, "
        f"{verdict}, {r['skipped']} skipped."
    )
    if r["failures"]:
        names = r["failures"].split("; ")
        text += " Failed: " + ", ".join(f"`{n.split('::')[-1]}`" for n in names[:6])
        text += f" and {len(names) - 6} more." if len(names) > 6 else "."
    return text


def build(tables: dict, root=".") -> list:
    """Fill every page's blocks from the published tables; returns the pages that changed."""
    blocks = {"gpu-exactness": gpu_exactness(tables["suite"])}
    pages = [Path(root) / "README.md", *sorted((Path(root) / "docs").glob("*.md"))]
    return [p for p in pages if p.exists() and update(p, blocks)]
