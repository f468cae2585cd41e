"""Prefetching: the hooks Algorithm 1 calls at every MoE layer's host synchronisation.

`ExpertCache.ensure(l, U)` calls `drain(l, U)` (line 12: install finished prefetches, wait for
in-flight experts of U) and then `predict_and_issue(l, U, hidden)` (line 13: predict layer
l+d's experts and issue their reads) before the layer's misses are read and its kernels are
dispatched.
"""


class NoPrefetch:
    """Demand loading only: every hook does nothing."""

    depth = 0

    def drain(self, layer, experts, cache):
        pass

    def predict_and_issue(self, layer, experts, hidden, cache):
        pass

    def close(self):
        pass

    def counters(self) -> dict:
        return {}
