"""Several machines: Algorithm 2 placement, the multi-node protocol and node, and its launcher."""
