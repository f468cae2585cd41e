"""The paper's experiments on the Titan engine: gates B (`design`), C (`online`, `routing`) and F
(`gate_f`), the engine-core benchmarks (`bench`), provenance-stamped raw logs (`provenance`;
`rawlog` writes them, `records` reads them) and the machine inventory (`inventory`). It uses the
`engine` library; the library never uses it. The Snakemake workflow (workflow/) calls it; `python -m harness` runs its
commands by hand."""
