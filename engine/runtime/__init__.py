"""The decode path: expert store, slot tables, staging, Algorithm 1, prefetching, the engine and its loop."""
