"""The tables, one module per gate or kind of record: each function takes raw records and returns
one table. `make` selects each table's records and adds the claims table (claims.py), which is
made from the others."""

from ..claims import SOURCES, claims_table
from .ablations import sync_table, wire_table
from .bench import bench_table
from .design import design_table
from .online import miss_table, prefetch_table, quality_table
from .placement import multinode_table, placement_sim_table
from .routing import routing_table, train_table
from .suite import determinism_table, suite_table


def _of(gate, experiment=None):
    return lambda r: r["gate"] == gate and (experiment is None or r["experiment"] == experiment)


# name -> (which records, the function that tables them), in the order the tables are written
TABLES = {
    "design": (_of("B", "design"), design_table),
    "prefetch_online": (_of("C", "prefetch_online"), prefetch_table),
    "miss_breakdown": (_of("C", "prefetch_online"), miss_table),
    "predictor_quality": (_of("C", "predictor_quality"), quality_table),
    "routing": (_of("C", "routing"), routing_table),
    "train_loss": (_of("train"), train_table),
    "placement_sim": (_of("F", "placement_sim"), placement_sim_table),
    "multinode": (_of("F", "multinode"), multinode_table),
    "sync_ablation": (_of("C", "sync_ablation"), sync_table),
    "wire_ablation": (_of("F", "wire_ablation"), wire_table),
    "bench": (_of("bench"), bench_table),
    "suite": (_of("tests", "suite"), suite_table),
    "determinism": (_of("tests", "determinism"), determinism_table),
}


def make(recs, names=tuple(TABLES)) -> dict:
    """The tables `names` (default: every one) from the given raw records (name -> DataFrame),
    with the claims table last when every table it is made from is among them."""
    tables = {name: table([r for r in recs if wanted(r)]) for name, (wanted, table) in TABLES.items() if name in names}
    if set(SOURCES) <= set(tables):
        tables["claims"] = claims_table(tables)
    return tables


def claims(recs):
    """The claims table alone, from the given raw records (only the tables it is made from)."""
    return make(recs, SOURCES)["claims"]
