"""Algorithm 1 on the host: the cache of the host installs (`inplace`, `copy`, `pinned`).

At each MoE layer the router's indices come back to the host (the one synchronisation a layer),
the prefetcher drains what it read for this layer and issues layer l+d's reads, the misses are
read as one batch and installed (engine.runtime.installs says how), and the indices are remapped
to slots. Rows that route to more experts than the table holds read them into the many-rows area
instead: one more table of E slots, slot e = expert e, shared by the layers (the next layer's
synchronisation comes after this layer's compute, so it is free again by then).
"""

import time

import mlx.core as mx
import numpy as np

from ..device import device_indices
from .moe import Cache, Step, StepStats, kept_after_many_rows
from .slots import SlotTable

# `batched`: a layer's misses are read together (in the decode thread when they are small, on the
# reader threads otherwise: installs.Install.read) and installed lazily (Algorithm 1);
# `per_miss`: the paper's first version, kept for its ablation: one miss at a time, each read on a
# reader thread and the slot table evaluated after it, whatever the default path does.
SYNC_MODES = ("batched", "per_miss")


class ExpertCache(Cache):
    """The engine-wide half of Algorithm 1: makes a layer's experts resident.

    Holds the store, one slot table per MoE layer, the install (how a read becomes a slot's bytes:
    engine.runtime.installs) and the prefetcher, and accounts every read (demand or prefetched) of
    every token: hits, misses, bytes, stall and prefetch counts in `stats`, and each table's
    counters. It is the only writer of both: the install and the prefetcher return their timings.
    """

    def __init__(self, store, tables, prefetcher, install, sync="batched", overlap=True):
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, not {sync!r}")
        self.sync = sync
        self.overlap = overlap
        self.store = store
        self.tables = tables
        self.tensors = list(store.tensors)
        self.prefetcher = prefetcher
        self.install = install
        self.stats = StepStats()
        self.position, self.rows = 0, 1
        self.history = [None] * len(tables)  # per layer, the most recent token's experts
        self.area = None  # the many-rows area (a SlotTable of E slots), made when first needed
        self.area_reader = None  # the last output computed over it
        self.keep_scores = [None] * len(tables)  # kept_after_many_rows' score of each layer

    @property
    def slots(self) -> list:
        return [t.slots for t in self.tables]

    @property
    def num_experts(self) -> int:
        return self.tables[0].num_experts

    def buffers(self, layer: int) -> list:
        return self.tables[layer].buffers

    def full(self, layer: int) -> bool:
        return self.tables[layer].full

    def reset_layer(self, layer: int, slots: int):
        """A fresh, empty slot table of `slots` for `layer` (a multi-node move re-fills it)."""
        old = self.tables[layer]
        self.tables[layer] = SlotTable(layer, old.num_experts, slots, old.tensors, old.policy_name, old.host_views)
        return self.tables[layer]

    def begin_step(self, position: int, rows: int):
        self.position, self.rows = position, rows
        self.stats.reset()

    def synced(self, seconds: float):
        """The decode thread waited `seconds` at a layer's host synchronisation."""
        self.stats.sync_s += seconds

    def fill(self, layer: int):
        """Load every expert of a layer into slot e = expert e (the S = E table)."""
        table = self.tables[layer]
        for e in range(table.num_experts):
            table.claim(e)
        self.install.fill(table, layer)
        table.bytes_read += table.num_experts * self.store.expert_bytes

    # -- the layer call (moe.Cache) ---------------------------------------------------------------
    def step(self, layer: int, x, indices) -> Step:
        table = self.tables[layer]
        scores = None
        t0 = time.perf_counter()
        if self.prefetcher.scores_on_device and self.rows == 1:
            # A decode step's predictor scores this token's MoE input on the device; its scores
            # ride back in one array with the router's indices (their bits, as uint32), so the
            # synchronisation reads back a few hundred bytes once rather than the MoE input.
            ids = indices.reshape(-1).astype(mx.uint32)
            s = self.prefetcher.device_scores(layer, x.reshape(-1, x.shape[-1])[-1])
            both = np.array(mx.concatenate([ids, mx.view(s, mx.uint32)]))
            idx = both[: ids.size].reshape(indices.shape)
            scores = both[ids.size :].view(np.float32)
        else:
            idx = np.array(indices)  # line 11: the one unavoidable synchronisation
        self.synced(time.perf_counter() - t0)
        flat = idx.reshape(-1, idx.shape[-1])
        experts, last = np.unique(flat), np.sort(flat[-1])
        if len(experts) <= table.slots:
            self.ensure(layer, experts, scores, last)
            return Step(device_indices(table.slot_indices(idx)), routed=indices)
        self.read_area(layer, [int(e) for e in experts])
        # what the table keeps after the call (the rule every install asks)
        self.keep_scores[layer], keep = kept_after_many_rows(idx, table.slots, table.slot_of >= 0,
                                                             self.keep_scores[layer])  # fmt: skip
        return Step(indices, self.area.buffers, routed=indices, note=(np.sort(keep[keep >= 0]), last))

    def computed(self, layer: int, x, step: Step, y):
        if step.area is not None:
            # The decode after a prompt (or a batch's next step) finds what kept_after_many_rows
            # chose resident. The area is free again once y has been computed.
            kept, last = step.note
            self.ensure(layer, kept, None, last)
            self.area_reader = y
        if self.overlap:
            # Start the device on this layer now: the host builds the next layer's graph
            # meanwhile, instead of the two taking turns at every synchronisation.
            mx.async_eval(y)

    def read_area(self, layer: int, experts: list):
        """Read `experts` of `layer` into the many-rows area, each into its own index."""
        table = self.tables[layer]
        if self.area is None:
            self.area = SlotTable(-1, table.num_experts, table.num_experts, table.tensors, "lru", table.host_views)
        elif self.area_reader is not None:
            # The previous call's last layer may still be computing over the area (its output is
            # queued, not needed by this call): host views must not write under it.
            mx.eval(self.area_reader)
            self.area_reader = None
        t0 = time.perf_counter()
        loaded = self.install.load(self.area, layer, experts, experts, inline=True)
        self.account(table, loaded, len(experts), time.perf_counter() - t0)
        self.stats.many_rows += 1

    def account(self, table, loaded, n: int, seconds: float, claim_s: float = 0.0):
        """Count `n` demand reads into `table`'s layer that took `seconds` (install.Loaded)."""
        st, nbytes = self.stats, n * self.store.expert_bytes
        table.misses += n
        table.bytes_read += nbytes
        st.misses += n
        st.bytes_read += nbytes
        st.stall_s += loaded.wait_s
        st.pread_s += sum(loaded.seconds)
        st.array_s += loaded.array_s
        st.install_s += claim_s + (seconds - loaded.wait_s - loaded.array_s)

    def ensure(self, layer: int, experts: np.ndarray, scores=None, last=None):
        """Lines 11-14 of Algorithm 1 for the unique experts `experts` of this layer's rows;
        `scores` are the predictor's device scores of a decode step (Prefetcher.scores_on_device)
        and `last` the last row's experts."""
        table, st = self.tables[layer], self.stats
        # line 12: install finished prefetches; wait for in-flight experts we need (late)
        need = set(experts.tolist())
        drained = self.prefetcher.drain(layer, need, can_abandon=self.install.can_abandon)
        if drained is not None:
            self.absorb(layer, drained, need)
        # line 13: predict and issue layer l+d's prefetch before this layer's compute; when l+d
        # wraps onto this very layer (next token's), only once this layer's misses have slots
        depth = self.prefetcher.depth
        onto_itself = depth > 0 and depth % len(self.tables) == 0
        if not onto_itself:
            st.predict_s += self.prefetcher.predict_and_issue(layer, experts, scores, self)
        self.history[layer] = experts if last is None else last
        # line 14: read the misses as one batch and install them
        resident = table.slot_of[experts] >= 0
        misses = [int(e) for e in experts[~resident]]
        nhit = int(resident.sum())
        table.hits += nhit
        st.hits += nhit
        table.touch(experts[resident])
        if misses:
            self.read_misses(layer, misses, protected=set(experts.tolist()))
        if onto_itself:
            st.predict_s += self.prefetcher.predict_and_issue(layer, experts, scores, self)

    # -- what a prefetcher may ask of the cache (prefetch.Prefetcher.issue) --------------------------
    def resident(self, layer: int) -> np.ndarray:
        """Each expert's slot in `layer` (-1: not resident)."""
        return self.tables[layer].slot_of

    def hint(self, layer: int, experts: list):
        """The predictor's experts for `layer` (an eviction policy may keep them)."""
        self.tables[layer].hint(experts)

    def reserve(self, layer: int, experts, protected) -> list:
        """Destinations for prefetched reads of `experts` into `layer`, in order, as many as there
        is room for (a slot outside `protected`; a staging record beyond those kept for demand)."""
        dests = self.install.reserve(self.tables[layer], experts, protected)
        self.stats.issued += len(dests)
        return dests

    def submit(self, layer: int, reads) -> list:
        """Start prefetched reads `reads` = [(expert, destination)] on the reader threads."""
        return self.store.submit_many(layer, [(e, d.buffers) for e, d in reads], prefetch=True)

    def absorb(self, layer: int, drained, need: set):
        """Install and account what a drain of `layer` found (prefetch.Drained)."""
        table, st, nbytes, install = self.tables[layer], self.stats, self.store.expert_bytes, self.install
        for f in drained.dropped:
            install.discard(table, f)
        for f in drained.failed:
            install.discard(table, f)
        for f in drained.abandoned:  # its bytes are read, into a record nothing will read
            install.abandon(f.dest, f.future)
        read = drained.arrived + drained.abandoned
        useful = sum(f.expert in need for f in drained.arrived)
        st.cancelled += len(drained.dropped)
        st.useful += useful
        st.wasted += len(drained.dropped) + len(read) - useful
        st.late += drained.late
        st.stall_s += drained.late_stall_s
        st.late_stall_s += drained.late_stall_s
        table.bytes_read += len(read) * nbytes
        st.bytes_read += len(read) * nbytes
        if not install.claims_first and drained.arrived:
            # These installs read into host records before a slot is chosen, so an arrival this
            # layer does not use may find every slot held by one it does (S = top_k): it is not
            # placed (already counted wasted). The used ones go first so that none is left out.
            placed, slots = [], []
            t0 = time.perf_counter()
            for f in sorted(drained.arrived, key=lambda f: f.expert not in need):
                try:
                    slots.append(table.claim(f.expert, protected=need))
                    placed.append(f)
                except RuntimeError:
                    if f.expert in need:
                        raise
                    install.discard(table, f)
            st.install_s += time.perf_counter() - t0
            array_s, install_s = install.place(table, placed, slots)
            st.array_s += array_s
            st.install_s += install_s
        if drained.failed:
            raise drained.failed[0].future.exception()

    def read_misses(self, layer: int, misses, protected):
        if self.sync == "per_miss":
            for e in misses:
                self._read(layer, [e], protected, evaluate=True)
        else:
            self._read(layer, misses, protected)

    def _read(self, layer: int, misses, protected, evaluate=False):
        """Read `misses` as one batch and install them; with `evaluate`, the slot table is
        evaluated before returning (the per-miss ablation's synchronisation, counted as install)."""
        table = self.tables[layer]
        t0 = time.perf_counter()
        slots = [table.claim(e, protected) for e in misses]
        t1 = time.perf_counter()
        try:
            loaded = self.install.load(table, layer, misses, slots, inline=not evaluate)
            if evaluate:
                mx.eval(table.buffers)
        except BaseException:
            for e in misses:
                table.release(e)
            raise
        self.account(table, loaded, len(misses), time.perf_counter() - t1, t1 - t0)

    def counters(self) -> dict:
        total = {}
        for t in self.tables:
            for k, v in t.counters().items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self):
        self.prefetcher.close()
        self.install.close()
