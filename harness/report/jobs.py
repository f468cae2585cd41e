"""Shared by the gates' scripts: a measurement logged to the rule's log and written as one raw
file with full provenance."""

from engine.models import registry
from harness import provenance, rawlog

from .joblog import logged


def command(snakemake) -> str:
    wc = " ".join(f"{k}={v}" for k, v in snakemake.wildcards.items())
    return f"snakemake {snakemake.rule} ({wc}) -> {' '.join(snakemake.output)}".replace("  ", " ")


def run_gate(snakemake, gate: str, experiment: str, measure):
    """Run `measure()` (a list of result dicts) and write them to the rule's raw output. A
    measurement that raises writes nothing."""
    wc = dict(snakemake.wildcards.items())
    model = wc.get("model")
    with logged(snakemake):
        started = provenance.utc_now()
        spec = registry.get_spec(model) if model else {}
        results = measure()
        for r in results:
            print(r, flush=True)
        config = dict(snakemake.params.settings, **{k: v for k, v in wc.items() if k != "out"})
        rawlog.write_run(
            gate,
            experiment,
            results,
            config=config,
            seed=spec.get("seed", 0),
            started=started,
            path=snakemake.output[0],
            command=command(snakemake),
            model=model,
            revision=spec.get("revision"),
        )
