"""Placement of experts on nodes (Algorithm 2 of the paper), its baselines, an evaluator of
expected per-step cost on traces, and an adaptive scheduler that re-estimates popularity and
node costs online.

Units: a node's cost `c_n` and link cost `rho_0n` are per expert execution (e.g. ms); an
expert executed from node 0's slot table after a miss costs `c_0 + ssd` (the SSD tier).
Capacities `M_n` are in bytes; every expert has the same size `b`.
"""

from dataclasses import dataclass, field

import numpy as np

SSD = -1  # "placed nowhere": node 0's slot table, demand loading from the SSD tier


@dataclass(frozen=True)
class Node:
    cost: float  # c_n: cost of executing one expert there
    capacity: float  # M_n: bytes of expert memory
    link: float = 0.0  # rho_0n: cost of a round trip from node 0 (0 for node 0 itself)


@dataclass
class Placement:
    """Where each (layer, expert) runs: `node[l, e]` is a node index or SSD; `replica[l, e]`
    marks a hot-set copy on node 0 (it then runs on node 0)."""

    node: np.ndarray
    replica: np.ndarray
    name: str = "algorithm2"
    meta: dict = field(default_factory=dict)

    def executes_on(self) -> np.ndarray:
        """Where each expert actually runs: node 0 for replicas, else its node (SSD: node 0)."""
        out = self.node.copy()
        out[self.replica] = 0
        return out

    def used_bytes(self, nodes, expert_bytes) -> list:
        used = [float(np.sum(self.node == n)) * expert_bytes for n in range(len(nodes))]
        used[0] += float(np.sum(self.replica & (self.node != 0))) * expert_bytes
        return used


def unit_costs(nodes, ssd: float) -> np.ndarray:
    """Per-execution cost by location: index n for node n, index -1 (SSD) last."""
    return np.array([n.cost + (n.link if i else 0.0) for i, n in enumerate(nodes)] + [nodes[0].cost + ssd])


def algorithm2(popularity: np.ndarray, nodes, expert_bytes: float, hot: int = 0) -> Placement:
    """Algorithm 2: experts by descending popularity, each to the node with room minimising
    (c_n + [n != 0] rho_0n) * pi_e; the `hot` most popular replicated on node 0 if room allows;
    the rest fall back to node 0's slot table. O(LE log LE + LE N), deterministic."""
    L, E = popularity.shape
    flat = popularity.reshape(-1)
    # descending popularity; ties by (layer, expert) so that the order is total
    order = np.lexsort((np.arange(L * E), -flat))
    free = np.array([n.capacity for n in nodes], dtype=float)
    unit = np.array([n.cost + (n.link if i else 0.0) for i, n in enumerate(nodes)])
    node = np.full(L * E, SSD, np.int64)
    for idx in order:
        best, best_cost = SSD, None
        for n in range(len(nodes)):
            if free[n] >= expert_bytes:
                c = unit[n] * flat[idx]
                if best_cost is None or c < best_cost:
                    best, best_cost = n, c
        if best == SSD:
            continue
        node[idx] = best
        free[best] -= expert_bytes
    replica = np.zeros(L * E, bool)
    for idx in order[:hot]:
        if node[idx] != 0 and free[0] >= expert_bytes:
            replica[idx] = True
            free[0] -= expert_bytes
    return Placement(node.reshape(L, E), replica.reshape(L, E), "algorithm2", {"hot": hot})


def node0_only(popularity, nodes, expert_bytes, hot=0) -> Placement:
    """Baseline: everything served by node 0 (its memory holds the most popular; the rest
    are demand-loaded from the SSD tier)."""
    p = algorithm2(popularity, nodes[:1], expert_bytes)
    return Placement(p.node, p.replica, "node0_only")


def round_robin(popularity, nodes, expert_bytes, hot=0) -> Placement:
    """Baseline: expert (l, e) to node (l*E + e) mod N, the next node with room, or the SSD."""
    L, E = popularity.shape
    free = np.array([n.capacity for n in nodes], dtype=float)
    node = np.full(L * E, SSD, np.int64)
    for idx in range(L * E):
        for k in range(len(nodes)):
            n = (idx + k) % len(nodes)
            if free[n] >= expert_bytes:
                node[idx] = n
                free[n] -= expert_bytes
                break
    return Placement(node.reshape(L, E), np.zeros((L, E), bool), "round_robin")


def popularity_only(popularity, nodes, expert_bytes, hot=0) -> Placement:
    """Baseline: by descending popularity to the node with the most room, ignoring costs."""
    L, E = popularity.shape
    flat = popularity.reshape(-1)
    order = np.lexsort((np.arange(L * E), -flat))
    free = np.array([n.capacity for n in nodes], dtype=float)
    node = np.full(L * E, SSD, np.int64)
    for idx in order:
        n = int(np.argmax(free))
        if free[n] >= expert_bytes:
            node[idx] = n
            free[n] -= expert_bytes
    return Placement(node.reshape(L, E), np.zeros((L, E), bool), "popularity_only")


STRATEGIES = {
    "algorithm2": algorithm2,
    "node0_only": node0_only,
    "round_robin": round_robin,
    "popularity_only": popularity_only,
}


def popularity_from(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """pi[l, e]: the share of tokens whose layer-l experts include e, from (T, L, K) traces."""
    T, L, _ = experts.shape
    pi = np.zeros((L, num_experts))
    for l in range(L):
        pi[l] = np.bincount(experts[:, l].reshape(-1).astype(np.int64), minlength=num_experts) / T
    return pi


def expected_cost(placement: Placement, popularity: np.ndarray, nodes, ssd: float) -> float:
    """Expected per-step (per token) cost: sum over (l, e) of pi[l, e] * unit cost of where it runs."""
    unit = unit_costs(nodes, ssd)
    return float(np.sum(popularity * unit[placement.executes_on()]))


def trace_cost(placement: Placement, experts: np.ndarray, nodes, ssd: float) -> float:
    """Mean per-token cost of a placement replayed on (T, L, K) traces."""
    unit = unit_costs(nodes, ssd)
    where = placement.executes_on()
    L = experts.shape[1]
    per_token = unit[where[np.arange(L)[None, :, None], experts.astype(np.int64)]].sum(axis=(1, 2))
    return float(per_token.mean())


def adaptive(
    experts: np.ndarray,
    num_experts: int,
    nodes,
    expert_bytes: float,
    ssd: float,
    prior: np.ndarray,
    every: int = 32,
    decay: float = 0.9,
    hot: int = 0,
    move_cost: float = 0.0,
    observed_nodes=None,
) -> dict:
    """The adaptive scheduler, replayed on a trace: starts from Algorithm 2 on the prior
    popularity; every `every` tokens re-estimates popularity (an exponential moving average of
    what it saw) and node costs (`observed_nodes`, e.g. measured round trips, if given), re-runs
    Algorithm 2 and moves the experts whose node changed (`move_cost` each)."""
    T, L, _ = experts.shape
    est = prior.copy()
    place = algorithm2(est, nodes, expert_bytes, hot)
    unit = unit_costs(nodes, ssd)
    total, moves = 0.0, 0
    for start in range(0, T, every):
        chunk = experts[start : start + every]
        where = place.executes_on()
        total += unit[where[np.arange(L)[None, :, None], chunk.astype(np.int64)]].sum()
        seen = popularity_from(chunk, num_experts)
        est = decay * est + (1 - decay) * seen
        cur_nodes = observed_nodes if observed_nodes is not None else nodes
        new = algorithm2(est, cur_nodes, expert_bytes, hot)
        moved = int(np.sum(new.node != place.node))
        moves += moved
        total += moved * move_cost
        place, unit = new, unit_costs(cur_nodes, ssd)
    return dict(cost_per_token=total / T, moves=moves, placement=place)
