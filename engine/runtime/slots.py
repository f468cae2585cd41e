"""Slot tables: per MoE layer, one stacked buffer of S slots for each expert tensor.

The buffers are the very arrays mlx-lm's `gather_qmm` reads (the engine points the model's
SwitchGLU at them), so a resident expert is computed on exactly the bytes mlx-lm would use.

Where a read lands in a table is its install's (engine.runtime.installs): with `host_views` (the
`inplace` install) the store's `preadv` lands straight in a slot's memory through a writable view
of the evaluated MLX buffer, safe because a slot is only written at a layer's host
synchronisation, when no pending MLX work reads this layer's buffers; otherwise no host view is
ever taken (on a GPU it would move the buffers out of device memory for good) and the install
writes slots with MLX operations (`install_arrays`, `install_batch`).
"""

import heapq
from collections import OrderedDict

import mlx.core as mx
import numpy as np

from ..device import device_indices


class LRU:
    """Evict the least recently used expert."""

    def __init__(self, slots: int):
        self._order = OrderedDict()

    def touch(self, expert: int):
        self._order[expert] = None
        self._order.move_to_end(expert)

    def remove(self, expert: int):
        self._order.pop(expert, None)

    def hint(self, predicted):
        pass

    def victim(self, protected) -> int:
        for e in self._order:
            if e not in protected:
                return e
        raise RuntimeError("every resident expert is protected: no slot can be evicted")


class LFU(LRU):
    """Evict the least frequently used expert (uses counted since it became resident);
    ties go to the least recently used."""

    def __init__(self, slots: int):
        super().__init__(slots)
        self._uses = {}

    def touch(self, expert: int):
        super().touch(expert)
        self._uses[expert] = self._uses.get(expert, 0) + 1

    def remove(self, expert: int):
        super().remove(expert)
        self._uses.pop(expert, None)

    def victim(self, protected) -> int:
        best, best_uses = None, None
        for e in self._order:  # least recent first, so the first minimum wins ties
            if e not in protected and (best_uses is None or self._uses[e] < best_uses):
                best, best_uses = e, self._uses[e]
        if best is None:
            raise RuntimeError("every resident expert is protected: no slot can be evicted")
        return best


class LRUPredicted(LRU):
    """LRU that spares the experts the predictor last named for this layer, while any other
    expert can go."""

    def __init__(self, slots: int):
        super().__init__(slots)
        self._predicted = frozenset()

    def hint(self, predicted):
        self._predicted = frozenset(int(e) for e in predicted)

    def victim(self, protected) -> int:
        try:
            return super().victim(set(protected) | self._predicted)
        except RuntimeError:
            return super().victim(protected)


POLICIES = {"lru": LRU, "lfu": LFU, "lru-predicted": LRUPredicted}


def make_policy(name: str, slots: int):
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(sorted(POLICIES))}")
    return POLICIES[name](slots)


def mx_dtype(name: str):

    return getattr(mx, name)


def address(a) -> int:
    """The address of an evaluated MLX array's first byte."""
    return np.frombuffer(memoryview(a).cast("B"), np.uint8).ctypes.data


# MLX's dimensions are 32-bit: an allocation of this many elements or more cannot be one flat array.
FLAT_LIMIT = 1 << 31


def aligned_zeros(shape, dtype, align=4096):
    """A zeroed MLX array whose data starts on an `align`-byte boundary.

    MLX's CPU allocator returns memory at 24 mod 4096; the kernel's copy from the page cache
    into such cache-line-misaligned memory ran 4.5x slower than into aligned memory on this
    machine (AMD EPYC, `rep movsb`). So allocate a little more and keep an aligned view:
    MLX slices and reshapes of contiguous data share the buffer.

    Past `FLAT_LIMIT` elements (a host tier of more than 2 GiB of experts) no flat array exists
    to slice, so the view is of rows padded by `align` bytes: each row (along the first
    dimension) is contiguous and starts aligned where a row's bytes are a multiple of `align`,
    and the whole is strided (read it on the host with `host_view`).
    """

    n = int(np.prod(shape))
    item = dtype.size
    if n + align // item >= FLAT_LIMIT:
        inner = n // shape[0]
        big = mx.zeros((shape[0], inner + align // item), dtype=dtype)
        mx.eval(big)
        pad = ((-address(big)) % align) // item
        buf = big[:, pad : pad + inner].reshape(shape)
        mx.eval(buf)
        return buf
    big = mx.zeros((n + align // item,), dtype=dtype)
    mx.eval(big)
    pad = ((-address(big)) % align) // item
    buf = big[pad : pad + n].reshape(shape)
    mx.eval(buf)
    return buf


def host_view(a) -> np.ndarray:
    """A NumPy view of an evaluated MLX array's memory, its shape and strides (writes reach it)."""
    return np.asarray(memoryview(a))


class SlotTable:
    """S slots for one MoE layer, the map expert -> slot, an eviction policy and counters."""

    def __init__(self, layer: int, num_experts: int, slots: int, tensors, policy="lru", host_views=True):
        if not 1 <= slots <= num_experts:
            raise ValueError(f"slots must be between 1 and {num_experts}, not {slots}")
        self.layer = layer
        self.num_experts = num_experts
        self.slots = slots
        self.tensors = list(tensors)
        self.host_views = host_views
        if host_views:
            self.buffers = [aligned_zeros((slots, *t.shape), mx_dtype(t.dtype)) for t in self.tensors]
            # Writable byte views of the evaluated buffers; valid as long as no op replaces them.
            self._rows = [memoryview(b).cast("B") for b in self.buffers]
            # Each slot's views, made once: a prefetch asks for them at every issue.
            self._dests = [
                tuple(row[s * t.nbytes : (s + 1) * t.nbytes] for row, t in zip(self._rows, self.tensors))
                for s in range(slots)
            ]
        else:
            self.buffers = [mx.zeros((slots, *t.shape), mx_dtype(t.dtype)) for t in self.tensors]
            mx.eval(self.buffers)
            self._rows = None
        self.slot_of = np.full(num_experts, -1, np.int64)
        self.expert_in = np.full(slots, -1, np.int64)
        self._free = list(range(slots))  # a heap: the lowest free slot is taken first
        self.policy = make_policy(policy, slots)
        self.policy_name = policy
        self.hits = self.misses = self.evictions = self.bytes_read = 0

    @property
    def full(self) -> bool:
        """Every expert has its own slot: slot e holds expert e and no remapping is needed."""
        return self.slots == self.num_experts

    def resident(self, expert: int) -> bool:
        return self.slot_of[expert] >= 0

    def dests(self, slot: int) -> tuple:
        """Writable views of one slot's tensors, in store order (for one `preadv`)."""
        if self._rows is None:
            raise RuntimeError(f"MoE layer {self.layer}: a table without host views takes no direct writes")
        return self._dests[slot]

    def touch(self, experts):
        for e in experts:
            self.policy.touch(int(e))

    def hint(self, predicted):
        """The experts the predictor expects here next (for policies that spare them)."""
        self.policy.hint(predicted)

    def claim(self, expert: int, protected=()) -> int:
        """Map `expert` to a free slot, or evict the policy's victim outside `protected`."""
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            victim = self.policy.victim(protected)
            slot = int(self.slot_of[victim])
            self.slot_of[victim] = -1
            self.policy.remove(victim)
            self.evictions += 1
        self.slot_of[expert] = slot
        self.expert_in[slot] = expert
        self.policy.touch(expert)
        return slot

    def release(self, expert: int):
        """Forget an expert whose bytes never arrived (a failed read)."""
        slot = int(self.slot_of[expert])
        if slot >= 0:
            self.expert_in[slot] = -1
            self.slot_of[expert] = -1
            self.policy.remove(expert)
            heapq.heappush(self._free, slot)

    def install_arrays(self, slot: int, arrays):
        """Write MLX arrays (made in this thread) into a slot, lazily."""
        if self._rows is not None:
            raise RuntimeError(f"MoE layer {self.layer}: install_arrays on a table with host views")
        for buf, a in zip(self.buffers, arrays):
            buf[slot] = a

    def install_batch(self, slots, stacked):
        """Write a batch of experts, one stacked (n, *shape) array per tensor, into `slots`:
        one scatter per tensor, lazily (MLX donates the buffer, so the write is in place)."""
        if self._rows is not None:
            raise RuntimeError(f"MoE layer {self.layer}: install_batch on a table with host views")

        idx = device_indices(slots)
        for buf, a in zip(self.buffers, stacked):
            buf[idx] = a

    def slot_indices(self, indices: np.ndarray) -> np.ndarray:
        """The router's expert indices remapped to slots; every expert must be resident."""
        slots = self.slot_of[indices]
        if (slots < 0).any():
            missing = sorted(set(indices[slots < 0].tolist()))
            raise RuntimeError(f"MoE layer {self.layer}: experts {missing} are not resident")
        return slots.astype(np.uint32)  # for the device through device_indices

    def counters(self) -> dict:
        return dict(hits=self.hits, misses=self.misses, evictions=self.evictions, bytes_read=self.bytes_read)
