"""A layer's slot map on the device (`MapState`) and what a map step hands the fill (`Fill`)."""

import functools

import mlx.core as mx
import numpy as np

COUNTERS = ("hits", "misses", "issued", "useful", "wasted")
STEP_FIGURES = ("hits", "misses", "bytes_read", "issued", "useful", "wasted")


def _view(name: str):
    """A MapState field: a view of its block, made when first asked for."""
    return functools.cached_property(lambda self: self.part(name))


class MapState:
    """One layer's slot map on the device, as one int32 array (`block`), so that a step kernel reads
    and writes it as one input and one output: on the H200 each of a kernel's arrays is host work
    at every launch, an output about 2 µs (scripts/probe_launch_cost.py). In order:

    - slot_of (E,): the slot of each expert, -1 if not resident;
    - expert_in (S,): the expert in each slot, -1 if empty;
    - stamp (S,): the step each slot was last used at, -1 if never;
    - pending (S,): 1 where a prefetch filled the slot and no demand step has looked yet;
    - clock (1,): this layer's demand step count;
    - counters (len(COUNTERS),);
    - the last kernel step's fill list: experts (S,), slots (S,), count (1,) (unused by the
      operations, which keep theirs apart; never read by a step).

    Each field is a view of the block, made when first asked for."""

    FIELDS = ("slot_of", "expert_in", "stamp", "clock", "counters", "pending")

    def __init__(self, block: mx.array, experts: int, slots: int):
        self.block, self.E, self.S = block, experts, slots

    @staticmethod
    @functools.cache
    def layout(experts: int, slots: int) -> dict:
        """Each part's (start, length) in the block, in the block's order."""
        sizes = dict(slot_of=experts, expert_in=slots, stamp=slots, pending=slots, clock=1)
        sizes.update(counters=len(COUNTERS), fill_e=slots, fill_s=slots, count=1)
        starts = np.cumsum([0, *sizes.values()])
        return {n: (int(a), n_) for (n, n_), a in zip(sizes.items(), starts)}

    def part(self, name: str, length: int | None = None) -> mx.array:
        at, n = self.layout(self.E, self.S)[name]
        return self.block[at : at + (n if length is None else length)]

    slot_of, expert_in, stamp = _view("slot_of"), _view("expert_in"), _view("stamp")
    clock, counters, pending = _view("clock"), _view("counters"), _view("pending")

    @classmethod
    def of(cls, slot_of, expert_in, stamp, clock, counters, pending):
        """A map from its fields (the operations' way: one concatenation)."""
        E, S = slot_of.shape[0], expert_in.shape[0]
        parts = [slot_of, expert_in, stamp, pending, clock, counters, mx.zeros((2 * S + 1,), mx.int32)]
        return cls(mx.concatenate([p.astype(mx.int32) for p in parts]), E, S)

    @classmethod
    def empty(cls, experts: int, slots: int):
        E, S = experts, slots
        s = cls.of(
            mx.full((E,), -1, mx.int32), mx.full((S,), -1, mx.int32), mx.full((S,), -1, mx.int32),
            mx.zeros((1,), mx.int32), mx.zeros((len(COUNTERS),), mx.int32), mx.zeros((S,), mx.int32),
        )  # fmt: skip
        mx.eval(s.block)
        return s

    def without_counts(self) -> "MapState":
        """The same map with its counters at zero."""
        return MapState.of(*(mx.zeros_like(f) if n == "counters" else f for n, f in zip(self.FIELDS, self.fields())))

    def arrays(self) -> list:
        """What there is to evaluate or read: the block."""
        return [self.block]

    def fields(self) -> list:
        return [getattr(self, n) for n in self.FIELDS]


class Fill:
    """A map step's result: the router's indices remapped to slots, and the (expert, slot) pairs
    to fill (the first `count` are real; the rest point at a slot that keeps its bytes). A step
    kernel's fill list lives in its map's block (`packed`: that MapState and the list's length),
    viewed when asked for."""

    def __init__(self, remapped, experts=None, slots=None, count=None, packed=None):
        self.remapped = remapped  # (N,) uint32, or the router's shape from a kernel
        self._lists, self._packed = (experts, slots, count), packed

    def _part(self, i: int, name: str):
        if self._packed is None:
            return self._lists[i]
        state, m = self._packed
        return state.part(name, m if name != "count" else 1)

    @functools.cached_property
    def experts(self):  # (M,) int32, M = min(N, S)
        return self._part(0, "fill_e")

    @functools.cached_property
    def slots(self):  # (M,) int32
        return self._part(1, "fill_s")

    @functools.cached_property
    def count(self):  # (1,) int32
        return self._part(2, "count")
