"""The `device` install: a decode step with no host synchronisation inside it.

Algorithm 1 reads each MoE layer's routed experts back to the host to find its misses, and on a
GPU that round trip, sixteen times a token, costs more than the misses themselves (issue 29:
the offloaded H200 decode ran at a fifth of resident decoding while a probe of reads driven from
the device reached 0.92 of it). Here the host never looks:

- every expert sits in the *host tier* (engine.runtime.hosttier): mapped pinned host memory;
- each layer keeps its *slot map* on the device: expert -> slot, slot -> expert, a last-use stamp
  per slot, a step clock and counters (`MapState`, one int32 array);
- a *map step* takes the router's indices as they are on the device (static shape, rows x top-k),
  keeps hits in their slots, gives each miss the least recently used slot this step does not use,
  and returns the indices remapped to slots and the list of (expert, slot) to fill;
- a *fill* copies the missed records from the host tier into those slots;
- mlx-lm's own SwitchGLU then computes over the slot tables with the remapped indices: the same
  call, in the same shapes, on the same bytes as mlx-lm's, so the logits are mlx-lm's bit for bit.

All of it is lazy MLX work in the token's graph, queued like mlx-lm's own `generate_step` queues
a resident model's; counters stay on the device until asked for.

Two implementations of the map step and the fill, chosen per `DeviceCache(mode=...)`:
- `kernel` (a CUDA GPU): one `mx.fast.cuda_kernel` a layer and token (`step_kernel`), which runs
  the layer's map step, and the prefetch step of the layer it predicts for when one rides along,
  then copies the records to fill across PCIe straight into the slot tables' memory: MLX cannot
  name an existing array as a kernel's output, so the tables are the kernel's inputs and it writes
  through their pointers, handed to it at every launch (a table's memory can move: a host read of
  it moves it to managed memory). Only the misses' bytes move.
- `ops` (the CPU, CI, and a fallback on a GPU): the same algorithm as MLX operations, and the fill
  as a gather from the host tier and one scatter per tensor (padded entries rewrite a slot with its
  own bytes). Tests check the two give the same maps on a GPU and the ops against a NumPy model of
  the algorithm on the CPU, and the kernels on emulated CUDA threads against the ops on the CPU
  (tests/test_kernels.py).

A prefill whose rows route to more experts than S cannot be planned without knowing them: it reads
the indices back once per layer (a prefill is one call per prompt) and computes in the expert
batches of `moe.prefill_calls`, each through the same map step and fill.
"""

import contextlib
import functools
import threading
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import device
from ..models.anatomy import set_param
from . import hosttier
from .hosttier import HostTier
from .moe import OffloadedSwitch, StepStats, prefill_calls
from .slots import device_indices, mx_dtype
from .staging import GRID_STRIDE, cuda_kernel, record_loops

# Per layer, on the device: distinct experts found resident / filled on demand; prefetched experts
# filled, then used by the demand step they were for, or not (evicted first, or not routed to).
COUNTERS = ("hits", "misses", "issued", "useful", "wasted")
BIG = 1 << 40  # a used slot's LRU key: after every unused one
MODES = ("kernel", "ops")
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


# -- the map step as MLX operations -----------------------------------------------------------------
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


# -- a layer's step as one CUDA kernel --------------------------------------------------------------
# One launch a layer: the demand step of its map, the prefetch step of its target's map when a
# prefetch rides along, and the fills of both. Each launch is host work (MLX's primitive, its
# evaluation, its graph node), and on the H200 what the device install adds to a token is about
# as much the host building the graph as the device evaluating it (docs/gpu.md, "One launch a
# layer, measured"); a layer was two kernels and three small operations, nine with a prefetch.
# A kernel cannot wait for all of its blocks, so every block runs the map steps itself, in its
# first warp (a map is a few hundred bytes, and the blocks run them at once), and keeps the fill
# lists in shared memory; block 0 alone writes the new maps out. Then every thread copies its
# share of the records. A job's map goes in and comes out as one array (MapState's block, the
# fill list in it), so a job costs the launch two arrays, three with its remapped indices.
#
# A map step is a sequence (each miss takes the least recently used slot left after the misses
# before it), so the entries are walked in order by every lane alike; what is parallel is each
# walk over the slots (the choice of a slot is a warp minimum) and the copies in and out. The maps
# live in shared memory for the step: a single thread walking them in global memory cost tens of
# microseconds a layer, a cost that grew with S. A slot's key is stamp * S + slot (a used slot's
# stamp counts as 2^31, after every real one), unique, so that the minimum names its slot. Lane 0
# alone writes the shared maps; a __syncwarp() stands between every read by all lanes and that
# write. A demand and a prefetch step differ where DEMAND says; PROTECT is a prefetch's
# protect_recent.
STEP_HEADER = """
__device__ inline long long titan_warp_min(long long best) {
  for (int o = 16; o > 0; o >>= 1) {
    const long long b = __shfl_xor_sync(0xffffffffu, best, o);
    best = b < best ? b : best;
  }
  return best;
}

template <int E, int S, bool DEMAND, bool PROTECT, typename I>
__device__ int titan_map_step(
    const I* inds, const int N, const int* slot_of, const int* expert_in, const int* stamp,
    const int* clock, const int* counters, const int* pending, int* slot_of_o, int* expert_in_o,
    int* stamp_o, int* clock_o, int* counters_o, int* pending_o, unsigned int* remapped,
    int* fill_e, int* fill_s, int* count, int* fe, int* fs) {
  __shared__ int so[E], ei[S], sto[S], pdo[S], n_out;
  __shared__ bool used[S], taken[S], seen[E];
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int M = N < S ? N : S;
    const long long NONE = 0x7fffffffffffffffLL;
    const int clk = clock[0];
    for (int x = lane; x < E; x += 32) { so[x] = slot_of[x]; seen[x] = false; }
    for (int s = lane; s < S; s += 32) {
      ei[s] = expert_in[s]; sto[s] = stamp[s]; pdo[s] = pending[s];
      used[s] = PROTECT && stamp[s] == clk - 1; taken[s] = false;
    }
    __syncwarp();
    for (int j = lane; j < N; j += 32) {
      const int e = (int)inds[j];
      if (e >= 0 && slot_of[e] >= 0) used[slot_of[e]] = true;
    }
    __syncwarp();
    int nfree = 0;
    for (int s = lane; s < S; s += 32) nfree += !used[s];
    for (int o = 16; o > 0; o >>= 1) nfree += __shfl_xor_sync(0xffffffffu, nfree, o);
    int n = 0, hits = 0, wasted = 0, rank = 0;
    for (int j = 0; j < N; ++j) {
      const int e = (int)inds[j];
      if (e < 0) continue;
      __syncwarp();
      const bool was_seen = seen[e];
      __syncwarp();
      if (was_seen) continue;
      if (lane == 0) seen[e] = true;
      if (slot_of[e] >= 0) {  // resident: a prefetch touches it, so that its demand step finds it
        if (DEMAND) ++hits; else if (lane == 0) sto[slot_of[e]] = clk;
        continue;
      }
      if (!DEMAND && rank++ >= nfree) continue;  // a prefetch takes only slots no entry uses
      long long best = NONE;
      for (int s = lane; s < S; s += 32)
        if (!used[s] && !taken[s]) {
          const long long key = (long long)stamp[s] * S + s;
          best = key < best ? key : best;
        }
      best = titan_warp_min(best);
      // none left: more experts than free slots, which a demand step's caller never plans
      const int v = best == NONE ? 0 : (int)(((best % S) + S) % S);
      __syncwarp();
      if (lane == 0) {
        taken[v] = true;
        const int old = ei[v];
        if (old >= 0) so[old] = -1;
        so[e] = v; ei[v] = e;
        if (n < M) { fe[n] = e; fs[n] = v; }
        if (!DEMAND) { pdo[v] = 1; sto[v] = clk; }
      }
      if (!DEMAND && pending[v]) ++wasted;  // a prefetch evicted before a demand step looked
      ++n;
    }
    __syncwarp();
    if (blockIdx.x == 0) {  // the new map, the fill list (padded with a slot that keeps its bytes)
      long long best = NONE;
      for (int s = lane; s < S; s += 32)
        if (!taken[s]) {
          const long long key = (used[s] ? 2147483648LL : (long long)stamp[s]) * S + s;
          best = key < best ? key : best;
        }
      best = titan_warp_min(best);
      const int pad = best == NONE ? fs[M - 1] : (int)(((best % S) + S) % S);
      for (int j = lane; j < M; j += 32) { fill_e[j] = j < n ? fe[j] : -1; fill_s[j] = j < n ? fs[j] : pad; }
      for (int x = lane; x < E; x += 32) slot_of_o[x] = so[x];
      int useful = 0;
      for (int s = lane; s < S; s += 32) {
        expert_in_o[s] = ei[s];
        if (DEMAND) {  // a prefetched slot is useful if this step uses it, wasted otherwise
          stamp_o[s] = used[s] || taken[s] ? clk : stamp[s];
          if (pending[s]) { if (used[s]) ++useful; else ++wasted; }
          pending_o[s] = 0;
        } else {
          stamp_o[s] = sto[s]; pending_o[s] = pdo[s];
        }
      }
      if (DEMAND) {
        for (int j = lane; j < N; j += 32) {
          const int e = (int)inds[j];
          remapped[j] = e >= 0 ? (unsigned int)so[e] : 0u;
        }
        for (int o = 16; o > 0; o >>= 1) {
          useful += __shfl_xor_sync(0xffffffffu, useful, o);
          wasted += __shfl_xor_sync(0xffffffffu, wasted, o);
        }
      }
      if (lane == 0) {
        count[0] = n;
        clock_o[0] = DEMAND ? clk + 1 : clk;
        counters_o[0] = counters[0] + hits;
        counters_o[1] = counters[1] + (DEMAND ? n : 0);
        counters_o[2] = counters[2] + (DEMAND ? 0 : n);
        counters_o[3] = counters[3] + useful;
        counters_o[4] = counters[4] + wasted;
      }
    }
    if (lane == 0) n_out = n;
  }
  __syncthreads();
  return n_out;
}
"""
WARP = 32
FILL_THREADS = 132 * 1024  # enough loads in flight to keep PCIe busy (the probe's kernel read 46.8 GB/s)
# The map step's pointers into a job's input block and output block, in titan_map_step's order.
STATE_IN = MapState.FIELDS
STATE_OUT = STATE_IN + ("fill_e", "fill_s", "count")


@dataclass
class Job:
    """One layer's part of a step kernel: its map, the experts (any shape; -1: ignored), a demand
    step (remapped indices out) or a prefetch, and for a fill its id on the device and its tables."""

    state: MapState
    inds: mx.array
    slots: int
    demand: bool = True
    protect_recent: bool = False
    layer: mx.array | None = None
    tables: tuple = ()


def job_names(j: int, demand: bool, fill: bool) -> tuple:
    """Job j's inputs and outputs in a step kernel: its map's block in and out (MapState), and a
    demand job's remapped indices."""
    ins = (f"inds{j}", f"state{j}") + ((f"layer{j}",) if fill else ())
    return ins, (f"state_o{j}",) + ((f"remapped{j}",) if demand else ())


def _pointers(j: int, experts: int, slots: int) -> list:
    """Job j's views of its blocks, as titan_map_step takes them."""
    at = MapState.layout(experts, slots)
    ins = [f"const int* {n}{j} = state{j} + {at[n][0]};" for n in STATE_IN]
    return ins + [f"int* {n}_o{j} = state_o{j} + {at[n][0]};" for n in STATE_OUT]


def state_args(j: int) -> str:
    """Job j's map in and out, as titan_map_step's arguments."""
    return ", ".join(f"{s}{j}" for s in STATE_IN) + ", " + ", ".join(f"{s}_o{j}" for s in STATE_IN)


@functools.cache
def step_source(kinds: tuple, tensors: tuple, record_bytes: int, experts: int, slots: tuple) -> str:
    """A step kernel's body: job j (`kinds[j]` True: a demand step, on a map of `slots[j]`) runs its
    map step (STEP_HEADER) into shared fill lists, then, with `tensors`, every thread copies its
    share of each job's filled records from the host tier at base[0] into the slots of tables
    `tab{j}_{i}` (inputs: written through their pointers)."""
    lines = []
    for j, demand in enumerate(kinds):
        lines += _pointers(j, experts, slots[j]) + [
            f"__shared__ int fe{j}[S{j}], fs{j}[S{j}];",
            f"int N{j} = 1;",
            f"for (int d = 0; d < inds{j}_ndim; ++d) N{j} *= inds{j}_shape[d];",
            f"const int n{j} = titan_map_step<E, S{j}, {str(demand).lower()}, P{j}>(inds{j}, N{j}, {state_args(j)}, "
            f"{f'remapped{j}' if demand else 'nullptr'}, fill_e_o{j}, fill_s_o{j}, count_o{j}, fe{j}, fs{j});",
        ]
    if tensors:
        lines += ["const unsigned long long area = base[0];", *GRID_STRIDE]
        for j in range(len(kinds)):
            record = f"((unsigned long long)layer{j}[0] * {experts}ULL + fe{j}[r])"
            dest = lambda i, ct, w, j=j: f"(({ct}*)tab{j}_{i}) + (size_t)fs{j}[r] * {w}"  # noqa: E731
            lines += record_loops(tensors, record_bytes, f"n{j}", record, dest)
    return "\n".join(lines)


@functools.cache
def step_signature(kinds: tuple, tensors: tuple, record_bytes: int, experts: int, slots: tuple, n_after: int) -> tuple:
    """The step kernel's input names, output names, body and output dtypes for jobs of `kinds`
    (True: demand) on maps of `slots` with `n_after` ordering inputs: made once per signature, as
    a decode asks for them at every layer (the kernel itself is `staging.cuda_kernel`'s to keep)."""
    fill = bool(tensors)
    ins, outs, dtypes = ["base"] if fill else [], [], []
    for j, demand in enumerate(kinds):
        i, o = job_names(j, demand, fill)
        ins += i
        outs += o
        dtypes += [mx.int32] + ([mx.uint32] if demand else [])
    for j in range(len(kinds) if fill else 0):
        ins += [f"tab{j}_{i}" for i in range(len(tensors))]
    ins += [f"after{i}" for i in range(n_after)]
    return tuple(ins), tuple(outs), step_source(kinds, tensors, record_bytes, experts, slots), dtypes


def step_kernel(jobs, tier: HostTier | None = None, tensors=(), after=(), stream=None) -> list:
    """The jobs' map steps and (with `tensors`) fills as one kernel: for each job its new MapState and
    Fill, whose `remapped` (a demand job's, in its indices' shape) and map are outputs of the
    kernel, so that whatever reads them runs after every copy. `after`: arrays whose producers
    must have run first (the previous readers of these tables): MLX orders kernels by what they
    read and write, and it cannot see writes through a pointer."""
    after = [a for a in after if a is not None]
    fill = bool(tensors)
    kinds = tuple(job.demand for job in jobs)
    E, slots = jobs[0].state.E, tuple(job.state.S for job in jobs)
    for job in jobs:
        if job.slots != job.state.S or job.state.E != E:
            raise ValueError(f"a job of {job.slots} slots on a map of {job.state.S} of {job.state.E} experts")
    # E lays out every map's block (MapState.layout), with a fill or without one
    record_bytes = tier.record_bytes if fill else 0
    ins, outs, src, dtypes = step_signature(kinds, tuple(tensors), record_bytes, E, slots, len(after))
    k = cuda_kernel("step", ins, outs, src, STEP_HEADER)
    inputs, shapes, template = [tier.base] if fill else [], [], [("E", E)]
    for j, job in enumerate(jobs):
        inputs += [job.inds, job.state.block] + ([job.layer] if fill else [])
        shapes += [job.state.block.shape] + ([job.inds.shape] if job.demand else [])
        template += [(f"S{j}", job.slots), (f"P{j}", bool(job.protect_recent))]
    for job in jobs if fill else ():
        inputs += job.tables
    out = k(
        inputs=inputs + after,
        output_shapes=shapes,
        output_dtypes=dtypes,
        grid=(FILL_THREADS if fill else WARP, 1, 1),
        threadgroup=(256 if fill else WARP, 1, 1),
        template=template,
        stream=stream,
    )
    res, at = [], 0
    for job in jobs:
        state = MapState(out[at], E, job.slots)
        remapped = out[at + 1] if job.demand else NO_REMAP
        at += 1 + job.demand
        res.append((state, Fill(remapped, packed=(state, min(job.inds.size, job.slots)))))
    return res


def map_step_kernel(state: MapState, inds: mx.array, slots: int, stream=None) -> tuple:
    """`map_step_ops` as a step kernel with no fill (the same outputs, bit for bit)."""
    return step_kernel([Job(state, inds, slots)], stream=stream)[0]


def prefetch_step_kernel(state: MapState, inds: mx.array, slots: int, protect_recent=False, stream=None) -> tuple:
    """`prefetch_step_ops` as a step kernel with no fill."""
    return step_kernel([Job(state, inds, slots, demand=False, protect_recent=protect_recent)], stream=stream)[0]


# -- the fill as MLX operations ---------------------------------------------------------------------
def fill_ops(tier: HostTier, layer: int, buffers, tensors, fill: Fill):
    """Copy the filled experts' records from the host tier into their slots: one gather of the
    records and one scatter per tensor; the padded entries write a slot's own bytes back."""
    M = fill.experts.shape[0]
    rows = tier.array[layer * tier.num_experts + mx.maximum(fill.experts, 0)]
    real = mx.arange(M) < fill.count
    for t, buf in zip(tensors, buffers):
        vals = rows[:, t.offset : t.offset + t.nbytes].view(mx_dtype(t.dtype)).reshape(M, *t.shape)
        keep = buf[fill.slots]
        buf[fill.slots] = mx.where(real.reshape(M, *[1] * len(t.shape)), vals, keep)


# -- the cache --------------------------------------------------------------------------------------
class DeviceStats(StepStats):
    """A step's figures for the decode loop: the device counters' change since the loop last asked,
    captured as an array with the step's graph and read once the step has run (so the read waits
    for nothing, and a pipelined decode's next token is not waited for)."""

    def __init__(self, cache=None):
        super().__init__()
        self._cache = cache

    def reset(self):
        self.__init__(self._cache)

    def capture(self) -> dict:
        out = super().capture()
        if self._cache is not None:
            out["counters"] = self._cache.counter_rows()
        return out

    def pending(self, captured: dict) -> list:
        return [captured["counters"]] if "counters" in captured else []

    def figures(self, captured: dict) -> dict:
        out = dict(captured)
        rows = out.pop("counters", None)
        if rows is not None:
            now = self._cache.totals(rows)
            out.update({k: now[k] - self._cache.last_seen[k] for k in STEP_FIGURES})
            self._cache.last_seen = now
        return out


_streams = threading.local()


def _thread_streams() -> dict:
    """This thread's prefetch streams, by device."""
    return _streams.__dict__.setdefault("by_device", {})


def prefetch_stream() -> mx.Stream:
    """The calling thread's stream for prefetch work on the default device, made at its first use:
    an MLX stream belongs to the thread that made it (on CUDA another thread cannot use it) and is
    never freed, so one a thread, shared by the engines that thread decodes with."""
    made, dev = _thread_streams(), mx.default_device()
    if str(dev) not in made:
        made[str(dev)] = mx.new_stream(dev)
    return made[str(dev)]


class DeviceCache:
    """Every MoE layer's slot tables in device memory, their slot maps on the device and the host
    tier behind them (module docstring). The engine-wide counterpart of moe.ExpertCache for the
    `device` install.

    `overlap`: a prefetch's map step and fill run on a stream of their own (`prefetch_stream`), so
    that its reads overlap the decode stream's compute; otherwise they queue on the decode stream."""

    def __init__(
        self, store, slots, mode: str | None = None, tier: HostTier | None = None, prefetcher=None, overlap=True
    ):
        if mode is None:
            mode = "kernel" if device.kind() == "gpu" and not device.pinned_unavailable() else "ops"
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if mode == "kernel" and device.pinned_unavailable():
            raise RuntimeError(f"the device install's kernels cannot run here: {device.pinned_unavailable()}")
        self.mode, self.store, self.tensors = mode, store, list(store.tensors)
        self.prefetcher = prefetcher  # deviceprefetch.DevicePrefetch, or None: demand loading
        t0 = time.perf_counter()
        self.tier = tier or hosttier.acquire(store, cuda=mode == "kernel")
        self.num_experts = self.tier.num_experts
        per_layer = [slots] * store.num_layers if isinstance(slots, int) else list(slots)
        self.slots = per_layer
        self.tables = [[mx.zeros((s, *t.shape), mx_dtype(t.dtype)) for t in self.tensors] for s in per_layer]
        mx.eval(self.tables)
        self.states = [MapState.empty(self.num_experts, s) for s in per_layer]
        self.layer_ids = [device_indices([i]) for i in range(store.num_layers)]
        self.after = [None] * store.num_layers  # each layer's last SwitchGLU output (kernel mode's ordering)
        self.overlap = overlap
        self.streams_used = set()  # the prefetch streams this cache queued work on (close waits for them)
        for layer, s in enumerate(per_layer):
            if s == self.num_experts:  # every expert resident: slot e = expert e, filled once
                self.fill_all(layer)
        self.load_seconds = time.perf_counter() - t0
        self.stats = DeviceStats(self)
        self.last_seen = dict.fromkeys(STEP_FIGURES, 0)  # the counters when the decode loop last asked
        self.position, self.rows = 0, 1

    def fill_all(self, layer: int):
        remapped = self.step(layer, mx.arange(self.num_experts, dtype=mx.int32))
        mx.eval(remapped, self.tables[layer], self.states[layer].arrays())  # the kernel's output runs it
        self.states[layer] = self.states[layer].without_counts()  # the initial fill is no token's miss
        mx.eval(self.states[layer].arrays())

    def step(self, layer: int, inds: mx.array, ahead=None) -> mx.array:
        """The map step and fill of `layer` for the router's indices `inds` (any shape, int32 -1 =
        ignore); returns them remapped to slots, in their shape, ready for the layer's SwitchGLU.
        `ahead`: a prefetch (target layer, predicted experts) issued with it, in the same kernel on
        the decode stream, else first, through `prefetch`."""
        S = self.slots[layer]
        if ahead is not None and (self.overlap or self.mode == "ops"):
            self.prefetch(*ahead)
            ahead = None
        if self.mode == "ops":
            state, fill = map_step_ops(self.states[layer], inds.reshape(-1).astype(mx.int32), S)
            fill_ops(self.tier, layer, self.tables[layer], self.tensors, fill)
            # Not all of the new map feeds this step's compute: evaluate it with the step (no wait),
            # or a decode nobody reads counters from would chain every step's map to the next.
            mx.async_eval(state.arrays())
            self.states[layer] = state
            return fill.remapped.reshape(inds.shape)
        jobs = [Job(self.states[layer], inds, S, layer=self.layer_ids[layer], tables=self.tables[layer])]
        # A prefetch's fill of these tables ran before: its map is this step's input.
        after = [self.after[layer]]
        if ahead is not None:
            t, pred = ahead
            jobs.append(Job(self.states[t], pred, self.slots[t], False, False, self.layer_ids[t], self.tables[t]))
            after.append(self.after[t])
        out = step_kernel(jobs, self.tier, self.tensors, after)
        self.states[layer] = out[0][0]
        if ahead is not None:
            self.states[t] = out[1][0]
        return out[0][1].remapped

    def prefetch(self, layer: int, inds: mx.array, protect_recent: bool = False):
        """Fill `layer`'s slots with the predicted experts `inds` (int32, -1 = dropped), lazily,
        ahead of its demand step (prefetch_step_ops), in a launch of its own.

        With `overlap`, on the prefetch stream, and never with a dependency between the two streams
        inside one evaluation: there MLX's CUDA backend makes the host wait for the other stream
        (its `Fence::wait` is a host wait), while on an array of an earlier evaluation the stream
        waits on the device (an event). So what the prefetch reads from the decode stream is
        handed to an evaluation first, and the prefetch's own work gets one of its own, which the
        decode stream's later readers of this layer (its demand step) then wait for on the device."""
        S = self.slots[layer]
        if self.mode == "ops":  # the operations' flat int32 entries, made on the stream inds come from
            inds = inds.reshape(-1).astype(mx.int32)
        stream = prefetch_stream() if self.overlap else None
        if stream is not None:
            self.streams_used.add(stream)
            before = [inds, *self.states[layer].arrays(), *self.tables[layer], self.after[layer]]
            mx.async_eval([a for a in before if a is not None])
        if self.mode == "kernel":
            job = Job(self.states[layer], inds, S, False, protect_recent, self.layer_ids[layer], self.tables[layer])
            ((state, _),) = step_kernel([job], self.tier, self.tensors, (self.after[layer],), stream)
            made = state.arrays()
        else:
            with mx.stream(stream) if stream is not None else contextlib.nullcontext():
                state, fill = prefetch_step_ops(self.states[layer], inds, S, protect_recent)
                fill_ops(self.tier, layer, self.tables[layer], self.tensors, fill)
            made = [*state.arrays(), *self.tables[layer]]
        # On its own stream the prefetch needs an evaluation of its own (above). The ops' map, not
        # all of which feeds a later compute, is evaluated now too (no wait), or a decode nobody
        # reads counters from would chain every step's map to the next; the map kernel reads all of it.
        if stream is not None or self.mode == "ops":
            mx.async_eval(made)
        self.states[layer] = state

    # -- what the decode loop and the engine ask -------------------------------------------------
    def begin_step(self, position: int, rows: int):
        self.position, self.rows = position, rows

    def counter_rows(self) -> mx.array:
        """Every layer's counters as they will stand once what is queued has run, (L, counters):
        two operations where every layer's map has one shape, not one a layer."""
        shapes = {s.block.shape for s in self.states}
        if len(shapes) > 1:
            return mx.stack([s.counters for s in self.states])
        at, n = MapState.layout(self.states[0].E, self.states[0].S)["counters"]
        return mx.stack([s.block for s in self.states])[:, at : at + n]

    def totals(self, rows: mx.array | None = None) -> dict:
        """Every counter over every layer, the bytes read (demand and prefetch) and the evictions,
        from the device counters (`rows`, `counter_rows()` by default: a read back, so ask after a
        token's evaluation, not inside it). A slot is never emptied once filled, so each layer's
        fills past its first S evicted one."""
        per_layer = np.array(self.counter_rows() if rows is None else rows).astype(np.int64)
        out = dict(zip(COUNTERS, (int(c) for c in per_layer.sum(axis=0))))
        out["bytes_read"] = (out["misses"] + out["issued"]) * self.store.expert_bytes
        fills = per_layer[:, COUNTERS.index("misses")] + per_layer[:, COUNTERS.index("issued")]
        out["evictions"] = int(np.maximum(fills - np.array(self.slots), 0).sum())
        return out

    def counters(self) -> dict:
        t = self.totals()
        return dict(
            hits=t["hits"], misses=t["misses"], evictions=t["evictions"], bytes_read=t["bytes_read"],
            issued=t["issued"], useful=t["useful"], wasted=t["wasted"],
        )  # fmt: skip

    def resident(self, layer: int) -> np.ndarray:
        """The experts resident in `layer`'s slots (reads the map back)."""
        return np.array(self.states[layer].expert_in)

    def chunked(self, calls: int):
        """A layer's rows needed `calls` calls over the table (a prefill on a small table)."""
        self.stats.chunks += calls - 1

    def close(self):
        # Fill kernels still queued (mlx-lm's generate_step evaluates the next token ahead, a
        # prefetch runs on its own stream) read the host tier through its mapped address: once
        # it is unregistered, such a read is an illegal access that poisons every later CUDA call.
        mx.synchronize()
        mine = _thread_streams().values()  # another thread's streams cannot be named here
        for stream in self.streams_used:
            if stream in mine:
                mx.synchronize(stream)
        hosttier.release(self.tier)


class DeviceSwitchGLU(OffloadedSwitch):
    """mlx-lm's SwitchGLU (or SwitchMLP) over a layer's slot tables with the `device` install."""

    def __init__(self, glu, cache: DeviceCache, layer: int):
        super().__init__()
        for t, buf in zip(cache.tensors, cache.tables[layer]):
            set_param(glu, t.name, buf)
        self.glu = glu
        self._cache = cache
        self._layer = layer

    def __call__(self, x, indices):
        cache, layer = self._cache, self._layer
        S, k = cache.slots[layer], indices.shape[-1]
        if S == cache.num_experts:
            return self.glu(x, indices)  # slot e holds expert e
        if indices.size <= S:  # a decode step, or any call whose choices fit: nothing leaves the device
            pf = cache.prefetcher if indices.size == k else None  # prefetch while decoding, one row
            target = pf.target(layer)[0] if pf is not None else None
            ahead = None
            if pf is not None and target != layer:  # line 13: layer l+d's experts, with this layer's step
                pred = pf.predict(layer, x, indices, cache.position)
                if pred is not None:
                    ahead = (target, pred)
            y = self.glu(x, cache.step(layer, indices, ahead))
            cache.after[layer] = y
            if pf is not None and target == layer:  # onto this very layer (the next token's): once its
                pred = pf.predict(layer, x, indices, cache.position)  # experts are read, sparing them
                if pred is not None:
                    cache.prefetch(layer, pred, protect_recent=True)
            if pf is not None:
                pf.remember(layer, indices)
            return y
        # A prefill whose rows may route to more experts than slots: planned on the host, once per
        # layer, in the expert batches of moe.prefill_calls, each through the same map and fill.
        idx = np.array(indices).astype(np.int32)
        flat = idx.reshape(-1, k)
        pairs = flat.reshape(-1)
        d = x.shape[-1]
        parts, out = [], None
        calls = prefill_calls(flat, S, device.rows_alike())
        cache.chunked(len(calls))
        for call in calls:
            masked = np.full(pairs.size, -1, np.int32)
            masked[call.pairs] = pairs[call.pairs]
            remapped = cache.step(layer, device_indices(masked, np.int32))
            if call.compact:
                sel = device_indices(call.pairs)
                y = self.glu(x.reshape(-1, d)[device_indices(call.pairs // k)], remapped[sel][:, None])
                parts.append(y.reshape(-1, d))
                cache.after[layer] = parts[-1]
            else:
                y = self.glu(x, remapped.reshape(indices.shape))
                keep = np.zeros(pairs.size, bool)
                keep[call.pairs] = True
                mask = device_indices(keep.reshape(idx.shape), np.bool_)
                out = y if out is None else mx.where(mask[..., None], y, out)
                cache.after[layer] = out
            if cache.mode == "ops":
                mx.eval(cache.after[layer])  # the next batch's scatter must not wait on this one's reads
        if out is not None:
            return out
        back = device_indices(np.argsort(np.concatenate([c.pairs for c in calls])))
        return mx.concatenate(parts, axis=0)[back].reshape(*idx.shape, d)
