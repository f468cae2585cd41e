"""Algorithm 2 and its baselines: hand-computed cases, capacities, determinism, scale; the
adaptive scheduler under a popularity shift."""

import numpy as np
import pytest

from engine.cluster import placement as pl
from engine.cluster.placement import SSD, Node


def nodes3(cap0=2, cap1=1, cap2=1):
    # unit costs: node 0 -> 1.0, node 1 -> 1.0 + 0.5 = 1.5, node 2 -> 0.8 + 0.1 = 0.9
    return [
        Node(cost=1.0, capacity=cap0),
        Node(cost=1.0, capacity=cap1, link=0.5),
        Node(cost=0.8, capacity=cap2, link=0.1),
    ]


PI = np.array([[0.4, 0.3, 0.2, 0.1]])


def test_hand_computed_case():
    p = pl.algorithm2(PI, nodes3(), expert_bytes=1)
    # e0 (0.4) -> node 2 (0.9), e1, e2 -> node 0 (1.0), node 0 full, e3 -> node 1 (1.5)
    assert p.node.tolist() == [[2, 0, 0, 1]]
    assert not p.replica.any()
    assert pl.expected_cost(p, PI, nodes3(), ssd=10.0) == pytest.approx(0.4 * 0.9 + 0.3 + 0.2 + 0.1 * 1.5)


def test_hot_set_replicated_on_node0_when_room():
    p = pl.algorithm2(PI, nodes3(cap0=4), expert_bytes=1, hot=1)
    assert p.node.tolist() == [[2, 0, 0, 0]]
    assert p.replica.tolist() == [[True, False, False, False]]  # e0 also on node 0
    assert p.executes_on().tolist() == [[0, 0, 0, 0]]
    none = pl.algorithm2(PI, nodes3(cap0=3), expert_bytes=1, hot=1)  # node 0 full: no replica
    assert not none.replica.any()


def test_unplaced_experts_fall_back_to_the_ssd_tier():
    p = pl.algorithm2(PI, nodes3(cap0=1, cap1=0, cap2=1), expert_bytes=1)
    assert p.node.tolist() == [[2, 0, SSD, SSD]]
    assert p.executes_on().tolist() == [[2, 0, SSD, SSD]]
    assert pl.expected_cost(p, PI, nodes3(), ssd=10.0) == pytest.approx(0.4 * 0.9 + 0.3 + (0.2 + 0.1) * 11.0)


@pytest.mark.parametrize("strategy", list(pl.STRATEGIES))
def test_capacity_never_exceeded(strategy):
    rng = np.random.default_rng(0)
    for _ in range(20):
        L, E, N = rng.integers(1, 5), rng.integers(4, 40), rng.integers(1, 5)
        pi = rng.dirichlet(np.ones(E) * 0.3, size=L)
        nodes = [
            Node(
                cost=float(rng.uniform(0.5, 2)),
                capacity=float(rng.integers(0, E) * 3),
                link=0.0 if n == 0 else float(rng.uniform(0, 1)),
            )
            for n in range(N)
        ]
        p = pl.STRATEGIES[strategy](pi, nodes, 3.0, hot=int(rng.integers(0, 5)))
        for used, node in zip(p.used_bytes(nodes, 3.0), nodes):
            assert used <= node.capacity
        placed = (p.node != SSD).sum()
        assert placed == min(L * E, sum(int(n.capacity // 3) for n in nodes)) or strategy == "node0_only"


def test_deterministic_including_ties():
    pi = np.full((3, 16), 1 / 16)  # every expert ties
    nodes = [Node(1.0, 10), Node(1.0, 10, 0.0), Node(1.0, 10, 0.0)]
    a, b = pl.algorithm2(pi, nodes, 1), pl.algorithm2(pi.copy(), list(nodes), 1)
    assert (a.node == b.node).all() and (a.replica == b.replica).all()
    # ties go to the lowest node index, then the order is (layer, expert)
    assert a.node.reshape(-1)[:10].tolist() == [0] * 10


@pytest.mark.timeout(120)
def test_large_input_within_the_complexity_bound():
    """L*E = 16,384 experts on 16 nodes: O(LE log LE + LE N) is about 0.3 M steps."""
    rng = np.random.default_rng(1)
    pi = rng.dirichlet(np.ones(256), size=64)
    nodes = [Node(float(rng.uniform(0.5, 2)), 1100, 0.0 if n == 0 else 0.3) for n in range(16)]
    p = pl.algorithm2(pi, nodes, 1.0, hot=64)
    assert (p.node != SSD).sum() == 64 * 256  # 17,600 slots of room for 16,384 experts


def test_algorithm2_beats_the_baselines_on_skewed_popularity():
    rng = np.random.default_rng(2)
    pi = rng.dirichlet(np.ones(64) * 0.2, size=8)
    nodes = [Node(1.0, 100), Node(0.6, 200, 0.2), Node(1.2, 200, 0.6)]
    costs = {k: pl.expected_cost(f(pi, nodes, 1.0), pi, nodes, ssd=5.0) for k, f in pl.STRATEGIES.items()}
    assert costs["algorithm2"] == min(costs.values())


def test_trace_cost_matches_expected_cost_on_its_own_popularity():
    rng = np.random.default_rng(3)
    experts = np.stack([np.sort(rng.choice(16, (200, 4), replace=True), axis=1) for _ in range(2)], 1)
    pi = pl.popularity_from(experts, 16)
    nodes = nodes3(cap0=10, cap1=10, cap2=10)
    p = pl.algorithm2(pi, nodes, 1.0)
    assert pl.trace_cost(p, experts, nodes, 5.0) == pytest.approx(pl.expected_cost(p, pi, nodes, 5.0))


def test_adaptive_beats_static_after_a_popularity_shift():
    rng = np.random.default_rng(4)
    L, E, T = 2, 16, 600

    def draw(offset):
        return np.stack(
            [np.stack([np.sort(offset + rng.choice(8, 2, replace=False)) for _ in range(T)]) for _ in range(L)], 1
        )

    before, after = draw(0), draw(8)
    nodes = [Node(1.0, 8), Node(1.0, 100, 2.0)]  # node 0 holds a quarter; remote costs more
    prior = pl.popularity_from(before, E)
    static = pl.algorithm2(prior, nodes, 1.0)
    static_cost = pl.trace_cost(static, after, nodes, 5.0)
    adapt = pl.adaptive(after, E, nodes, 1.0, 5.0, prior, every=32)
    assert adapt["cost_per_token"] < static_cost
    assert adapt["moves"] > 0
