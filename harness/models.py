"""What the workflow asks of the registered models, through the harness (the workflow never
imports the engine itself): each model's spec, shape and, for a real one, whether its weights are
here."""

from engine.models.registry import RegistryError, get_spec, load_registry, real_model_dir, shape

__all__ = ["RegistryError", "get_spec", "load_registry", "real_model_dir", "shape"]
