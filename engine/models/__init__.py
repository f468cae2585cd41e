"""Models: the registry, embedded builds and training."""
