"""A memory budget instead of a slot count: `--memory 8GB` works out how many experts per MoE layer
fit beside everything else the engine needs, from the model's own sizes.

The budget holds: the weights that are not experts (attention, norms, routers, embeddings,
shared experts, dense layers: all of them read from the lazily loaded model), the KV cache for
the requested context (from the model's attention shapes), the buffers reads go through (host
records in copy mode, the staging pool in pinned mode), the many-rows area (where a prompt's rows
meet a layer's experts: one layer's worth, two for the device install), a margin for activations
and MLX's temporaries, and then S slots of every MoE layer's experts, the same S in every layer. A budget
that cannot hold the fixed part plus top-k slots per layer is refused, naming what it needed.
"""

import re
from dataclasses import dataclass

from mlx.utils import tree_flatten

from .models.anatomy import expert_params, moe_blocks

# The memory of the cards people decode on, in GB (a plan for a card: `python -m engine plan --cuda`)
CARDS_GB = (8, 12, 16, 24, 32, 48, 80)

UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """'8GB', '512MiB', '3.5g', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"not a size: {text!r} (say e.g. 8GB, 512MiB or a number of bytes)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def fmt(n: float) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


@dataclass
class Plan:
    budget: int
    slots: int
    experts: int
    top_k: int
    moe_layers: int
    expert_bytes: int
    weights: int  # everything that is not an expert
    kv_cache: int
    buffers: int
    area: int  # the many-rows area (engine.runtime.moe)
    margin: int
    install: str = ""  # the install it was planned for
    least: int = 0  # the smallest budget that decodes with this install: top-k experts a layer resident

    @property
    def tables(self) -> int:
        return self.slots * self.moe_layers * self.expert_bytes

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.buffers + self.area + self.margin + self.tables

    def describe(self) -> str:
        return (
            f"memory budget {fmt(self.budget)}: {self.slots} of {self.experts} experts per MoE layer "
            f"({self.moe_layers} layers x {fmt(self.expert_bytes)} per expert = {fmt(self.tables)}), beside "
            f"weights {fmt(self.weights)}, KV cache {fmt(self.kv_cache)}, read buffers {fmt(self.buffers)}, "
            f"many-rows area {fmt(self.area)}, margin {fmt(self.margin)}: {fmt(self.total)} in all"
            + (f" (install {self.install})" if self.install else "")
        )


def _args(model):
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    return [a for a in (text, args) if a is not None]


def _arg(model, *names):
    for a in _args(model):
        for n in names:
            v = a.get(n) if isinstance(a, dict) else getattr(a, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def kv_cache_bytes(model, context: int) -> int:
    """Keys and values of `context` tokens in every layer: 2 x kv heads x head dim per token and
    layer, in the model's dtype; where the model does not say, its hidden size twice over."""
    layers = len(model.layers)
    hidden = _arg(model, "hidden_size", "model_dim", "d_model") or 4096
    heads = _arg(model, "num_attention_heads", "num_heads", "n_heads") or 1
    kv_heads = _arg(model, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _arg(model, "head_dim") or hidden // heads
    dtype_size = next((a.dtype.size for _, a in tree_flatten(model.parameters()) if a.dtype.size >= 2), 2)
    return int(2 * kv_heads * head_dim * dtype_size * context * layers)


def host_tier_bytes(model) -> int:
    """What the device install's host tier of `model` takes: every expert, in page-aligned records."""
    blocks = moe_blocks(model)
    per_layer = [expert_params(b.switch) for b in blocks]
    experts = sum(p[0][1].shape[0] for p in per_layer)
    expert_bytes = max(sum(a.nbytes for _, a in p) // p[0][1].shape[0] for p in per_layer)
    return experts * (-(-expert_bytes // 4096) * 4096)


def _margin(weights: int, kv: int) -> int:
    return max(2 << 20, (weights + kv) // 10)  # activations and MLX's temporaries


def weight_bytes(model) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def resident_bytes(model, context: int = 4096) -> int:
    """What decoding with every expert in memory takes (mlx-lm's own model, no engine): all the
    weights, the KV cache for `context` tokens and the same margin a plan keeps."""
    total = weight_bytes(model)
    kv = kv_cache_bytes(model, context)
    experts = sum(a.nbytes for b in moe_blocks(model) for _, a in expert_params(b.switch))
    return total + kv + _margin(total - experts, kv)


def plan(model, budget: int, top_k: int, install, context: int = 4096, readers: int = 4,
         staging_records: int = 64) -> Plan:  # fmt: skip
    """The largest S, the same in every MoE layer, whose engine fits in `budget` bytes with
    `install` (an install class, engine.runtime.installs: its buffers and area)."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("the model has no MoE layer: a memory budget has no experts to offload")
    per_layer = [expert_params(b.switch) for b in blocks]
    experts = per_layer[0][0][1].shape[0]
    expert_bytes = max(sum(a.nbytes for _, a in p) // experts for p in per_layer)
    expert_total = sum(a.nbytes for p in per_layer for _, a in p)
    weights = sum(a.nbytes for _, a in tree_flatten(model.parameters())) - expert_total
    kv = kv_cache_bytes(model, context)
    record = -(-expert_bytes // 4096) * 4096
    buffers = install.buffer_bytes(record, readers, staging_records)
    area = install.area_bytes(experts, expert_bytes)
    margin = _margin(weights, kv)
    fixed = weights + kv + buffers + margin
    room = budget - fixed - area
    slots = min(experts, room // (len(blocks) * expert_bytes)) if room > 0 else 0
    if budget - fixed >= experts * len(blocks) * expert_bytes:  # every expert fits, and then needs no area
        slots = experts
    need = fixed + area + top_k * len(blocks) * expert_bytes
    if slots == experts:  # every expert resident: no many-rows call, no area
        area = 0
    p = Plan(budget, int(slots), experts, top_k, len(blocks), expert_bytes, weights, kv, buffers, area, margin,
             install.name, need)  # fmt: skip
    if slots < top_k:
        raise ValueError(
            f"--memory {fmt(budget)} cannot hold this model: the part that is not experts takes {fmt(fixed + area)} "
            f"(weights {fmt(weights)}, KV cache for {context} tokens {fmt(kv)}, read buffers {fmt(buffers)}, "
            f"the many-rows area {fmt(area)} for the {install.name} install, margin {fmt(margin)}) and every "
            f"token needs its top-{top_k} experts resident in each of {len(blocks)} MoE layers: at least {fmt(need)}"
        )
    return p
