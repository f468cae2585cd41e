"""Multi-node expert execution on MLX's own distributed layer (`mx.distributed`, launched with
`mlx.launch`; the ring backend runs over TCP on Linux and macOS).

Node 0 runs the model. At every MoE layer the experts a placement puts on node n > 0 run on
node n, from node n's own slot table: node 0 sends n a header, the rows' local expert indices
and the hidden rows, n returns its experts' outputs, and node 0 puts them in their (row, k)
places. Activations and results travel in the model's dtype (a float16 wire breaks bfloat16
parity; `wire` selects it for the ablation). Every (row, expert) output is computed by the same
kernel on the same bytes, so the logits equal one node's bit for bit.

Nothing on the wire is deserialised with pickle: only fixed-layout int32 headers and raw arrays
whose shape and dtype the header and the model give. A node that dies or never joins makes the
run fail within `timeout` seconds, naming the node.
"""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import versions
from ..device import device_indices
from ..models import registry
from ..models.anatomy import moe_layers
from ..runtime.engine import build_cache, open_store
from ..runtime.moe import SlotSwitchGLU, point
from . import placement as pl

STOP, COMPUTE, PLACE = 0, 1, 2
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


class NodeError(RuntimeError):
    """A peer that died, left, or sent what the protocol does not allow."""


class Watchdog:
    """Ends the process, naming who did not answer, when an exchange outlasts `timeout`."""

    def __init__(self, timeout: float, rank: int):
        self.timeout, self.rank = timeout, rank
        self._deadline, self._what = None, ""
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="titan-watchdog").start()

    def arm(self, what: str):
        with self._lock:
            self._deadline, self._what = time.monotonic() + self.timeout, what

    def disarm(self):
        with self._lock:
            self._deadline = None

    def _run(self):
        while True:
            time.sleep(min(0.2, self.timeout / 10))
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                print(
                    f"error: node {self.rank}: {what} did not answer within {self.timeout:g} s "
                    f"(the node died or never joined); no raw record is written",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(3)


def _guard(timeout: float, message: str) -> int:
    """A child process that stops this one with SIGTERM, saying `message`, unless its pipe is
    closed within `timeout` seconds. Unlike the Watchdog thread it needs no GIL: joining a ring
    group blocks in MLX's C++ without releasing it. The child only calls async-signal-safe
    functions (it is forked from a process with threads). Returns (its pid, the pipe's write end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        try:
            if not select.select([r], [], [], timeout)[0]:
                os.write(2, message.encode())
                os.kill(os.getppid(), signal.SIGTERM)
        finally:
            os._exit(0)
    os.close(r)
    return pid, w


def init(timeout: float, backend: str = "ring"):
    """Join the group under a guard (a peer that never joins ends the run within `timeout`,
    naming this node), then return the group and a Watchdog for the exchanges that follow."""
    rank_env = int(os.environ.get("MLX_RANK", "0"))
    what = f"joining the {backend} group (rank {rank_env} of {os.environ.get('MLX_WORLD_SIZE', '?')})"
    pid, guard = _guard(
        timeout,
        f"error: node {rank_env}: {what} did not answer within {timeout:g} s "
        f"(a node died or never joined); no raw record is written\n",
    )
    group = mx.distributed.init(strict=True, backend=backend)
    os.close(guard)
    os.waitpid(pid, 0)
    return group, Watchdog(timeout, rank_env)


REPORT_BYTES = 2048


def node_report(model_id: str) -> dict:
    """What must agree on every node: library and engine versions and the model's identity."""
    have = versions.versions()
    report = {k: have.get(k) for k in ("mlx", "mlx-lm", "titan-engine")}
    report["engine-code"] = versions.code_digest()
    spec = registry.get_spec(model_id)
    report["model"] = model_id
    report["revision"] = spec.get("revision")
    try:
        manifest = registry.model_dir(model_id) / "titan-build.json"
        report["model_files"] = json.loads(manifest.read_text()).get("spec_digest") if manifest.exists() else None
    except registry.RegistryError:
        report["model_files"] = None
    # Only for the refusal's own test: report another version on one rank.
    if os.environ.get("TITAN_SKEW_RANK") == os.environ.get("MLX_RANK") and os.environ.get("TITAN_SKEW"):
        report.update(json.loads(os.environ["TITAN_SKEW"]))
    return report


def check_versions(group, dog: Watchdog, model_id: str) -> list:
    """Every node's report, gathered on every node before anything is decoded; a node that
    differs from node 0 stops the run on every node, naming the node and the versions."""
    blob = json.dumps(node_report(model_id), sort_keys=True).encode()
    if len(blob) > REPORT_BYTES:
        raise NodeError(f"node report of {len(blob)} bytes exceeds {REPORT_BYTES}")
    buf = np.zeros(REPORT_BYTES, np.uint8)
    buf[: len(blob)] = np.frombuffer(blob, np.uint8)
    dog.arm("the version check (all nodes report their mlx, mlx-lm, engine and model versions)")
    gathered = mx.distributed.all_gather(mx.array(buf), group=group)
    mx.eval(gathered)
    dog.disarm()
    rows = np.array(gathered).reshape(group.size(), REPORT_BYTES)
    reports = [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]  # JSON, never pickle
    for n, rep in enumerate(reports[1:], start=1):
        diff = {
            k: (reports[0].get(k), rep.get(k))
            for k in sorted(set(reports[0]) | set(rep))
            if reports[0].get(k) != rep.get(k)
        }
        if diff:
            what = ", ".join(f"{k} {a} on node 0 but {b} on node {n}" for k, (a, b) in diff.items())
            raise NodeError(f"version skew: node {n} differs from node 0: {what}; refusing to decode")
    return reports


class Link:
    """The request/response protocol between node 0 and one remote node."""

    def __init__(self, group, peer: int, dog: Watchdog, wire):
        self.group, self.peer, self.dog, self.wire = group, peer, dog, wire
        self.bytes_sent = self.bytes_received = 0

    def send(self, *arrays):
        # One at a time: sends are matched to receives by order, and one eval of several
        # independent sends may run them in any order.
        self.dog.arm(f"node {self.peer}")
        try:
            for a in arrays:
                mx.eval(mx.distributed.send(a, self.peer, group=self.group))
        except RuntimeError as e:
            raise NodeError(f"node {self.peer}: sending failed ({e}); the node died or left") from None
        self.dog.disarm()
        self.bytes_sent += sum(a.nbytes for a in arrays)

    def recv(self, shape, dtype):
        a = mx.distributed.recv(shape, dtype, self.peer, group=self.group)
        self.dog.arm(f"node {self.peer}")
        try:
            mx.eval(a)
        except RuntimeError as e:
            raise NodeError(f"node {self.peer}: receiving failed ({e}); the node died or left") from None
        self.dog.disarm()
        self.bytes_received += a.nbytes
        return a


class DistributedSwitchGLU(SlotSwitchGLU):
    """Node 0's SwitchGLU: local experts from its own slot table, remote ones on their node."""

    def __init__(self, glu, cache, layer, executes_on: np.ndarray, links: dict, stats: dict):
        super().__init__(glu, cache, layer)
        self._links = links
        self._stats = stats
        self.set_placement(executes_on)

    def set_placement(self, executes_on: np.ndarray):
        # (E,) node executing each expert of this layer; the SSD tier (-1) is node 0's table
        self._where = np.maximum(executes_on, 0)
        local = np.flatnonzero(self._where == 0)
        self._filler = int(local[0]) if len(local) else None

    def __call__(self, x, indices):
        idx = np.array(indices)
        scheduler = self._stats.get("scheduler")
        if scheduler is not None:
            scheduler.observe(self._layer, idx, x.shape[-2] if x.ndim > 1 else 1)
        where = self._where[idx]
        if not (where != 0).any():
            return super().__call__(x, device_indices(idx))
        k, d = idx.shape[-1], x.shape[-1]
        flat, xf, wf = idx.reshape(-1, k), x.reshape(-1, d), where.reshape(-1, k)
        t0 = time.perf_counter()
        pending = []
        for n, link in self._links.items():
            rows = np.flatnonzero((wf == n).any(1))
            if not len(rows):
                continue
            kmax = int((wf[rows] == n).sum(1).max())
            local = np.full((len(rows), kmax), -1, np.int32)  # -1: padding, ignored by node n
            cols = []
            for i, r in enumerate(rows):
                c = np.flatnonzero(wf[r] == n)
                local[i, : len(c)] = flat[r, c]
                cols.append(c)
            header = mx.array([COMPUTE, self._layer, len(rows), kmax], dtype=mx.int32)
            link.send(header, mx.array(local), xf[mx.array(rows)].astype(link.wire))
            pending.append((link, rows, cols, kmax))
        # Local positions meanwhile; remote positions get a local filler, overwritten below.
        y = None
        remote = wf != 0
        if (~remote).any():
            fill = flat.copy()
            for r in range(len(fill)):
                own = fill[r][~remote[r]]
                fill[r][remote[r]] = own[0] if len(own) else self._filler
            y = super().__call__(xf, device_indices(fill))
        out = np.zeros((len(flat), k), np.int64) - 1  # which remote result fills each position
        parts = []
        for link, rows, cols, kmax in pending:
            got = link.recv((len(rows), kmax, d), link.wire).astype(x.dtype)
            self._stats.setdefault("node_rtt_s", {}).setdefault(link.peer, []).append(time.perf_counter() - t0)
            base = sum(p.shape[0] * p.shape[1] for p in parts)
            parts.append(got)
            for i, (r, c) in enumerate(zip(rows, cols)):
                out[r, c] = base + i * kmax + np.arange(len(c))
        self._stats["rtt_s"].append(time.perf_counter() - t0)
        remote_rows = mx.concatenate([p.reshape(-1, d) for p in parts])
        gathered = remote_rows[device_indices(np.maximum(out, 0).reshape(-1))].reshape(len(flat), k, d)
        if y is None:
            y = gathered
        else:
            y = mx.where(mx.array(remote)[..., None], gathered, y.reshape(len(flat), k, d))
        return y.reshape(*idx.shape, d)


def serve(group, dog: Watchdog, model_id: str, executes_on: np.ndarray, wire, tier="page_cache"):
    """A remote node: hold this node's experts in its own slot tables and answer node 0."""
    rank = group.rank()
    model, _, spec, path = registry.load(model_id, lazy=True)
    blocks = moe_layers(model)
    st = open_store(model_id, model, path, tier=tier)
    sizes = [max(1, int((executes_on[o] == rank).sum())) for o in range(len(blocks))]
    cache = build_cache(st, sizes)
    glus, maps = [], []

    def hold(o, glu, row):
        """Load the experts `row` gives this node into a fresh slot table of layer o (a move
        reads the expert from this node's own store; weights never cross the wire)."""
        mine = [int(e) for e in np.flatnonzero(row == rank)]
        table = cache.reset_layer(o, max(1, len(mine)))
        if mine:
            cache.read_misses(o, mine, protected=set(mine))
        point(glu, cache.tensors, table.buffers)  # mlx-lm's SwitchGLU over the new buffers
        mx.eval(table.buffers)
        slot_of = np.zeros(st.num_experts(o), np.int64)
        slot_of[mine] = table.slot_of[mine]
        return slot_of, len(mine)

    for o, (_, glu) in enumerate(blocks):
        glus.append(glu)
        maps.append(hold(o, glu, executes_on[o])[0])
    link = Link(group, 0, dog, wire)
    while True:
        dog.disarm()  # node 0 may think for as long as it likes between layers...
        header = mx.distributed.recv((4,), mx.int32, 0, group=group)
        mx.eval(header)
        cmd, layer, rows, kmax = (int(v) for v in np.array(header))
        if cmd == STOP:
            break
        if cmd == PLACE:  # a new placement row for one layer: `rows` experts
            row = np.array(link.recv((rows,), mx.int32))
            maps[layer], held = hold(layer, glus[layer], row)
            link.send(mx.array([held], dtype=mx.int32))
            continue
        if cmd != COMPUTE:
            raise NodeError(f"node {rank}: unknown command {cmd} from node 0")
        idx = link.recv((rows, kmax), mx.int32)
        x = link.recv((rows, spec_hidden(model)), wire)
        local = np.array(idx)
        slots = maps[layer][np.maximum(local, 0)]  # padding runs on some resident slot; ignored
        y = glus[layer](x.astype(model_dtype(model)), mx.array(slots.astype(np.uint32)))
        link.send(y.astype(wire))
    cache.close()
    st.close()


class AdaptiveScheduler:
    """The paper's next step, live: during a multi-node decode, every `every` tokens re-estimate
    expert popularity (an exponential moving average of the routes node 0 saw) and each remote
    node's link cost (its configured cost scaled by its measured round trip against the mean of
    all nodes'), re-run Algorithm 2, and move the experts whose node changed: node 0 sends each
    remote node the layer's new placement row and waits until it has loaded its experts."""

    def __init__(self, pi, nodes, links, layers, stats, every=8, decay=0.9, hot=0):
        self.pl, self.est, self.nodes = pl, pi.copy(), list(nodes)
        self.links, self.layers, self.stats = links, layers, stats
        self.every, self.decay, self.hot = every, decay, hot
        self.counts = np.zeros_like(pi)
        self.tokens = self.moves = self.replacements = 0
        self.history = []

    def observe(self, layer: int, idx: np.ndarray, rows: int):
        if rows != 1:  # the prefill is not the decode distribution
            return
        self.counts[layer] += np.bincount(idx.reshape(-1), minlength=self.counts.shape[1])
        if layer == len(self.layers) - 1:
            self.tokens += 1
            if self.tokens % self.every == 0:
                self.replace()

    def link_costs(self):
        rtts = {n: float(np.median(v)) for n, v in self.stats.get("node_rtt_s", {}).items() if v}
        if not rtts:
            return self.nodes
        mean = float(np.mean(list(rtts.values())))
        return [
            self.pl.Node(
                cost=nd.cost, capacity=nd.capacity, link=nd.link * (rtts[i] / mean if i in rtts and mean > 0 else 1.0)
            )
            for i, nd in enumerate(self.nodes)
        ]

    def replace(self):
        seen = self.counts / np.maximum(self.counts.sum(1, keepdims=True), 1)
        self.est = self.decay * self.est + (1 - self.decay) * seen
        self.counts[:] = 0
        nodes = self.link_costs()
        new = self.pl.algorithm2(self.est, nodes, 1.0, self.hot).executes_on()
        moved = 0
        for o, glu in enumerate(self.layers):
            old = glu._where
            row = np.maximum(new[o], 0)
            changed = int((row != old).sum())
            if not changed:
                continue
            header = mx.array([PLACE, o, len(row), 0], dtype=mx.int32)
            for link in self.links.values():
                link.send(header, mx.array(new[o].astype(np.int32)))
            for link in self.links.values():
                link.recv((1,), mx.int32)  # the node holds its new experts
            glu.set_placement(new[o])
            moved += changed
        self.moves += moved
        self.replacements += 1
        self.history.append(dict(token=self.tokens, moved=moved, links=[round(float(n.link), 4) for n in nodes]))


def launcher() -> str:
    """MLX's `mlx.launch`: beside this Python (a virtual environment), else on the PATH (e.g. an
    install with `pip --target`, whose scripts land in its own bin/)."""
    beside = Path(sys.executable).with_name("mlx.launch")
    found = str(beside) if beside.exists() else shutil.which("mlx.launch")
    if not found:
        raise NodeError(
            f"mlx.launch not found beside {sys.executable} or on the PATH: is mlx installed with its scripts?"
        )
    return found


def launch(nodes: int, args, out, timeout: float = 600, backend: str = "ring", hostfile=None):
    """Run engine.cluster.dist_run on `nodes` processes with `mlx.launch` and return rank 0's figures.

    `mlx.launch` reports a dead rank ("Node with rank N exited with code C") but may still exit
    with 0 after stopping the others, so success is rank 0's output file, written last and
    atomically; anything else raises NodeError naming the nodes that failed."""
    out = Path(out)
    cmd = [launcher(), "--backend", backend]
    cmd += ["--hostfile", str(hostfile)] if hostfile else ["-n", str(nodes)]
    cmd += ["--", sys.executable, "-m", "engine.cluster.dist_run", *map(str, args), "--out", str(out)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NodeError(f"the {nodes}-node run did not finish within {timeout:g} s") from None
    text = r.stdout + r.stderr
    exits = [(int(n), int(c)) for n, c in re.findall(r"Node with rank (\d+) exited with code (-?\d+)", text)]
    failed = [(n, c) for n, c in exits if c != 0]
    if failed or r.returncode or not out.exists():
        errors = [l for l in text.splitlines() if l.startswith("error:")]
        what = (
            "; ".join(
                f"node {n} exited with code {c}" + (" (stopped by the launcher)" if c == -15 else "") for n, c in failed
            )
            or f"mlx.launch exited with {r.returncode}"
        )
        raise NodeError(f"multi-node run failed: {what}" + (f"; {errors[0]}" if errors else "") + f"\n{text[-2000:]}")
    z = np.load(out)
    return json.loads(str(z["figures"])), z


def spec_hidden(model) -> int:
    return model.args.hidden_size


def model_dtype(model):
    return model.model.norm.weight.dtype


def serve_bare(group, dog, hidden: int, wire):
    """A remote node that answers every request with zeros of the result's shape: the bare
    exchange of the same bytes as an engine layer, without any compute."""
    link = Link(group, 0, dog, wire)
    while True:
        header = mx.distributed.recv((4,), mx.int32, 0, group=group)
        mx.eval(header)
        cmd, _, rows, kmax = (int(v) for v in np.array(header))
        if cmd == STOP:
            break
        link.recv((rows, kmax), mx.int32)
        link.recv((rows, hidden), wire)
        link.send(mx.zeros((rows, kmax, hidden), dtype=wire))


def bare_exchanges(links, hidden, kmax, count, wire):
    """Node 0's side of `serve_bare`: `count` layer-like round trips to every remote node;
    returns the seconds of each round trip (send to all, then receive from all)."""
    x = mx.zeros((1, hidden), dtype=wire)
    idx = mx.zeros((1, kmax), dtype=mx.int32)
    header = mx.array([COMPUTE, 0, 1, kmax], dtype=mx.int32)
    mx.eval(x, idx, header)
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        for link in links.values():
            link.send(header, idx, x)
        for link in links.values():
            link.recv((1, kmax, hidden), wire)
        out.append(time.perf_counter() - t0)
    return out


def stop_all(group, links):
    for link in links.values():
        mx.eval(mx.distributed.send(mx.array([STOP, 0, 0, 0], dtype=mx.int32), link.peer, group=group))
