"""The device install's CUDA kernels: a layer's step (its map step, a prefetch's riding along, and
the fill of the slots they chose) and the many-rows area (the experts a call's rows route to,
copied into a stack of every expert of the layer, as mlx-lm holds them).

MLX cannot name an existing array as a kernel's output, so the slot tables are a step kernel's
inputs and it writes through their pointers; `after` inputs order it behind the previous readers
of those tables (MLX orders kernels by what they read and write, and it cannot see a write
through a pointer)."""

import functools
from dataclasses import dataclass

import mlx.core as mx

from ..slots import mx_dtype
from ..staging import CTYPES, GRID_STRIDE, cuda_kernel, grain, record_loops
from .hosttier import HostTier
from .kernel_source import STEP_HEADER
from .ops import NO_REMAP
from .state import Fill, MapState

WARP = 32
FILL_THREADS = 132 * 1024  # enough loads in flight to keep PCIe busy (the probe's kernel read 46.8 GB/s)
# The map step's pointers into a job's input block and output block, in titan_map_step's order.
STATE_IN = MapState.FIELDS
STATE_OUT = STATE_IN + ("fill_e", "fill_s", "count")


@dataclass
class Job:
    """One layer's part of a step kernel: its map, the experts (any shape; -1: ignored), a demand
    step (remapped indices out) or a prefetch, and for a fill its id on the device and its tables.
    `source`: a many-rows area (one stack of every expert per tensor) to fill the slots from,
    instead of the host tier."""

    state: MapState
    inds: mx.array
    slots: int
    demand: bool = True
    protect_recent: bool = False
    layer: mx.array | None = None
    tables: tuple = ()
    source: tuple | None = None


def job_names(j: int, demand: bool, fill: bool, tensors: int = 0, from_area: bool = False) -> tuple:
    """Job j's inputs and outputs in a step kernel: its map's block in and out (MapState), and a
    demand job's remapped indices; with a fill from an area, the area's stacks."""
    ins = (f"inds{j}", f"state{j}") + ((f"layer{j}",) if fill else ())
    ins += tuple(f"src{j}_{i}" for i in range(tensors)) if from_area else ()
    return ins, (f"state_o{j}",) + ((f"remapped{j}",) if demand else ())


def _pointers(j: int, experts: int, slots: int) -> list:
    """Job j's views of its blocks, as titan_map_step takes them."""
    at = MapState.layout(experts, slots)
    ins = [f"const int* {n}{j} = state{j} + {at[n][0]};" for n in STATE_IN]
    return ins + [f"int* {n}_o{j} = state_o{j} + {at[n][0]};" for n in STATE_OUT]


def state_args(j: int) -> str:
    """Job j's map in and out, as titan_map_step's arguments."""
    return ", ".join(f"{s}{j}" for s in STATE_IN) + ", " + ", ".join(f"{s}_o{j}" for s in STATE_IN)


def stack_loops(tensors, count: str, src_row: str, dst_row: str, src, dst) -> list:
    """One grid-stride loop per tensor copying `count` rows between stacks of it (slot tables,
    areas): row `src_row` of `src(i)` to row `dst_row` of `dst(i)` (C expressions of r and i)."""
    lines = []
    for i, t in enumerate(tensors):
        g = grain(0, t.nbytes, t.nbytes)
        ct, w = CTYPES[g], t.nbytes // g
        lines.append(
            f"for (size_t i = first; i < (size_t){count} * {w}; i += step) {{ const size_t r = i / {w}; "
            f"const size_t k = i - r * {w}; (({ct}*){dst(i)})[(size_t)({dst_row}) * {w} + k] = "
            f"((const {ct}*){src(i)})[(size_t)({src_row}) * {w} + k]; }}"
        )
    return lines


@functools.cache
def step_source(kinds: tuple, tensors: tuple, record_bytes: int, experts: int, slots: tuple) -> str:
    """A step kernel's body: job j (`kinds[j]`: (a demand step?, filled from an area?), on a map of
    `slots[j]`) runs its map step (STEP_HEADER) into shared fill lists, then, with `tensors`, every
    thread copies its share of each job's filled experts into the slots of tables `tab{j}_{i}`
    (inputs: written through their pointers), from the host tier's records at base[0] or from the
    area's stacks `src{j}_{i}`."""
    lines = []
    for j, (demand, _) in enumerate(kinds):
        lines += _pointers(j, experts, slots[j]) + [
            f"__shared__ int fe{j}[S{j}], fs{j}[S{j}];",
            f"int N{j} = 1;",
            f"for (int d = 0; d < inds{j}_ndim; ++d) N{j} *= inds{j}_shape[d];",
            f"const int n{j} = titan_map_step<E, S{j}, {str(demand).lower()}, P{j}>(inds{j}, N{j}, {state_args(j)}, "
            f"{f'remapped{j}' if demand else 'nullptr'}, fill_e_o{j}, fill_s_o{j}, count_o{j}, fe{j}, fs{j});",
        ]
    if tensors:
        lines += ["const unsigned long long area = base[0];", *GRID_STRIDE]
        for j, (_, from_area) in enumerate(kinds):
            if from_area:
                lines += stack_loops(tensors, f"n{j}", f"fe{j}[r]", f"fs{j}[r]", lambda i, j=j: f"src{j}_{i}",
                                     lambda i, j=j: f"tab{j}_{i}")  # fmt: skip
                continue
            record = f"((unsigned long long)layer{j}[0] * {experts}ULL + fe{j}[r])"
            dest = lambda i, ct, w, j=j: f"(({ct}*)tab{j}_{i}) + (size_t)fs{j}[r] * {w}"  # noqa: E731
            lines += record_loops(tensors, record_bytes, f"n{j}", record, dest)
    return "\n".join(lines)


@functools.cache
def step_signature(kinds: tuple, tensors: tuple, record_bytes: int, experts: int, slots: tuple, n_after: int) -> tuple:
    """The step kernel's input names, output names, body and output dtypes for jobs of `kinds`
    on maps of `slots` with `n_after` ordering inputs: made once per signature, as a decode asks
    for them at every layer (the kernel itself is `staging.cuda_kernel`'s to keep)."""
    fill = bool(tensors)
    ins, outs, dtypes = ["base"] if fill else [], [], []
    for j, (demand, from_area) in enumerate(kinds):
        i, o = job_names(j, demand, fill, len(tensors), from_area)
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
    must have run first (the previous readers of these tables)."""
    after = [a for a in after if a is not None]
    fill = bool(tensors)
    kinds = tuple((job.demand, fill and job.source is not None) for job in jobs)
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
        inputs += list(job.source) if kinds[j][1] else []
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


# -- the many-rows area -----------------------------------------------------------------------------
# Rows that route to more experts than a layer's slots (a prompt, a batch) are computed in one call
# of mlx-lm's SwitchGLU, in mlx-lm's own shapes, over an area that holds every expert they route to
# at its own index: the router's indices need no remapping and the call is mlx-lm's, bit for bit,
# on any backend. One kernel makes the area: every block finds the experts the rows name (or takes
# them all), then every thread copies its share, a resident expert from its slot (device memory),
# any other from the host tier across PCIe. The rows of experts nobody names are never written and
# never read.
@functools.cache
def area_source(tensors: tuple, record_bytes: int, experts: int, every: bool) -> str:
    E = experts
    lines = ["const int* slot_of = state;  // the map's block starts with slot_of (MapState.layout)"]
    if every:
        lines += ["const int n = E;"]
    else:
        lines += [
            "__shared__ int list[E];",
            "__shared__ unsigned char seen[E];",
            "__shared__ int n_seen;",
            "for (int e = threadIdx.x; e < E; e += blockDim.x) seen[e] = 0;",
            "__syncthreads();",
            "int N = 1;",
            "for (int d = 0; d < inds_ndim; ++d) N *= inds_shape[d];",
            "for (int j = threadIdx.x; j < N; j += blockDim.x) {",
            "  const int e = (int)inds[j];",
            "  if (e >= 0 && e < E) seen[e] = 1;",
            "}",
            "__syncthreads();",
            "if (threadIdx.x == 0) { int m = 0; for (int e = 0; e < E; ++e) if (seen[e]) list[m++] = e; n_seen = m; }",
            "__syncthreads();",
            "const int n = n_seen;",
        ]
    lines += ["const unsigned long long host = base[0];", *GRID_STRIDE]
    expert = "r" if every else "list[r]"
    for i, t in enumerate(tensors):
        g = grain(t.offset, t.nbytes, record_bytes)
        ct, w = CTYPES[g], t.nbytes // g
        lines.append(
            f"for (size_t i = first; i < (size_t)n * {w}; i += step) {{ const size_t r = i / {w}; "
            f"const size_t k = i - r * {w}; const int e = {expert}; const int s = slot_of[e]; "
            f"const {ct}* src = s >= 0 ? ((const {ct}*)tab{i}) + (size_t)s * {w} : (const {ct}*)(host + "
            f"((unsigned long long)layer[0] * {E}ULL + e) * {record_bytes}ULL + {t.offset}ULL); "
            f"(({ct}*)o{i})[(size_t)e * {w} + k] = src[k]; }}"
        )
    return "\n".join(lines)


def area_kernel(tier: HostTier, layer: mx.array, state: MapState, tables, tensors, inds=None, after=(), stream=None):
    """A layer's many-rows area (see above): one stack of every expert per tensor, holding the
    experts `inds` name (any shape, -1 ignored; None: every expert), the rest unwritten."""
    after = [a for a in after if a is not None]
    every = inds is None
    E = state.E
    ins = ["base", "layer", "state"] + ([] if every else ["inds"]) + [f"tab{i}" for i in range(len(tensors))]
    ins += [f"after{i}" for i in range(len(after))]
    outs = tuple(f"o{i}" for i in range(len(tensors)))
    src = area_source(tuple(tensors), tier.record_bytes, E, every)
    k = cuda_kernel("area", tuple(ins), outs, src)
    inputs = [tier.base, layer, state.block] + ([] if every else [inds]) + list(tables) + after
    return k(
        inputs=inputs,
        output_shapes=[(E, *t.shape) for t in tensors],
        output_dtypes=[mx_dtype(t.dtype) for t in tensors],
        grid=(FILL_THREADS, 1, 1),
        threadgroup=(256, 1, 1),
        template=[("E", E)],
        stream=stream,
    )
