"""The device install's steps as MLX operations: a layer's map step, a prefetch's, the fill of the
slots they chose and the many-rows area. They run where the CUDA kernels (kernels.py) cannot (the
CPU, CI), and they are what the kernels are tested against (tests/test_devicemap.py,
tests/test_kernels.py)."""

import mlx.core as mx

from ..slots import mx_dtype
from .hosttier import HostTier
from .state import Fill, MapState

BIG = 1 << 40  # a used slot's LRU key: after every unused one


def _take(state: MapState, inds: mx.array, slots: int, demand: bool, protect_recent: bool = False):
    """What a demand and a prefetch step share: the distinct experts of `inds` (-1: ignored), those
    resident (their slots are used, and touched), the others given, in first-seen order, the least
    recently used slots no entry uses (a demand step takes them all; a prefetch only as many as
    there are), the map with them, and the fill list padded with a slot that keeps its bytes."""
    E, S, N = state.slot_of.shape[0], slots, inds.shape[0]
    M = min(N, S)
    pos = mx.arange(N, dtype=mx.int32)
    valid = inds >= 0
    e = mx.where(valid, inds, 0)
    cur = mx.where(valid, state.slot_of[e], -1)
    hit = cur >= 0
    first = mx.full((E + 1,), N, mx.int32).at[mx.where(valid, e, E)].minimum(pos)
    unique = valid & (first[e] == pos)
    miss = unique & ~hit
    slot_ids = mx.arange(S, dtype=mx.int64)
    hit_slots = mx.zeros((S + 1,), mx.int32).at[mx.where(hit, cur, S)].add(1)[:S] > 0
    used = hit_slots | (state.stamp == state.clock - 1) if protect_recent else hit_slots
    key = mx.where(used, BIG + slot_ids, state.stamp.astype(mx.int64) * S + slot_ids)
    order = mx.argsort(key).astype(mx.int32)
    rank = mx.cumsum(miss.astype(mx.int32)) - 1
    take = miss if demand else miss & (rank < S - used.astype(mx.int32).sum())
    n = take.astype(mx.int32).sum()
    victim = order[mx.clip(rank, 0, S - 1)]
    evicted = state.expert_in[victim]
    slot_of = mx.concatenate([state.slot_of, mx.array([-1], mx.int32)])
    slot_of[mx.where(take & (evicted >= 0), evicted, E)] = -1
    slot_of[mx.where(take, e, E)] = mx.where(take, victim, -1)
    expert_in = mx.concatenate([state.expert_in, mx.array([-1], mx.int32)])
    expert_in[mx.where(take, victim, S)] = e
    filled = mx.zeros((S + 1,), mx.int32).at[mx.where(take, victim, S)].add(1)[:S] > 0
    at = mx.where(take, rank, M)
    fill_e = mx.full((M + 1,), -1, mx.int32)
    fill_e[at] = e
    fill_s = mx.broadcast_to(order[mx.minimum(n, S - 1)], (M + 1,)).astype(mx.int32)
    fill_s[at] = victim
    return dict(
        e=e, valid=valid, uhit=unique & hit, used=used, filled=filled, n=n, slot_of=slot_of[:E],
        expert_in=expert_in[:S], stamp=mx.where(hit_slots | filled, state.clock, state.stamp),
        fill_e=fill_e[:M], fill_s=fill_s[:M],
    )  # fmt: skip


def _count(*figures):
    return mx.stack([mx.array(0, mx.int32) if f is None else f.astype(mx.int32) for f in figures])


def map_step_ops(state: MapState, inds: mx.array, slots: int) -> tuple:
    """One step of a layer's slot map (module docstring) as MLX operations. `inds` (N,) int32 are
    the router's experts, -1 for a pair this step ignores. Returns (new MapState, Fill)."""
    t = _take(state, inds, slots, demand=True)
    remapped = mx.where(t["valid"], t["slot_of"][t["e"]], 0).astype(mx.uint32)
    # a prefetched slot is useful if this step hits it, wasted otherwise; either way it is looked at
    pend = state.pending > 0
    useful, wasted = (pend & t["used"]).sum(), (pend & ~t["used"]).sum()
    counters = state.counters + _count(t["uhit"].sum(), t["n"], None, useful, wasted)
    new = MapState.of(t["slot_of"], t["expert_in"], t["stamp"], state.clock + 1, counters, mx.zeros_like(state.pending))
    return new, Fill(remapped, t["fill_e"], t["fill_s"], t["n"].reshape(1))


NO_REMAP = mx.zeros((1,), mx.uint32)  # a prefetch's Fill has no indices to pass on


def prefetch_step_ops(state: MapState, inds: mx.array, slots: int, protect_recent: bool = False) -> tuple:
    """A prefetch of the predicted experts `inds` (m,) int32 (-1: dropped) into this layer's map:
    those already resident are touched (so that the demand step finds them), each other one, in
    the order given (likeliest first), takes the least recently used slot not predicted here, as
    long as there is one, and is marked pending; a pending slot evicted this way is wasted.
    `protect_recent`: the slots the latest demand step used keep their experts too (a depth that
    wraps onto the layer being computed). The clock does not move: it counts demand steps."""
    t = _take(state, inds, slots, demand=False, protect_recent=protect_recent)
    wasted = ((state.pending > 0) & t["filled"]).sum()
    pending = mx.where(t["filled"], 1, state.pending).astype(mx.int32)
    counters = state.counters + _count(None, None, t["n"], None, wasted)
    new = MapState.of(t["slot_of"], t["expert_in"], t["stamp"], state.clock, counters, pending)
    return new, Fill(NO_REMAP, t["fill_e"], t["fill_s"], t["n"].reshape(1))


# -- the fill as MLX operations ---------------------------------------------------------------------
def fill_ops(tier: HostTier, layer: int, buffers, tensors, fill: Fill, source=None):
    """Copy the filled experts into their slots: one gather and one scatter per tensor; the padded
    entries write a slot's own bytes back. From the host tier's records, or with `source` from a
    many-rows area (one stack of every expert per tensor: area_ops)."""
    M = fill.experts.shape[0]
    real = mx.arange(M) < fill.count
    experts = mx.maximum(fill.experts, 0)
    rows = None if source is not None else tier.array[layer * tier.num_experts + experts]
    for i, (t, buf) in enumerate(zip(tensors, buffers)):
        if source is not None:
            vals = source[i][experts]
        else:
            vals = rows[:, t.offset : t.offset + t.nbytes].view(mx_dtype(t.dtype)).reshape(M, *t.shape)
        keep = buf[fill.slots]
        buf[fill.slots] = mx.where(real.reshape(M, *[1] * len(t.shape)), vals, keep)


def area_ops(tier: HostTier, layer: int, tensors) -> list:
    """A layer's many-rows area: every expert of `layer`, stacked in expert order per tensor (the
    arrays mlx-lm's SwitchGLU holds), gathered from the host tier."""
    E = tier.num_experts
    rows = tier.array[layer * E : (layer + 1) * E]
    return [rows[:, t.offset : t.offset + t.nbytes].view(mx_dtype(t.dtype)).reshape(E, *t.shape) for t in tensors]
