"""`bench families`: the models users run, at their real sizes, one family at a time: each
registered shape that `mirrors` a real checkpoint, built if absent,
decoded resident and offloaded on this machine's memory.

Per family, every configuration beside resident decoding (mlx-lm's own model) in the same repeat:
the default install at slot counts holding `--fractions` of each layer's experts, at `--budgets`
(a card's memory: `--memory`), and the pinned install at 25 % where it runs. One engine is loaded
at a time (a family's host tier is the model's size) and its repeats alternate with resident's
(resident, engine, resident, engine, ...). Each decode goes through mlx-lm's `generate_step`
after a `--prompt-tokens` prompt: the time to first token, the decode tok/s, the greedy tokens
(compared with resident's), and the most device memory it held. Then one decode through the
engine's loop gives the bytes it read a token and where a token's host time goes, and the bus's
bandwidth, measured in the same run, gives the bus-bound limit those bytes imply: resident's time
a token over the larger of resident's time and the bus's time for the bytes.

Several families run one per process (`python -m harness bench families --model ID`), so that each
starts with the device's memory free; with `--record`, a family whose record this commit and
machine already hold is not measured again (resumable), and `--clean` removes a family's model and
store once its record is written (the H200's disk holds one family at a time). With `--exactness`,
the family's full-size exactness test of the GPU suite (tests/test_exactness.py) runs on the built
model before `--clean` removes it, and its outcome goes in the record: the suite itself never has
a family built. Each configuration says when it starts and what it took, so that a run cut short
says where its time went. Speed is reported, never asserted."""

import gc
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from engine import EngineConfig, device, load, memory, plan
from engine.config import resources_dir
from engine.models import registry
from engine.runtime.engine import open_store
from engine.runtime.loop import call_split, decode, time_split, totals

from . import manyrows, provenance, rawlog, records, suite
from .bus import bus_gb_s, tier_gb_s
from .report.tables.common import paired

PINNED_FRACTION = 0.25
BUDGETS_GB = (8, 16, 24)  # the cards issue 49 names: --memory budgets each family decodes at


def default_models() -> list:
    """The families: every registered shape that mirrors a real checkpoint, smallest first."""
    specs = registry.load_registry()
    return sorted((m for m, s in specs.items() if s.get("mirrors")), key=lambda m: (registry.shape(m)["layers"], m))


def configurations(mid: str, fractions, budgets) -> tuple[dict, dict, dict]:
    """({name: EngineConfig} to measure, {name: why it is not}, {name: the measured budget whose
    plan it shares}) for one family. Budgets that plan the same slots and install (a family that
    fits whole in 16 and in 24 GB) load the same engine: it is measured once, for the first."""
    shape = registry.shape(mid)
    E, K = shape["experts"], shape["top_k"]
    out, skipped, same = {}, {}, {}
    for f in fractions:
        name, s = f"{100 * f:g}%", round(f * E)
        if s < K:
            skipped[name] = f"{s} of {E} experts is below top_k {K}"
        else:
            out[name] = EngineConfig(slots=min(s, E))
    planned, first = plan(mid, budgets)["budgets"] if budgets else {}, {}
    for b in budgets:
        name, q = memory.fmt(b), planned[b]
        if not isinstance(q, memory.Plan):  # a budget that cannot hold the family, said as load says it
            skipped[name] = q
            continue
        key = (q.slots, q.install)
        if key in first:
            same[name] = first[key]
        else:
            first[key] = name
            out[name] = EngineConfig(memory=b)
    why = device.pinned_unavailable()
    name, s = f"pinned {100 * PINNED_FRACTION:g}%", max(K, round(PINNED_FRACTION * E))
    if why is None:
        out[name] = EngineConfig(slots=s, install="pinned")
    else:
        skipped[name] = why
    return out, skipped, same


def release():
    """Free what the configuration before held, before the next one's memory is read. Objects that
    refer to each other outlive `close()` and `del` until the garbage collector runs; left to
    chance, it can run during a later configuration's load and take the earlier engine's bytes off
    that one's count: the likely cause of one H100 run's same pinned configuration holding 9.2, 7.4
    and 9.2 GB at its 8, 16 and 24 GB budgets (`20261206T121437717Z-03eb37`). The device install's
    own cycle is gone (its stats hold the cache weakly); this keeps any other, mlx-lm's included,
    from counting."""
    gc.collect()
    mx.clear_cache()


def say(mid: str, since: float, what: str):
    print(f"[titan] {mid} +{time.perf_counter() - since:.0f} s: {what}", file=sys.stderr, flush=True)


EXACTNESS_TEST = (
    "tests/test_exactness.py::test_each_family_at_full_size_gives_mlx_lms_logits_at_a_quarter_of_its_experts"
)


def exactness(mid: str, root=None) -> dict:
    """The family's full-size exactness test (EXACTNESS_TEST[mid]) in a pytest process of its own,
    on the model this run built: its outcome, message or skip reason, seconds, and the `engine/`
    tree it ran on. Needs the repository's tests/ (a checkout, not an installed wheel)."""
    root = Path(root or provenance.REPO_ROOT)
    test = f"{EXACTNESS_TEST}[{mid}]"
    if not (root / test.split("::")[0]).is_file():
        raise FileNotFoundError(f"--exactness runs {test.split('::')[0]} of the repository: {root} has none")
    with tempfile.TemporaryDirectory(prefix="titan-exact-") as tmp:
        xml = Path(tmp) / "report.xml"
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", test]
        r = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        found = suite.parse_junit([xml]) if xml.exists() else None
    if not found or found["tests"] != 1:
        outcome, message = "error", f"pytest ran no such test (exit {r.returncode}): {(r.stdout + r.stderr)[-400:]}"
    elif found["passed"]:
        outcome, message = "passed", ""
    elif found["skipped"]:
        outcome, message = "skipped", found["skips"][0]["reason"]
    else:
        outcome, message = "failed", found["failures"][0]["message"]
    return dict(test=test, outcome=outcome, message=message, seconds=round(seconds, 1),
                engine_tree=suite.tree_hash(root / "engine"))  # fmt: skip


def _engine_loop(model, ids, tokens: int, layers: int) -> dict:
    """One decode through the engine's loop (pipelined, as generate_step is): the bytes it read a
    token, where a token's time goes, and the host's own work a MoE layer: building the token's
    graph, less what it spent waiting there (for the device at a synchronisation, for reads)."""
    recs = decode(model, ids, tokens, pipelined=True)[1]
    t = totals(recs)
    split, calls = time_split(recs), call_split(recs)
    host = calls.get("graph", 0.0) - split.get("sync", 0.0) - split.get("stall", 0.0)
    # a step's seconds run from one read-back to the next: the first decode step's also hold what
    # the prompt left queued, which the call split (the host's own calls) does not show
    apart = manyrows.first_apart([1e3 * r["seconds"] for r in recs if r["phase"] == "decode"])
    return dict(bytes_read_per_token=t["bytes_read"] / max(1, t["tokens"]), time_split_ms=split,
                call_split_ms=calls, host_ms_per_layer=host / max(1, layers),
                step_ms=dict(zip(("first", "later"), apart)) if apart else None)  # fmt: skip


def measure(a, mid: str) -> dict:
    """One family: everything of the module docstring, as one record's result."""
    started = time.perf_counter()
    say(mid, started, "building the model if absent")
    spec = registry.get_spec(mid)
    t0 = time.perf_counter()
    registry.model_dir(mid)  # built here if absent, with its progress
    build_s = time.perf_counter() - t0
    context = registry.context_of(mid)
    prompt_tokens = min(a.prompt_tokens or 2048, context - a.tokens - 1)
    budgets = [gb * 10**9 for gb in BUDGETS_GB] if a.budgets is None else a.budgets
    configs, skipped, same = configurations(mid, a.fractions, budgets)
    model, tok, _, path = registry.load(mid, lazy=True)
    t0 = time.perf_counter()
    store = open_store(mid, model, path)  # built here if absent
    store_s = time.perf_counter() - t0
    bus = bus_gb_s(store)
    tier = tier_gb_s(store)  # where the device install's misses cross the bus by its own kernel
    if tier is not None:
        bus["tier"] = tier
    store.close()
    least = plan(mid, [])["least"]
    del model
    say(mid, started, f"built ({build_s:.0f} s), store ({store_s:.0f} s); resident, {len(configs)} configurations next")
    ids = manyrows.long_ids(tok, prompt_tokens, a.set)
    release()
    base = mx.get_active_memory()
    ref = registry.load_reference(mid)[0]
    manyrows.first_token(ref, ids[:64], 2)  # warm-up: first-call compilation
    # resident's distinct greedy token sequences over all its runs, in the order first seen, and how often
    resident = dict(ttft=[], tok_s=[], later=[], first_ms=[], grew=0, held=mx.get_active_memory() - base, runs={})
    results = {}
    for i, (name, cfg) in enumerate(configs.items()):
        release()
        say(mid, started, f"configuration {i + 1} of {len(configs)}: {name}")
        before = mx.get_active_memory()
        try:
            eng = load(mid, cfg)
        except ValueError as e:  # a budget that cannot hold the family
            skipped[name] = str(e)
            continue
        try:
            manyrows.first_token(eng.model, ids[:64], 2)
            held = mx.get_active_memory() - before  # its weights and slot tables (the host tier is not MLX's)
            runs = dict(ttft=[], tok_s=[], later=[], first_ms=[], match=[], first=[], tokens=[], grew=0)
            for r in range(a.repeats):
                order = [("resident", ref), (name, eng.model)]
                pair = {}
                for who, m in order if r % 2 == 0 else order[::-1]:
                    pair[who] = manyrows.timed_generate(m, ids, a.tokens)
                got, want = pair[name], pair["resident"]
                for into, t in ((resident, want), (runs, got)):
                    into["ttft"].append(t["ttft"])
                    into["tok_s"].append(t["tok_s"])
                    into["grew"] = max(into["grew"], t["grew"])
                    # the first decode token apart from the rest: work the prompt left queued waits there
                    iv = t["intervals"]
                    first, later = manyrows.first_apart(iv) or (iv[0] if iv else 0.0, None)
                    into["first_ms"].append(1e3 * first)
                    into["later"].append(1 / later if later else t["tok_s"])
                resident["runs"][tuple(want["tokens"])] = resident["runs"].get(tuple(want["tokens"]), 0) + 1
                runs["match"].append(got["tokens"] == want["tokens"])
                runs["first"].append(first_difference(got["tokens"], want["tokens"]))
                runs["tokens"].append(list(got["tokens"]))
            loop = _engine_loop(eng.model, ids[:64], a.tokens, len(eng.store.layers))
            results[name] = dict(
                slots=eng.config.slots,
                experts=registry.shape(mid)["experts"],
                install=eng.install.name,
                ttft_s=manyrows.spread(runs["ttft"]),
                tok_s=manyrows.spread(runs["tok_s"]),
                x_resident=paired(runs["tok_s"], resident["tok_s"][-a.repeats :]),
                first_decode_ms=manyrows.spread(runs["first_ms"]),
                tok_s_after_first=manyrows.spread(runs["later"]),
                x_resident_after_first=paired(runs["later"], resident["later"][-a.repeats :]),
                ttft_x_resident=paired(resident["ttft"][-a.repeats :], runs["ttft"]),
                tokens_match=all(runs["match"]),
                first_difference=runs["first"],
                tokens_each_repeat=runs["tokens"],
                device_memory_bytes=held + runs["grew"],
                **loop,
            )
            r = results[name]
            say(mid, started, f"{name}: {r['tok_s']['median']:.1f} tok/s, x{r['x_resident']['median']:.2f} of "
                f"resident, tokens {tokens_said(r)}")  # fmt: skip
        finally:
            eng.close()
            del eng
            release()
    for r in results.values():  # where resident's own tokens vary, is each repeat's one of its runs?
        r["tokens_in_resident_runs"] = all(tuple(t) in resident["runs"] for t in r["tokens_each_repeat"])
    for name, first in same.items():  # the same engine as a budget measured above
        if first in results:
            results[name] = dict(results[first], same_as=first)
        else:
            skipped[name] = skipped.get(first, "not measured")
    res_tok_s = statistics.median(resident["tok_s"]) if resident["tok_s"] else None
    for r in results.values():  # the bus-bound limit of the bytes a token reads
        t_res = 1 / res_tok_s
        t_bus = r["bytes_read_per_token"] / (bus["gb_s"] * 1e9)
        r["limit_x_resident"] = t_res / max(t_res, t_bus)
        r["x_limit"] = r["x_resident"]["median"] / r["limit_x_resident"]
    return dict(
        bench="families",
        model=mid,
        mirrors=spec.get("mirrors"),
        shape=registry.shape(mid),
        weights_bytes=sum(f.stat().st_size for f in registry.model_dir(mid).glob("*.safetensors")),
        build_s=build_s,
        store_s=store_s,
        prompt_tokens=prompt_tokens,
        tokens=a.tokens,
        repeats=a.repeats,
        bus=bus,
        least_budget_bytes=least,
        resident=dict(
            tok_s=manyrows.spread(resident["tok_s"]) if resident["tok_s"] else None,
            ttft_s=manyrows.spread(resident["ttft"]) if resident["ttft"] else None,
            first_decode_ms=manyrows.spread(resident["first_ms"]) if resident["first_ms"] else None,
            tok_s_after_first=manyrows.spread(resident["later"]) if resident["later"] else None,
            device_memory_bytes=resident["held"] + resident["grew"],
            tokens_stable=len(resident["runs"]) <= 1,
            token_runs=[dict(tokens=list(t), runs=n) for t, n in resident["runs"].items()],
        ),  # fmt: skip
        configurations=results,
        skipped=skipped,
        seconds=time.perf_counter() - started,
    )


def first_difference(got: list, want: list) -> int | None:
    """Where a configuration's greedy tokens first part from resident's (0: the token of the
    prompt's prefill, the many-rows path; later: a decode step), None where they are equal."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def tokens_said(r: dict, resident_stable: bool = True) -> str:
    """A configuration's tokens against resident's in the same repeat, and where they first differed
    in each repeat. Where resident's own tokens varied between its runs, a difference says so, or
    that each repeat's tokens were those of one of resident's runs."""
    if r["tokens_match"]:
        return "= resident"
    if not resident_stable and r.get("tokens_in_resident_runs"):
        return "= one of resident's own runs (resident's tokens vary)"
    where = [f"{i}" if i is not None else "-" for i in r.get("first_difference", [])]
    said = "DIFFER" + (f" (first at token {', '.join(where)} of the repeats; 0: the prompt's)" if where else "")
    return said + ("; resident's own tokens vary too" if not resident_stable else "")


def show(out: dict):
    res = out["resident"]
    tier = out["bus"].get("tier")
    read = f"; {tier['how']}" + (f": {tier['gb_s']:.1f} GB/s" if tier["gb_s"] else "") if tier else ""
    print(f"{out['model']} ({out['weights_bytes'] / 1e9:.1f} GB; bus {out['bus']['gb_s']:.1f} GB/s, "
          f"{out['bus']['how']}{read}): resident {res['tok_s']['median'] if res['tok_s'] else float('nan'):.1f} tok/s, "
          f"{res['device_memory_bytes'] / 1e9:.2f} GB; the least budget that decodes "
          f"{out['least_budget_bytes'] / 1e9:.2f} GB")  # fmt: skip
    for k, r in out["configurations"].items():
        x = r["x_resident"]
        print(f"  {k:12s} S={r['slots']:<4d} {r['install']:8s} {r['tok_s']['median']:8.1f} tok/s "
              f"x{x['median']:.2f} [{x['min']:.2f}, {x['max']:.2f}] of resident, limit x{r['limit_x_resident']:.2f} "
              f"({r['x_limit']:.2f} of it); TTFT {1e3 * r['ttft_s']['median']:.0f} ms; "
              f"{r['device_memory_bytes'] / 1e9:.2f} GB; {r['bytes_read_per_token'] / 1e6:.1f} MB read a token; "
              f"host {r['host_ms_per_layer']:.3f} ms a layer; tokens "
              f"{tokens_said(r, res.get('tokens_stable', True))}" + (f" (the engine of {r['same_as']})"
              if "same_as" in r else ""))  # fmt: skip
    if not res.get("tokens_stable", True):
        seqs = res.get("token_runs", [])
        over = f": {len(seqs)} sequences over {sum(t['runs'] for t in seqs)} runs" if seqs else ""
        print(f"  resident's own greedy tokens differed between its runs{over}")
    for k, why in out["skipped"].items():
        print(f"  {k:12s} not measured: {why}")
    if "exactness" in out:
        e = out["exactness"]
        why = f": {e['message']}" if e["message"] else ""
        print(f"  full-size exactness: {e['outcome']} in {e['seconds']:.0f} s{why}")


def planned(a) -> list:
    """`bench plan`: each family's memory plan for a CUDA card of each `--budgets` (default: the
    cards of engine.memory.CARDS_GB), from its parameters' shapes alone (nothing is built, any
    machine, seconds): will it fit a card, and with how many of each layer's experts. One result
    a family."""
    budgets = a.budgets or [gb * 10**9 for gb in memory.CARDS_GB]
    out = []
    for mid in a.families or default_models():
        p = plan(mid, budgets, card=True)
        cards = {}
        for b, q in p["budgets"].items():
            fits = isinstance(q, memory.Plan)
            cards[f"{b / 1e9:g} GB"] = (dict(budget=b, slots=q.slots, install=q.install, planned_bytes=q.total)
                                        if fits else dict(budget=b, refused=q))  # fmt: skip
        out.append(dict(bench="plan", model=mid, mirrors=registry.get_spec(mid).get("mirrors"),
                        shape=registry.shape(mid), weights_bytes=p["weights"], resident_bytes=p["resident"],
                        install=p["install"], least_budget_bytes=p["least"], context=EngineConfig.context,
                        cards=cards))  # fmt: skip
        held = ", ".join(f"{k} {c.get('slots', '-')}" for k, c in cards.items())
        print(f"{mid}: resident {memory.fmt(p['resident'])}, the {p['install']} install from "
              f"{memory.fmt(p['least'])}; experts a layer: {held}")  # fmt: skip
    return out


def recorded(mid: str) -> str | None:
    """The record of `mid` this commit already has from this machine and device, under the same
    MLX and CUDA settings (a run under MLX_USE_CUDA_GRAPHS=0 is another run), if any."""
    here = (mid, provenance.git_state()["commit"], provenance.host_alias(), device.kind(), provenance.settings())
    folder = rawlog.RAW / "bench" / "families"
    for rec in records.read([folder]) if folder.exists() else []:
        if (rec["result"].get("model"), rec.get("commit"), rec.get("host"), rec.get("device"),
                rec.get("settings", {})) == here:  # fmt: skip
            return rec["_file"]
    return None


def clean(mid: str):
    """Remove a family's model and store (its record is written)."""
    for folder in (registry.model_dir(mid, build=False), resources_dir() / "stores" / mid):
        if folder.exists():
            shutil.rmtree(folder)
            print(f"[titan] removed {folder}", file=sys.stderr, flush=True)


def families(a):
    """`bench families`: one family in this process (`--model`), or each of them in its own."""
    wanted = [a.model] if a.model is not None else (a.families or default_models())
    tested = set(default_models())  # the exactness test's parameters: every shape that mirrors a checkpoint
    for mid in wanted if a.exactness else []:
        if mid not in tested:
            raise SystemExit(f"bench families --exactness: {mid} has no full-size exactness test (the families that "
                             f"have one: {', '.join(sorted(tested))})")  # fmt: skip
    if a.model is not None:
        out = measure(a, a.model)
        if a.exactness:  # on the model just built, before --clean removes it
            release()
            out["exactness"] = exactness(a.model)
        show(out)
        return out
    passed = ["--tokens", str(a.tokens), "--repeats", str(a.repeats), "--set", a.set,
              "--fractions", *map(str, a.fractions)]  # fmt: skip
    passed += ["--budgets", *map(str, a.budgets)] if a.budgets is not None else []
    passed += ["--prompt-tokens", str(a.prompt_tokens)] if a.prompt_tokens else []
    passed += ["--record"] if a.record else []
    passed += ["--clean"] if a.clean else []
    passed += ["--exactness"] if a.exactness else []
    failed = []
    for mid in wanted:
        done = recorded(mid) if a.record else None
        if done:
            print(f"[titan] {mid}: recorded at this commit on this machine already ({done})", file=sys.stderr,
                  flush=True)  # fmt: skip
            continue
        cmd = [sys.executable, "-m", "harness", "bench", "families", "--model", mid, *passed]
        print(f"[titan] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(mid)
    if failed:
        raise SystemExit(f"bench families: {', '.join(failed)} failed (the others are recorded)")
    return None
