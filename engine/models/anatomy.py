"""A model's anatomy as the engine sees it: its MoE blocks (found by type, wherever the
architecture keeps them), their per-expert tensors, and the experts a token routes to. What the
store lays out, the runtime installs and the registry checks; it knows mlx-lm's model classes and
nothing of files."""

from dataclasses import dataclass

import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import _get_classes

# The expert containers of mlx-lm's MoE blocks: every per-expert tensor lives in one of these.
SWITCHES = (SwitchGLU, SwitchMLP)


class ModelError(ValueError):
    """A model whose MoE blocks the engine cannot offload."""


@dataclass
class MoEBlock:
    """One switch module of a model: where it sits, and the parent attribute that holds it."""

    layer: int  # the transformer layer's index
    path: str  # e.g. "model.layers.3.mlp.switch_mlp"
    parent: object
    attr: str
    switch: object


def _child(module, key):
    return module[int(key)] if isinstance(module, list) else getattr(module, key)


def moe_blocks(model, kinds=SWITCHES) -> list:
    """Every SwitchGLU/SwitchMLP (or module of `kinds`) of an mlx-lm model, in layer order: what
    the engine offloads. Found by type, wherever the architecture keeps it (`mlp.switch_mlp`,
    `mlp.experts`, `block_sparse_moe.switch_mlp`, `feed_forward.experts`, ...)."""
    out = []
    for path, mod in sorted(model.named_modules(), key=lambda p: p[0]):
        if not isinstance(mod, kinds) or any(path.startswith(b.path + ".") for b in out):
            continue
        parts = path.split(".")
        numbers = [int(p) for p in parts if p.isdigit()]
        if not numbers:
            raise ModelError(f"a switch module outside the model's layers ({path}): not offloadable")
        layer = numbers[0]  # its index in the model's list of layers (`layers`, `h`, ...)
        parent = model
        for key in parts[:-1]:
            parent = _child(parent, key)
        out.append(MoEBlock(layer, path, parent, parts[-1], mod))
    return sorted(out, key=lambda b: (b.layer, b.path))


def moe_layers(model) -> list:
    """(transformer layer index, switch module) of every MoE block."""
    return [(b.layer, b.switch) for b in moe_blocks(model)]


# What architectures call the number of experts a token routes to.
TOP_K_NAMES = (
    "top_k",
    "num_experts_per_tok",
    "n_activated_experts",
    "moe_topk",
    "num_activated_experts",
    "experts_per_token",
    "topk",
    "num_experts_per_token",
    "moe_top_k",
    "moe_k",
    "top_k_experts",
)


def top_k_of(model, block) -> int | None:
    """Experts per token, as the MoE block, the modules above it or the model's arguments name
    it (None: not said anywhere)."""
    owners, module = [block.parent], model
    for key in block.path.split(".")[:-1]:
        owners.append(module)
        module = module[int(key)] if isinstance(module, list) else getattr(module, key, None)
    for owner in reversed(owners + [block.parent]):
        for candidate in (owner, getattr(owner, "args", None), getattr(owner, "config", None)):
            for source in (candidate, getattr(candidate, "text_config", None)):
                if source is None:
                    continue
                for name in TOP_K_NAMES:
                    plain = isinstance(source, dict) and not isinstance(source, nn.Module)  # modules are dicts too
                    v = source.get(name) if plain else getattr(source, name, None)
                    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                        return v
    return None


def expert_params(switch) -> list:
    """(name, array) of every per-expert tensor of a switch module, in the module's own order;
    each has the experts as its first dimension."""
    params = tree_flatten(switch.parameters())
    experts = params[0][1].shape[0]
    for name, a in params:
        if a.ndim < 1 or a.shape[0] != experts:
            raise ModelError(f"switch tensor {name} {tuple(a.shape)} is not per expert (first dimension {experts})")
    return params


def get_param(module, name: str):
    owner, _, leaf = name.rpartition(".")
    for key in owner.split(".") if owner else ():
        module = _child(module, key)
    return module[leaf]


def set_param(module, name: str, value):
    owner, _, leaf = name.rpartition(".")
    for key in owner.split(".") if owner else ():
        module = _child(module, key)
    module[leaf] = value


def model_classes(config: dict):
    """mlx-lm's model class and arguments class for a config (its `model_type`, remapped as
    mlx-lm remaps it), to build a model with no weights on disk (an embedded build, training).

    mlx-lm 0.32.2 has no public function for this: `mlx_lm.utils.load_model` (public) needs a
    model folder with weights, and its `get_model_classes` parameter defaults to the private
    `_get_classes`, which this calls. The one place the engine uses a private mlx-lm function."""
    return _get_classes(config)
