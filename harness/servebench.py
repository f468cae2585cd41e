"""`bench serve`: the engine's server beside `mlx_lm.server` on the same model, under concurrent
clients. Each server runs in its own process on a loopback port; every repetition sends, to each
server in a rotating order, `--clients` clients at once, each asking `--requests` greedy completions
of `--tokens` tokens, after one such round untimed (its wall time is recorded: a fresh server
compiles a kernel for each batch size the first time it meets it). Reported per server: request
latency (p50, p99 over every request), requests and tokens per second of wall time, and the server
process's peak resident memory (Linux's VmHWM).

Both batch concurrent requests (mlx-lm's BatchGenerator); the engine's server also runs with
`--no-batch`, one request after the other, so that what batching gives on this machine is
measured beside it."""

import concurrent.futures
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from engine.models import registry

REFERENCE = "mlx_lm.server"  # the server each engine server is set against: mlx-lm's own, resident
PROMPTS = ["def add(a, b):", "import sys\n", "class Node:", "for i in range(", "x = [", "while True:",
           "The Python language", "# a list of"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command, log: Path, timeout: float = 600, cwd=None) -> tuple[subprocess.Popen, str]:
    """A server `command` on a free loopback port (its `--port`), its output into `log`; returns
    (process, base URL) once it listens."""
    port = free_port()
    proc = subprocess.Popen([*command, "--port", str(port)], cwd=cwd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(command)} ended: {Path(log).read_text()[-2000:]}") from None
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{' '.join(command)} did not listen within {timeout:g} s")


def peak_rss(pid: int) -> int | None:
    """The process's peak resident memory in bytes (Linux), else None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def ask(url: str, prompt: str, tokens: int) -> tuple[float, int]:
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out["usage"]["completion_tokens"]


def round_of(url: str, clients: int, requests: int, tokens: int) -> dict:
    """`clients` clients at once, each asking `requests` completions one after the other."""

    def client(i):
        return [ask(url, PROMPTS[(i + j) % len(PROMPTS)], tokens) for j in range(requests)]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    return dict(latency=[d for d, _ in done], tokens=sum(n for _, n in done), wall=wall, requests=len(done))


def run(a, model_id: str, slots: int | None, workdir: Path) -> dict:
    path = registry.model_dir(model_id)
    engine_cmd = [sys.executable, "-m", "engine", "serve", "--model", model_id, "--queue", str(a.clients + 1)]
    if slots is not None:
        engine_cmd += ["--slots", str(slots)]
    servers = {
        f"engine S={slots or 'E'}": engine_cmd,
        f"engine S={slots or 'E'} one at a time": [*engine_cmd, "--no-batch"],
        REFERENCE: [sys.executable, "-m", "mlx_lm", "server", "--model", str(path)],
    }
    procs, rounds = {}, {name: [] for name in servers}
    try:
        for name, cmd in servers.items():
            proc, base = start(cmd, workdir / f"{name.replace(' ', '_').replace('=', '')}.log")
            procs[name] = proc, base + "/v1/completions"
            ask(procs[name][1], "warm up", 2)  # the first request compiles and fills caches
        # A round at the measured load, untimed: a batch of each size compiles its kernels the first
        # time it runs (tens of seconds on CUDA), which a server pays once, not per request. Its wall
        # time is recorded, so that what a fresh server's first clients wait is said too.
        warmup = {name: round_of(procs[name][1], a.clients, a.requests, a.tokens)["wall"] for name in servers}
        names = list(servers)
        for rep in range(a.repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                rounds[name].append(round_of(procs[name][1], a.clients, a.requests, a.tokens))
        peak = {name: peak_rss(p.pid) for name, (p, _) in procs.items()}
    finally:
        for p, _ in procs.values():
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    out = dict(bench="serve", model=model_id, slots=slots, clients=a.clients, requests=a.requests,
               tokens=a.tokens, repeats=a.repeats, servers={})  # fmt: skip
    for name, rs in rounds.items():
        lat = np.array([x for r in rs for x in r["latency"]])
        out["servers"][name] = dict(
            command=servers[name][1:],
            latency_p50_s=float(np.percentile(lat, 50)),
            latency_p99_s=float(np.percentile(lat, 99)),
            requests_per_s=[r["requests"] / r["wall"] for r in rs],
            tok_s=[r["tokens"] / r["wall"] for r in rs],
            peak_rss_bytes=peak[name],
            warmup_s=warmup[name],
        )
    return out


def show(out: dict):
    print(f"{out['model']}: {out['clients']} clients at once x {out['requests']} greedy completions of "
          f"{out['tokens']} tokens, {out['repeats']} interleaved repetitions [min, max over repetitions]")  # fmt: skip
    for name, s in out["servers"].items():
        tok = s["tok_s"]
        rss = f"{s['peak_rss_bytes'] / 1e6:.0f} MB" if s["peak_rss_bytes"] else "n/a"
        print(f"  {name:16s} latency p50 {s['latency_p50_s']:.2f} s  p99 {s['latency_p99_s']:.2f} s  "
              f"{np.median(tok):.1f} tok/s [{min(tok):.1f}, {max(tok):.1f}]  peak RSS {rss}")  # fmt: skip
