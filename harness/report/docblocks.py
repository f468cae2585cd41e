"""Generated sentences inside hand-written pages.

README.md and docs/*.md are written by hand, but a sentence that states a result must come from
the raw records, never be typed. Such a sentence sits in a block

    <!-- generated:NAME -->
    ...
    <!-- /generated:NAME -->

whose inside only the published tables job writes (`snakemake figures`, from figures/tables/);
everything outside the blocks is left byte for byte. CI makes the tables again and fails on any
difference, so a block can never fall behind its records.
"""

import re
from pathlib import Path

import pandas as pd

from .. import suite_scope
from . import compare_runs
from .tables.bench import config_slots, measured_default, without_settings

# The run ids `snakemake all` gives itself (`auto`: commit, then host alias): a full run's
FULL_RUN = re.compile(r"^([0-9a-f]{12})(-dirty)?-(host-[0-9a-f]{10})-")


class BlockError(ValueError):
    """A page's generated block is malformed (unclosed, or opened twice)."""


def fill(text: str, name: str, body: str, where="the page") -> str:
    """`text` with the inside of block `name` replaced by `body` (unchanged if it has no such block)."""
    start, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
    if text.count(start) != text.count(end) or text.count(start) > 1:
        raise BlockError(f"{where}: block '{name}' must be opened and closed once ({start} ... {end})")
    if start not in text:
        return text
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: f"{start}\n{body.strip()}\n{end}", text, count=1)


def update(path, blocks: dict) -> bool:
    """Fill every named block of the page at `path`; returns whether the file changed."""
    path = Path(path)
    old = path.read_text()
    new = old
    for name, body in blocks.items():
        new = fill(new, name, body, where=str(path))
    if new != old:
        path.write_text(new)
    return new != old


def _run_said(r) -> str:
    """One GPU run of the suite: where, what it covered, and what it found."""
    verdict = "no failure" if not (r["failed"] or r["errors"]) else f"{r['failed'] + r['errors']} failed"
    ids = r.get("run_ids") or [r["run_id"]]
    links = ", ".join(f"[{i + 1}](results/raw/tests/suite/{x}.jsonl)" for i, x in enumerate(ids))
    text = (
        f"({r['chip']}, `engine/` tree `{r['engine_tree']}` at commit `{r['commit']}`, {r['scope']}, "
        + (f"records {links}" if len(ids) > 1 else f"[record](results/raw/tests/suite/{ids[0]}.jsonl)")
        + f"): {r['passed']} passed, {verdict}, {r['skipped']} skipped."
    )
    faults = [n for n in str(r.get("faulted_after") or "").split("; ") if n]
    not_run = [n for n in str(r.get("not_run") or "").split("; ") if n]
    names = list(dict.fromkeys(n for n in str(r["failures"] or "").split("; ") if n and n not in not_run + faults))
    if names:
        text += " Failed: " + ", ".join(f"`{n.split('::')[-1]}`" for n in names[:3])
        more = f" and {len(names) - 3} more ([docs/gpu.md](docs/gpu.md#the-test-suite-on-a-gpu))."
        text += more if len(names) > 3 else "."
    if faults:  # one fault poisons its process: what came after it there was not run, not failed
        text += " The device faulted in " + " and ".join(f"`{n.split('::')[-1]}`" for n in faults)
        after = "the one test" if len(not_run) == 1 else f"the {len(not_run)} tests"
        text += f", and its process ran none of {after} after it"
        text += " ([docs/gpu.md](docs/gpu.md#the-test-suite-on-a-gpu))."
    return text


def _width(r) -> float:
    """How much of the suite a run covered, to compare runs by: its paths (the whole suite: all)."""
    paths = r.get("paths")
    return float("inf") if r["scope"] == "the whole suite" or paths == 0 else float(paths or 0)


def _joined(parts: list) -> dict:
    """The parts of one split run of the suite as one row: their counts summed, their records listed."""
    if len(parts) == 1:
        return parts[0]
    row = dict(parts[-1], run_ids=[p["run_id"] for p in parts], paths=sum(p["paths"] for p in parts))
    row["scope"] = " + ".join(p["scope"].split()[0] for p in parts) + f" test files in {len(parts)} runs"
    for k in ("passed", "failed", "errors", "skipped"):
        row[k] = sum(p[k] for p in parts)
    for k in ("failures", "faulted_after", "not_run"):
        row[k] = "; ".join(str(p[k]) for p in parts if p[k])
    return row


def gpu_exactness(suite_runs: pd.DataFrame) -> str:
    """The README's sentence on the latest run of the test suite on a GPU, and, where that run
    covered less than an earlier one (a check of a fix), on the latest of the widest runs too."""
    gpu = suite_runs[suite_runs["device"] == "gpu"] if len(suite_runs) else suite_runs
    if not len(gpu):
        return (
            "No run of the test suite on a CUDA GPU is recorded yet (`scripts/device_gpu.sh OUT tests` makes one; "
            "[docs/gpu.md](docs/gpu.md#the-test-suite-on-a-gpu))."
        )
    rows = [r.to_dict() for _, r in gpu.iterrows()]
    # a suite split in parts where device time was short is said as one run (harness/suite_scope.py)
    ran = [(r["engine_tree"], suite_scope.files_of(str(r.get("files") or "tests").split())) for r in rows]
    parts = [rows[i] for i in suite_scope.split_run(ran)]
    latest, widest = _joined(parts), max(_width(r) for r in rows)
    text = "The suite's latest run on a GPU " + _run_said(latest)
    if _width(latest) < widest:
        wide = [r for r in rows if _width(r) == widest][-1]
        text += " The latest of its widest runs " + _run_said(wide)
    return text


# issue 29's targets for the device install on the full-size model (x resident, through generate_step)
DEVICE_TARGETS = {8: 0.4, 16: 0.6, 32: 0.75}


def device_install(bench: pd.DataFrame) -> str:
    """The README's sentence on the `device` install on a GPU: each S against resident decoding,
    through mlx-lm's own generate_step, beside the pinned install, from the latest such record.
    A ratio is the median of the repeats' ratios (each against resident decoding in the same
    repeat) with their range; a target inside that range is met or missed within the spread."""
    model = "olmoe-1b-7b-shape"
    rows = bench[(bench["device"] == "gpu") & (bench["model"] == model)]
    paired = rows[rows["figure"].str.match(r"x resident paired\[S=\d+/device@mlx-lm\]")]
    if not len(paired):
        return "The `device` install has no throughput record on a GPU yet (`scripts/device_gpu.sh OUT syncfree`)."
    # the latest run of the most slot counts (a later run of fewer, a change's check, is said after it)
    widths = paired.groupby("run_id")["figure"].nunique()
    run = max(widths[widths == widths.max()].index)
    b = rows[rows["run_id"] == run]
    fig = dict(zip(b["figure"], b["value"]))

    def at(fig, s, target) -> str | None:
        key = f"S={s}/device@mlx-lm"
        dev, pin = fig.get(f"x resident paired[{key}]"), fig.get(f"x resident paired[S={s}/pinned@mlx-lm]")
        if dev is None:
            return None
        dev = round(dev, 2)  # the verdict on the figure as printed
        lo, hi = fig[f"x resident paired_min[{key}]"], fig[f"x resident paired_max[{key}]"]
        if lo >= target:
            met = "met"
        elif hi < target:
            met = f"missed by {target - dev:.2f}"
        else:
            met = ("met" if dev >= target else "missed") + " within the spread"
        return (f"S = {s} {dev:.2f}× [{lo:.2f}, {hi:.2f}], {fig[f'tok_s[{key}]']:.0f} tok/s, target {target} {met}"
                + (f", `pinned` {pin:.2f}×" if pin is not None else ""))  # fmt: skip

    parts = [p for s, t in DEVICE_TARGETS.items() if (p := at(fig, s, t))]
    on_gpu = bench[(bench["device"] == "gpu") & (bench["model"] == model) & (bench["slots"] == 16)]
    oracle = device_oracle(one_run(on_gpu, "tok_s[oracle/"))
    if oracle:
        parts.append(oracle)
    mem = {s: fig.get(f"memory_bytes[S={s}/device@mlx-lm]") for s in DEVICE_TARGETS}
    res = fig.get("memory_bytes[S=E@mlx-lm]")
    text = (
        f"On an {b['chip'].iloc[0]}, `{model}` through mlx-lm's `generate_step`, the `device` install decodes at "
        f"these multiples of resident decoding (median of {int(fig['repeats[S=E@mlx-lm]'])} interleaved repeats of "
        f"{int(b.loc[b['figure'] == 'repeats[S=E@mlx-lm]', 'tokens'].iloc[0])} tokens, each against "
        "resident in the same repeat, [min, max]): " + "; ".join(parts)
    )
    if mem.get(16) and res:
        x = round(mem[16] / res, 2)
        held = "met" if x <= 0.35 else "missed"
        text += f"; S = 16 holds {x:.2f}× of resident's memory (target at most 0.35: {held})"
    later = paired.loc[paired["run_id"] > run, "run_id"]
    if len(later):  # a later check of fewer slot counts: its own chip and run, never mixed with the above
        c = rows[rows["run_id"] == later.max()]
        checked = [p for s, t in DEVICE_TARGETS.items() if (p := at(dict(zip(c["figure"], c["value"])), s, t))]
        text += f". The latest check, on an {c['chip'].iloc[0]}: " + "; ".join(checked)
    return text + " (`scripts/device_gpu.sh OUT syncfree`; `decode16`)."


# issue 48's targets on the full-size model (x resident, each in the same repeat): time to first
# token by (S, prompt tokens), the decode after the longest prompt, batch_generate by (S, B), and
# memory (at most this share of resident's)
PREFILL_TARGETS = {(16, 2048): 0.85, (8, 2048): 0.8, (16, 512): 0.7, (16, 128): 0.5}
AFTER_PROMPT_TARGET, MEMORY_TARGET = 0.7, 0.45
BATCH_TARGETS = {(16, 16): 0.3, (16, 4): 0.45}


def _verdict(fig: dict, name: str, inner: str, target: float, at_most=False) -> str:
    """Figure `name[inner]` as `x` [min, max] (its `name_min`, `name_max`) and whether `target` is
    met, missed by how much, or either within the spread."""
    x, lo, hi = (fig.get(f"{name}{p}[{inner}]") for p in ("", "_min", "_max"))
    x = round(x, 2)
    if lo is None:
        ok = x <= target if at_most else x >= target
        return f"{x:.2f}× (target {target} {'met' if ok else f'missed by {abs(x - target):.2f}'})"
    if at_most:
        lo, hi = -hi, -lo
    v, t = (-x, -target) if at_most else (x, target)
    if lo >= t:
        met = "met"
    elif hi < t:
        met = f"missed by {t - v:.2f}"
    else:
        met = ("met" if v >= t else "missed") + " within the spread"
    lo, hi = (-hi, -lo) if at_most else (lo, hi)
    return f"{x:.2f}× [{lo:.2f}, {hi:.2f}] (target {target} {met})"


def _config(fig: dict, prefix: str, s: int) -> str | None:
    """The default configuration's name at S = s in a run: the one without the next layer's area
    copied ahead (the engine's default since it measured no faster, EngineConfig.area_ahead), of
    the install `auto` gives on that machine where the run says which (`default[...]`)."""
    names = sorted({f.split("[", 1)[1].split("@")[0].rstrip("]") for f in fig if f.startswith(prefix)})
    mine = [n for n in names if n.startswith(f"S={s}/") and not n.endswith("/ahead")]
    mine.sort(key=lambda n: not fig.get(f"default[{n}]"))  # stable: the first by name otherwise
    return mine[0] if mine else None


def _has_targets(device: str, model: str) -> bool:
    return device == "gpu" and model == "olmoe-1b-7b-shape"


def many_rows(bench: pd.DataFrame, only_targets: bool = False) -> str:
    """The sentence on many rows at once: the latest `bench prefill` and `bench batch` of each
    machine and model, each configuration against resident in the same repeat, with issue 48's
    targets on a GPU's full-size model. `only_targets` (the README's): that model alone where it
    has runs; docs/gpu.md has every machine's."""
    b = bench[bench["bench"].isin(["prefill", "batch"])]
    if not len(b):
        return "No `bench prefill` or `bench batch` is recorded yet (`scripts/device_gpu.sh OUT manyrows`)."
    groups = list(b.groupby(["device", "chip", "model"], sort=True))
    if only_targets and any(_has_targets(d, m) for (d, _, m), _ in groups):
        groups = [((d, c, m), g) for (d, c, m), g in groups if _has_targets(d, m)]
    # a run of many figures before a check of a few (the README's reads the widest first)
    groups.sort(key=lambda kg: not (kg[1]["bench"] == "prefill").any())
    out = []
    for (device, chip, model), g in groups:
        targets = _has_targets(device, model)
        g = measured_default(g)
        pre = one_run(g[g["bench"] == "prefill"], "x resident[")
        bat = one_run(g[g["bench"] == "batch"], "x resident[")
        fig = dict(zip(pre["figure"], pre["value"]))
        parts = []
        lengths = sorted({int(f.rsplit("@", 1)[1][:-1]) for f in fig if f.startswith("x resident[")})
        for s in (8, 16, 32):
            c = _config(fig, "x resident[", s)
            if c is None:
                continue
            each = []
            for n in lengths:
                t = PREFILL_TARGETS.get((s, n)) if targets else None
                x = _verdict(fig, "x resident", f"{c}@{n}", t) if t else f"{fig[f'x resident[{c}@{n}]']:.2f}×"
                each.append(f"{n} {x}")
            parts.append(f"S = {s} ({c.split('/')[1]}): " + ", ".join(each))
        c16 = _config(fig, "x resident[", 16)
        if c16 is not None and lengths:
            n = lengths[-1]
            ahead = c16.replace("/union", "/ahead")
            if ahead != c16 and f"x resident[{ahead}@{n}]" in fig:
                ours, theirs = fig[f"x resident[{c16}@{n}]"], fig[f"x resident[{ahead}@{n}]"]
                parts.append(f"with the next layer's whole area copied ahead (`area_ahead`), S = 16 at {n} tokens "
                             f"{theirs:.2f}× against the default's {ours:.2f}×")  # fmt: skip
            after = _verdict(fig, "decode x resident", c16, AFTER_PROMPT_TARGET) if targets else (
                f"{fig[f'decode x resident[{c16}]']:.2f}×")  # fmt: skip
            mem = fig[f"memory x resident[{c16}]"]
            held = f"{'met' if mem <= MEMORY_TARGET else 'missed'}"
            parts.append(f"decode after the {n}-token prompt, S = 16: {after}; S = 16 held {mem:.2f}× of resident's "
                         "memory" + (f" (target at most {MEMORY_TARGET}: {held})" if targets else ""))  # fmt: skip
        bfig = dict(zip(bat["figure"], bat["value"]))
        bc = _config(bfig, "x resident[", 16)
        if bc is not None:
            sizes = sorted({int(f.rsplit("@B", 1)[1][:-1]) for f in bfig if f.startswith(f"x resident[{bc}@B")})
            each = []
            for B in sizes:
                t = BATCH_TARGETS.get((16, B)) if targets else None
                x = _verdict(bfig, "x resident", f"{bc}@B{B}", t) if t else f"{bfig[f'x resident[{bc}@B{B}]']:.2f}×"
                each.append(f"B = {B} {x}")
            parts.append(f"`batch_generate` at S = 16 ({bc.split('/')[1]}): " + ", ".join(each))
            # where the time goes: the bus, from the experts a step's rows named where the run
            # counted them, else where they name every expert of each layer
            named = [B for B in sizes if f"named experts a layer[B{B}]" in bfig]
            every = named or [B for B in sizes if bfig.get(f"rows name every expert[B{B}]")]
            if every:
                # recorded before the limit counted the slots: every expert read once a step
                held = all(f"bus limit x resident[{bc}@B{B}]" in bfig for B in every)
                lim = {B: bfig[f"bus limit x resident[{bc}@B{B}]" if held else f"bus limit x resident[B{B}]"]
                       for B in every}  # fmt: skip

                # counted since: the same bytes copied, then computed
                serial = {B: f"{bfig[f'bus serial x resident[{bc}@B{B}]']:.2f}× copying, then computing; "
                          if f"bus serial x resident[{bc}@B{B}]" in bfig else "" for B in every}  # fmt: skip
                limits = ", ".join(f"B = {B} {lim[B]:.2f}× ({serial[B]}reached "
                                   f"{bfig[f'x resident[{bc}@B{B}]'] / lim[B]:.2f} of it)" for B in every)  # fmt: skip
                # counted since: the fewest experts any cache of S slots brings in over the steps
                least = [B for B in every if f"bus cache limit x resident[{bc}@B{B}]" in bfig]
                if least:
                    limits += "; as no S slots hold just what each step's rows name, the fewest experts any " + (
                        f"{config_slots(bc)} slots bring in (Belady's rule) make it "
                        + ", ".join(f"B = {B} {bfig[f'bus cache limit x resident[{bc}@B{B}]']:.2f}× "
                                    f"({bfig[f'fewest misses a layer[{bc}@B{B}]']:.1f} a layer a step)"
                                    for B in least))  # fmt: skip
                if named:
                    counts = ", ".join(f"{bfig[f'named experts a layer[B{B}]']:.1f} at B = {B}" for B in named)
                    where = (f"from the experts a step's rows named a layer ({counts}, of {bfig['experts']:.0f}), "
                             f"all but the slots' {config_slots(bc)} read once a step")  # fmt: skip
                else:
                    where = "where a step's rows name every expert, " + (
                        f"all but the slots' {config_slots(bc)} read once a step" if held else "each read once a step"
                    )
                parts.append(f"the bus's limit {where} at "
                             f"the {bfig['bus_gb_s']:.1f} GB/s the run measured: {limits}")  # fmt: skip
        matched = [v for f, v in {**fig, **bfig}.items() if f.startswith("tokens_match[")]
        parts.append("greedy tokens equal resident's in " + ("every run" if all(matched) else
                     f"{int(sum(matched))} of {len(matched)} configurations"))  # fmt: skip
        reps = int(fig.get("repeats", bfig.get("repeats", 0)))
        ttft = "; time to first token by prompt tokens, as resident's time over the configuration's" if lengths else ""
        out.append(f"On {chip} ({device}), `{model}` ({reps} interleaved repeats, each against resident in the "
                   f"same repeat{ttft}, [min, max]): " + "; ".join(parts) + ".")  # fmt: skip
    return " ".join(out)


def many_rows_targets(bench: pd.DataFrame) -> str:
    """The README's table of issue 48's targets, each read from the latest run on a GPU's full-size
    model that measured it (`bench prefill`, `bench batch`, `bench serve`): the default path's
    ratio to resident (to mlx_lm.server for `serve`) in the same repeat, median [min, max], met or
    missed by how much, and where a batch is bound by the bus, its limit. Without such a run, the
    sentence of every machine (`many_rows`)."""
    b = bench[bench["bench"].isin(["prefill", "batch", "serve"])]
    b = b[[_has_targets(d, m) for d, m in zip(b["device"], b["model"])]]
    # the figure each bench's runs are told by: its ratio to the reference it is measured against
    prefixes = {"prefill": "x resident[", "batch": "x resident[", "serve": "x reference["}
    runs = {k: one_run(measured_default(b[b["bench"] == k]), prefix) for k, prefix in prefixes.items()}
    if not any(len(r) for r in runs.values()):
        return many_rows(bench, only_targets=True)
    rows, matched, where = [], [], []
    for kind, run in runs.items():
        if not len(run):
            continue
        fig = dict(zip(run["figure"], run["value"]))
        # its card and run id once, under the table
        where.append(f"`bench {kind}` `{run['run_id'].iloc[0]}` on {run['chip'].iloc[0].removeprefix('NVIDIA ')}")

        def add(what: str, x: str):
            rows.append((what, x))

        matched += [v for f, v in fig.items() if f.startswith("tokens_match[")]
        c = _config(fig, "x resident[", 16)
        if kind == "prefill":
            for (S, n), t in sorted(PREFILL_TARGETS.items(), key=lambda st: (st[0][1], -st[0][0])):
                cs = _config(fig, "x resident[", S)
                if cs is not None and f"x resident[{cs}@{n}]" in fig:
                    add(f"time to first token, {n}-token prompt, S = {S}", _verdict(fig, "x resident", f"{cs}@{n}", t))
            if c is not None:
                n = max(int(f.rsplit("@", 1)[1][:-1]) for f in fig if f.startswith(f"x resident[{c}@"))
                add(
                    f"decode after the {n}-token prompt, S = 16",
                    _verdict(fig, "decode x resident", c, AFTER_PROMPT_TARGET),
                )
                add(
                    "peak memory over the prompts, S = 16 (at most)",
                    _verdict(fig, "memory x resident", c, MEMORY_TARGET, at_most=True),
                )
        elif kind == "batch":
            for (_, B), t in sorted(BATCH_TARGETS.items(), key=lambda st: st[0][1]):
                if c is None or f"x resident[{c}@B{B}]" not in fig:
                    continue
                limit, serial, cache = (fig.get(f"bus {w} x resident[{c}@B{B}]") for w in
                                        ("limit", "serial", "cache limit"))  # fmt: skip
                add(
                    f"`batch_generate`, B = {B}, S = 16",
                    _verdict(fig, "x resident", f"{c}@B{B}", t)
                    + (f"; the bus's limit {limit:.2f}×" if limit is not None else "")
                    + (f" ({serial:.2f}× copying, then computing)" if serial is not None else "")
                    + (f", {cache:.2f}× with the fewest misses any 16 slots allow" if cache is not None else ""),
                )
        else:
            ref = next((f for f in fig if f.startswith("latency_p99_s[") and "mlx_lm" in f), None)
            theirs = f" (mlx_lm.server {fig[ref]:.2f} s)" if ref else ""
            for n in [f[len("x reference[") : -1] for f in fig if f.startswith("x reference[")]:
                if "one at a time" not in n:  # the batched server, the one issue 48 sets the target for
                    add(
                        f"{int(fig.get('clients', 0))} clients through `serve`, × mlx_lm.server",
                        _verdict(fig, "x reference", n, SERVE_TARGET)
                        + f"; p99 {fig[f'latency_p99_s[{n}]']:.2f} s{theirs}",
                    )
    out = ["| issue 48's target | × resident, median [min, max] |", "| --- | --- |"]
    out += [f"| {w} | {x} |" for w, x in rows]
    same = "every run" if all(matched) else f"{int(sum(matched))} of {len(matched)} configurations"
    return "\n".join(out) + f"\n\nGreedy tokens equal resident's in {same} of these. Runs: {'; '.join(where)}."


def _area(config: str) -> str:
    s, install, *area = config.split("/")
    way = {"union": ", the rows' area", "ahead": ", next layer ahead"}.get(area[0] if area else "", "")
    return f"{s.replace('=', ' = ')} ({install}{way})"


def many_rows_tables(bench: pd.DataFrame) -> str:
    """Tables of the latest `bench prefill` and `bench batch` of each machine and model: each
    configuration's time to first token by prompt length, its decode after the longest prompt and
    the memory it held (prefill), its aggregate tok/s by batch size (batch), all as resident's
    time over the configuration's in the same repeat, median [min, max]."""
    b = bench[bench["bench"].isin(["prefill", "batch"])]
    out = []
    for (device, chip, model), g in b.groupby(["device", "chip", "model"], sort=True):
        # the latest run of the default install, then the latest of another install alone
        for kind, default in (("prefill", True), ("batch", True), ("prefill", False), ("batch", False)):
            run = one_run(measured_default(g[g["bench"] == kind], default), "x resident[")
            if not len(run):
                continue
            fig = dict(zip(run["figure"], run["value"]))

            def cell(name, inner, fig=fig):
                x, lo, hi = (fig.get(f"{name}{p}[{inner}]") for p in ("", "_min", "_max"))
                if x is None:
                    return ""
                return f"{x:.2f}×" + ("" if lo is None or hi is None else f" [{lo:.2f}, {hi:.2f}]")

            pairs = [f.split("[", 1)[1][:-1].split("@") for f in fig if f.startswith("x resident[") and "@" in f]
            configs = sorted({c for c, _ in pairs if c.startswith("S=")}, key=lambda c: (config_slots(c), c))
            ats = sorted({a for _, a in pairs}, key=lambda a: int(a.lstrip("B")))
            if kind == "prefill":
                head = [f"{a} tokens" for a in ats] + [f"decode after {ats[-1]}", "memory held"]
                rows = [[cell("x resident", f"{c}@{a}") for a in ats]
                        + [cell("decode x resident", c), cell("memory x resident", c)] for c in configs]  # fmt: skip
                ref = "resident's time to first token: " + ", ".join(
                    f"{fig[f'ttft_ms[resident@{a}]']:.0f} ms" for a in ats if f"ttft_ms[resident@{a}]" in fig
                )
            else:
                head = [f"B = {a[1:]}" for a in ats]
                rows = [[cell("x resident", f"{c}@{a}") for a in ats] for c in configs]
                ref = "resident's tok/s: " + ", ".join(
                    f"{fig[f'tok_s[resident@{a}]']:.1f}" for a in ats if f"tok_s[resident@{a}]" in fig
                )
            reps = int(fig.get("repeats", 0))
            at = "".join(f", {w} `{run[c].iloc[0]}`" for w, c in (("run", "run_id"), ("at", "commit")) if c in run)
            out.append(f"`bench {kind}` on {chip} ({device}), `{model}`{at}, {reps} interleaved repeats ({ref}):")
            out.append("")
            out.append("| | " + " | ".join(head) + " |")
            out.append("| --- " * (len(head) + 1) + "|")
            out += ["| " + _area(c) + " | " + " | ".join(r) + " |" for c, r in zip(configs, rows)]
            if kind == "batch" and any(f"bus limit x resident[{c}@{a}]" in fig for c in configs for a in ats):
                # the bus carries all but the S the slots hold of what the rows named (counted since;
                # before, only where the rows name every expert)
                def per_b(label: str, figure: str, unit: str = "×", digits: int = 2, fig=fig, ats=ats) -> str:
                    """A table row of `figure` at each B (`{a}` in its name), blank where not measured."""
                    cells = [f"{fig[figure.format(a=a)]:.{digits}f}{unit}" if figure.format(a=a) in fig else ""
                             for a in ats]  # fmt: skip
                    return f"| {label} | " + " | ".join(cells) + " |"

                named = any(f"named experts a layer[{a}]" in fig for a in ats)
                if named:
                    out.append(
                        per_b("experts a step's rows named, a layer's mean", "named experts a layer[{a}]", "", 1)
                    )
                what = "each expert the rows named beyond the slots" if named else "every other expert"
                for S in sorted({config_slots(c) for c in configs}):
                    c = next(c for c in configs if c.startswith(f"S={S}/"))
                    out.append(per_b(f"the bus's limit at S = {S}, {what} read once a step",
                                     f"bus limit x resident[{c}@{{a}}]"))  # fmt: skip
                    if any(f"bus serial x resident[{c}@{a}]" in fig for a in ats):
                        out.append(per_b("the same, each step's copies before its compute",
                                         f"bus serial x resident[{c}@{{a}}]"))  # fmt: skip
                    if any(f"bus cache limit x resident[{c}@{a}]" in fig for a in ats):  # counted since
                        out.append(per_b(f"the fewest experts any {S} slots bring in, a layer a step",
                                         f"fewest misses a layer[{c}@{{a}}]", "", 1))  # fmt: skip
                        out.append(per_b("the bus's limit with those read once a step",
                                         f"bus cache limit x resident[{c}@{{a}}]"))  # fmt: skip
            elif kind == "batch" and any(f"bus limit x resident[{a}]" in fig for a in ats):  # every expert named
                limits = [f"{fig[f'bus limit x resident[{a}]']:.2f}×" if fig.get(f"rows name every expert[{a}]")
                          else "" for a in ats]  # fmt: skip
                out.append("| the bus's limit, every expert read once a step | " + " | ".join(limits) + " |")
            out.append("")
    return "\n".join(out).strip() or "No `bench prefill` or `bench batch` is recorded yet."


# issue 49's targets on a GPU: every family at each fraction at least this share of its bus-bound
# limit; the families named at 25 % at least this multiple of resident; 25 % at most this memory
FAMILY_LIMIT_TARGET = 0.9
FAMILY_RESIDENT_TARGET = {"qwen3-30b-a3b-shape": 0.88, "deepseek-v2-lite-shape": 0.88}
FAMILY_MEMORY_TARGET = 0.35
FRACTIONS = ("12.5%", "25%", "50%")


def _family_runs(bench: pd.DataFrame, settings: bool = False) -> list:
    """[((device, chip, model), {figure: value}, run id, commit)] of the latest `bench families`
    run of each machine and model, one made with no MLX or CUDA settings where there is one.
    `settings`: also the latest run under each other settings (the figures name them, `settings`)."""
    b = bench[bench["bench"] == "families"] if len(bench) else bench
    out = []
    for key, g in b.groupby(["device", "chip", "model"], sort=True):
        plain = without_settings(g)
        picked = [one_run(plain, "tok_s[")]
        if settings and plain is not g:  # groupby leaves out the plain runs' empty (NaN) settings
            picked += [one_run(h, "tok_s[") for k, h in g.groupby("settings", sort=True) if k]
        for run in picked:
            named = run["settings"].iloc[0] if "settings" in run else ""
            fig = dict(zip(run["figure"], run["value"]), settings=named if isinstance(named, str) else "")
            out.append((key, fig, run["run_id"].iloc[0], run["commit"].iloc[0]))
    return out


def _family_plans(bench: pd.DataFrame) -> dict:
    """{model: {figure: value}} of each family's latest `bench plan` (a plan for a CUDA card, the
    same from any machine), smallest resident first."""
    b = bench[bench["bench"] == "plan"] if len(bench) else bench
    plans = {}
    for model, g in b.groupby("model", sort=False):
        run = one_run(g, "slots[")
        plans[model] = dict(zip(run["figure"], run["value"]))
    return dict(sorted(plans.items(), key=lambda kv: (kv[1]["resident_bytes"], kv[0])))


def _plan_cards(plans: dict) -> list:
    """The cards the plans name, smallest first ("16 GB")."""
    names = {f[len("slots[") : -1] for fig in plans.values() for f in fig if f.startswith("slots[")}
    return sorted(names, key=lambda c: float(c.split()[0]))


def _held(slots, experts: int) -> str:
    """A plan's experts a layer at one card, as its tables write it."""
    return "" if slots is None else "no" if slots == 0 else "all" if slots >= experts else f"{int(slots)} of {experts}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def budget_gb(label: str) -> float | None:
    """The GB of a configuration named for its `--memory` budget (as engine.memory.fmt names it:
    `16.00 GB`), else None (a fraction, `pinned 25%`, resident)."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?) GB", label)
    return float(m.group(1)) if m else None


def _card(fig: dict, gb: int) -> str | None:
    """The configuration of a `gb` GB budget in a run."""
    labels = (f[len("tok_s[") : -1] for f in fig if f.startswith("tok_s["))
    return next((c for c in labels if budget_gb(c) == gb), None)


def over_budget(fig: dict) -> dict:
    """The `--memory` budgets of a `bench families` run whose configuration's peak memory was above
    the budget it was planned for: {budget in GB: peak bytes}."""
    budgets = {f: budget_gb(f[len("memory_bytes[") : -1]) for f in fig if f.startswith("memory_bytes[")}
    return dict(sorted((gb, fig[f]) for f, gb in budgets.items() if gb is not None and fig[f] > gb * 1e9))


def card_name(chip: str) -> str:
    """A GPU's name as a table cell names it: `NVIDIA H100 80GB HBM3` is the H100 (the full name
    stays in docs/gpu.md's tables and in every record)."""
    words = [w for w in chip.split() if w != "NVIDIA" and not re.fullmatch(r"\d+GB|HBM\w*|PCIe|SXM\d*|NVL", w)]
    return " ".join(words) or chip


def families_table(bench: pd.DataFrame) -> str:
    """The README's table, one row per family: its weights, what decoding with every expert in
    memory takes, the least budget that decodes, the experts a layer a 16 GB card holds and the
    cards that hold it (its `bench plan`), and the speed measured at a 16 GB budget against
    resident on each machine that ran `bench families`; then which measured families the bus bounds."""
    plans, runs = _family_plans(bench), _family_runs(bench)
    if not plans and not runs:
        return ("No `bench plan` or `bench families` is recorded yet: `python -m harness bench plan --record` plans "
                "each family for cards, `bench families --record --clean` measures them on this machine.")  # fmt: skip
    cards = _plan_cards(plans)
    models = list(plans) + sorted({m for (_, _, m), *_ in runs} - set(plans))
    out = ["| family | weights | resident | least budget | experts a layer, 16 GB | cards that hold it "
           "| at 16 GB: tok/s (× resident) |", "| --- " * 7 + "|"]  # fmt: skip
    bound = []
    for model in models:
        plan = plans.get(model, {})
        measured = [(chip, fig) for (_, chip, m), fig, _, _ in runs if m == model]
        some = plan or measured[0][1]
        at16 = _held(plan.get("slots[16 GB]"), int(some["experts"]))
        held = [c for c in cards if plan.get(f"slots[{c}]", 0) > 0]
        over = sorted({gb for _, fig in measured for gb in over_budget(fig)})
        speed = []
        for chip, fig in measured:
            card = _card(fig, 16)
            speed.append(f"{card_name(chip)}: " + (f"{fig[f'tok_s[{card}]']:.1f} ({fig[f'x resident[{card}]']:.2f}×)"
                                                   if card else "no 16 GB budget in its run"))  # fmt: skip
            speed[-1] += _tokens_word(fig)
            limits = {c: fig[f"limit x resident[{c}]"] for c in FRACTIONS if f"limit x resident[{c}]" in fig}
            if limits and min(limits.values()) < 1:
                worst = min(limits, key=limits.get)
                bound.append(f"`{model}` ({card_name(chip)}) {limits[worst]:.2f}× at {worst}")
        resident = plan.get("resident_bytes") or max(fig["memory_bytes[resident]"] for _, fig in measured)
        out.append(f"| `{model}` | {_gb(some['weights_bytes'])} | {_gb(resident)} | {_gb(some['least_budget_bytes'])} "
                   f"| {at16} | {f'{held[0]} and up' if held else ''}{_over_word(over)} "
                   f"| {'; '.join(speed) or 'not yet'} |")  # fmt: skip
    text = "\n".join(out)
    if bound:
        text += ("\n\nBound by the bus (what a token reads at its fewest experts caps it at this multiple of "
                 "resident): " + "; ".join(bound) + ".")  # fmt: skip
    return text


def _over_word(over: list) -> str:
    """The README's word where a budget's measured peak was above the budget (the plan's figure
    for a card is then not what the card needs)."""
    return f" (plan; peak over at {', '.join(f'{gb:g}' for gb in over)} GB)" if over else ""


def _tokens_word(fig: dict) -> str:
    """The README's word on a run's tokens: nothing where every configuration's equal resident's;
    where resident's own varied between its runs, that, and whether the engine's were among them."""
    differ = [f[len("tokens_match[") : -1] for f, v in fig.items() if f.startswith("tokens_match[") and not v]
    if not differ:
        return ""
    if not fig.get("resident tokens unstable"):
        return ", tokens DIFFER"
    if all(fig.get(f"tokens in resident runs[{c}]") for c in differ):
        return ", resident's tokens vary"
    # where resident's own greedy tokens vary, the teacher-forced full-size test decides exactness
    exact = {1.0: "; logits exact", 0.0: "; logits DIFFER"}.get(fig.get("exact_full_size"), "")
    return f", tokens DIFFER (resident's vary too{exact})"


def _tokens_cell(fig: dict, c: str) -> str:
    if fig[f"tokens_match[{c}]"]:
        return "= resident"
    unstable = bool(fig.get("resident tokens unstable"))
    if unstable and fig.get(f"tokens in resident runs[{c}]"):
        return "= one of resident's own runs"
    first = fig.get(f"first difference[{c}]")
    said = "DIFFER" if first is None else (
        "DIFFER from the prompt's token" if first == 0 else f"DIFFER from decode token {int(first)}")  # fmt: skip
    return said + (" (resident's own vary too)" if unstable else "")


def families_plan(bench: pd.DataFrame) -> str:
    """docs/gpu.md's table of each family's latest `bench plan`: the experts a layer each card's
    budget holds beside the rest of the model ("all": every expert in memory, "no": it cannot)."""
    plans = _family_plans(bench)
    if not plans:
        return "No `bench plan` is recorded yet: `python -m harness bench plan --record` plans each family for cards."
    cards = _plan_cards(plans)
    out = ["| family | weights | every expert in memory | least budget | " + " | ".join(cards) + " |",
           "| --- " * (4 + len(cards)) + "|"]  # fmt: skip
    for model, fig in plans.items():
        cells = [_held(fig.get(f"slots[{c}]"), int(fig["experts"])) for c in cards]
        out.append(f"| `{model}` | {_gb(fig['weights_bytes'])} | {_gb(fig['resident_bytes'])} | "
                   f"{_gb(fig['least_budget_bytes'])} | " + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(out)


def families_detail(bench: pd.DataFrame) -> str:
    """docs/gpu.md's tables: every configuration of each family's latest run, against resident in
    the same repeat, its bus-bound limit, and issue 49's targets on a GPU."""
    runs = _family_runs(bench, settings=True)
    if not runs:
        return "No `bench families` is recorded yet."
    out = []
    for (device, chip, model), fig, run_id, commit in runs:
        configs = sorted((f[len("tok_s[") : -1] for f in fig if f.startswith("tok_s[") and f != "tok_s[resident]"),
                         key=lambda c: fig[f"memory_bytes[{c}]"])  # fmt: skip
        gpu = device == "gpu"
        res = fig.get("tok_s[resident]")
        out.append(f"`bench families` on {chip} ({device}), `{model}` ({int(fig['layers'])} layers, "
                   f"{int(fig['experts'])} experts), run `{run_id}` at `{commit}`"
                   + (f" under `{fig['settings']}`" if fig["settings"] else "")
                   + f", {int(fig['repeats'])} repeat{'s' if int(fig['repeats']) != 1 else ''} each "
                   f"against resident in the same repeat; resident {res or float('nan'):.1f} tok/s, "
                   f"{_gb(fig['memory_bytes[resident]'])}; the bus {fig['bus_gb_s']:.1f} GB/s"
                   + (f" (the device install's kernel read its host tier at {fig['tier_gb_s']:.1f})"
                      if "tier_gb_s" in fig else "") + ":")  # fmt: skip
        out.append("")
        out.append("| | S | tok/s | × resident [min, max] | bus-bound limit | × its limit | first token | memory "
                   "(× resident) | read a token | host a layer | tokens |")  # fmt: skip
        out.append("| --- " * 11 + "|")
        over = over_budget(fig)
        for c in configs:
            x, lo, hi = (fig[f"x resident{p}[{c}]"] for p in ("", "_min", "_max"))
            gb = budget_gb(c)
            above = f", OVER its {gb:g} GB" if gb in over else ""
            lim, xl = fig[f"limit x resident[{c}]"], fig[f"x limit[{c}]"]
            mark = ""
            if gpu and c in FRACTIONS and xl < FAMILY_LIMIT_TARGET:
                mark = f" (target {FAMILY_LIMIT_TARGET}: missed by {FAMILY_LIMIT_TARGET - xl:.2f})"
            out.append(f"| {c} | {int(fig[f'slots[{c}]'])} | {fig[f'tok_s[{c}]']:.1f} | "
                       f"{x:.2f}× [{lo:.2f}, {hi:.2f}] | {lim:.2f}× | {xl:.2f}{mark} | {fig[f'ttft_ms[{c}]']:.0f} ms | "
                       f"{_gb(fig[f'memory_bytes[{c}]'])} ({fig[f'memory x resident[{c}]']:.2f}×{above}) | "
                       f"{fig[f'bytes_read_per_token[{c}]'] / 1e6:.1f} MB | {fig[f'host_ms_per_layer[{c}]']:.3f} ms | "
                       f"{_tokens_cell(fig, c)} |")  # fmt: skip
        if "first_decode_ms[resident]" in fig:
            out.append("")
            out.append(_first_decode_sentence(fig, configs))
        if fig.get("resident tokens unstable"):
            out.append("")
            out.append("Resident's own greedy tokens differed between its runs in this run (mlx-lm's model alone), "
                       "so a configuration's tokens against resident's in the same repeat do not decide exactness: "
                       "its full-size exactness test, teacher-forced, does.")  # fmt: skip
        if "exact_full_size" in fig:
            out.append("")
            out.append(f"Its full-size exactness test (`tests/test_exactness.py`, `[{model}]`, logits at 25 % of the "
                       f"experts against mlx-lm's) {'passed' if fig['exact_full_size'] else 'FAILED'} on this "
                       f"run's model.")  # fmt: skip
        if gpu and "x resident[25%]" in fig:
            said = []
            t = FAMILY_RESIDENT_TARGET.get(model)
            if t is not None:
                said.append(f"25 % of experts {_verdict(fig, 'x resident', '25%', t)} of resident")
            mem = _verdict(fig, "memory x resident", "25%", FAMILY_MEMORY_TARGET, at_most=True)
            said.append(f"memory at 25 % {mem}")
            out.append("")
            out.append("Targets: " + "; ".join(said) + ".")
        out.append("")
    return "\n".join(out).strip()


def _first_decode_sentence(fig: dict, configs: list) -> str:
    """A families run's first decode token apart from the rest (work the prompt left queued waits
    for it), through mlx-lm's generate_step and, where recorded, through the engine's loop."""
    parts = [f"resident {fig['first_decode_ms[resident]']:.0f} ms, then {fig['tok_s_after_first[resident]']:.1f} tok/s"]
    for c in configs:
        if f"first_decode_ms[{c}]" in fig:
            parts.append(f"{c} {fig[f'first_decode_ms[{c}]']:.0f} ms, then {fig[f'tok_s_after_first[{c}]']:.1f} "
                         f"({fig[f'x resident after first[{c}]']:.2f}×)")  # fmt: skip
    text = ("The first decode token apart from the rest (what the prompt left queued waits for it; medians "
            "of the repeats, × resident's after its own first): " + "; ".join(parts) + ".")  # fmt: skip
    loop = [f"{c} {fig[f'loop_first_ms[{c}]']:.0f} / {fig[f'loop_later_ms[{c}]']:.1f}" for c in configs
            if f"loop_first_ms[{c}]" in fig]  # fmt: skip
    if loop:
        text += (" The engine's loop over a 64-token prompt, ms a step, its first decode step / the rest's mean: "
                 + "; ".join(loop) + ".")  # fmt: skip
    return text


ORACLE_TARGET = 0.8  # issue 29: oracle prefetch at S = 16, x resident
# Where the engine's device install queues a prefetch by default (installs.DeviceInstall.overlap_default;
# this layer imports no engine, a test holds the two together): on the decode stream.
DEVICE_PREFETCH_ON_DECODE_STREAM = True
STREAMS = {True: ("the decode stream", "--overlap off"), False: ("a stream of its own", "--overlap on")}


def one_run(rows: pd.DataFrame, figure: str) -> pd.DataFrame:
    """The rows of the latest run that has a figure beginning with `figure` (bench run ids begin
    with their UTC start), so that a sentence never mixes figures of different runs."""
    runs = rows.loc[rows["figure"].str.startswith(figure), "run_id"] if "run_id" in rows else []
    return rows[rows["run_id"] == max(runs)] if len(runs) else rows.iloc[:0]


def device_oracle(prefetch: pd.DataFrame) -> str:
    """The oracle's prefetch on the device install at S = 16 against resident decoding in the same
    `bench prefetch` run (medians over its prompts), at its best depth, on the engine's default
    stream beside the other stream (`/serial`: the decode stream) and demand loading where the run
    has them; a default slower than either is said so, not left to be read off."""
    fig = dict(zip(prefetch["figure"], prefetch["value"]))
    res = fig.get("tok_s[resident/d0/device]")

    def x_res(key: str):
        """A configuration against resident decoding: its prompts each against resident decoding
        of that prompt where the run pairs them, else its tok/s against resident's median, so
        that one sentence never sets a paired ratio beside an unpaired one."""
        if f"x resident paired[{key}]" in fig:
            return fig[f"x resident paired[{key}]"]
        tok = fig.get(f"tok_s[{key}]")
        return tok / res if tok and res else None

    def best(serial: bool):
        depths = {
            f.split("/d")[1].split("/")[0]: x_res(f[len("tok_s[") : -1])
            for f in fig
            if f.startswith("tok_s[oracle/d") and ("/serial" in f) == serial
        }
        return max(depths.items(), key=lambda kv: kv[1]) if depths else None

    # the default's figure, or where a run lacks it the other stream's, named as such
    default = DEVICE_PREFETCH_ON_DECODE_STREAM
    serial = default if best(default) else not default
    main, other = best(serial), best(not serial)
    if not res or not main:
        return ""
    d, demand = main[0], x_res("none/d0/device")
    key = f"oracle/d{d}" + "/serial" * serial + "/device"
    tok = fig[f"tok_s[{key}]"]
    ratio = round(main[1], 2)
    if f"x resident paired[{key}]" in fig:  # each prompt against resident decoding of that prompt
        lo, hi = fig[f"x resident paired_min[{key}]"], fig[f"x resident paired_max[{key}]"]
        spread = f"[{lo:.2f}, {hi:.2f}], each prompt against resident decoding of it"
    else:  # records from before the pairing: the prompts' tok/s against resident's median
        lo, hi = fig.get(f"tok_s_min[{key}]", tok) / res, fig.get(f"tok_s_max[{key}]", tok) / res
        spread = f"{tok:.0f} [{lo * res:.0f}, {hi * res:.0f}] tok/s over prompts against resident's {res:.0f}"
    met = "met" if ratio >= ORACLE_TARGET else f"missed by {ORACLE_TARGET - ratio:.2f}"
    # the prompts' spread: a target some prompts meet and others miss is met or missed within it
    if len({ratio >= ORACLE_TARGET, lo >= ORACLE_TARGET, hi >= ORACLE_TARGET}) > 1:
        met += " within the spread"
    name, flag = STREAMS[serial]
    how = "the default" if serial == default else f"`{flag}`"
    text = f"the oracle's prefetch at S = 16 {ratio:.2f}× ({spread}) at its best depth (d = {d}), on {name}"
    text += f" ({how}), target {ORACLE_TARGET} {met}"
    if other:
        text += f", on {STREAMS[not serial][0]} (`{STREAMS[not serial][1]}`) {other[1]:.2f}× (d = {other[0]})"
    if demand:
        text += f", demand loading {demand:.2f}× in the same run"
    rivals = {STREAMS[not serial][0]: other[1] if other else None, "demand loading": demand}
    slower = [n for n, v in rivals.items() if v and v > main[1]]
    if slower:
        who = "the default prefetch" if serial == default else "this prefetch"
        text += f" ({who} slower than " + " and ".join(slower)
        # a rival inside the default's own spread is a difference this run cannot tell from noise
        within = [n for n in slower if rivals[n] <= hi]
        if within:
            text += ", within the spread" if within == slower else f", {' and '.join(within)} within the spread"
        text += ")"
    if demand and ratio < ORACLE_TARGET:  # a missed target says where the time goes
        text += f"; a token {1e3 / tok:.2f} ms against demand loading's {1e3 / fig['tok_s[none/d0/device]']:.2f}"
        text += f" and resident's {1e3 / res:.2f}"
        keys = (f"oracle/d{d}" + "/serial" * serial, "none/d0", "resident/d0")
        stalls = [fig.get(f"stall_ms_per_token[{k}/device]") for k in keys[:2]]
        graph, wait, queue = ([fig.get(f"{f}_ms[{k}/device]") for k in keys] for f in ("graph", "eval", "queue"))
        if fig.get(f"pipelined[{keys[0]}/device]") and None not in graph + wait + queue:
            # the host builds a token while the device runs the last one: who waited for whom
            if max(wait) < 0.1:
                text += f", all of it the host's (none waited over {max(wait):.2f} ms for its token)"
            else:
                text += f", of which waiting for its token {wait[0]:.2f} ms against {wait[1]:.2f} and {wait[2]:.2f}"
            text += f": building its graph {graph[0]:.2f} against {graph[1]:.2f} and {graph[2]:.2f}, MLX taking"
            text += f" it {queue[0]:.2f} against {queue[1]:.2f} and {queue[2]:.2f}"
            return text
        if stalls == [0, 0]:  # neither waits for a read: the difference is the prefetch's own work
            text += ", neither waiting for a read: the rest is the prefetch's own launches and predictions"
        if None not in graph:  # of which the host, building the token's graph (the rest: its evaluation)
            text += f"; the host builds its graph in {graph[0]:.2f} ms against {graph[1]:.2f} and {graph[2]:.2f}"
    return text


PAYS_MODEL = "olmoe-wide-trained"  # learnt routing at OLMoE's expert sizes (docs/gpu.md)


def _against(row, demand) -> str:
    """Where a configuration's tok/s lies against demand loading's, by their [min, max] ranges."""
    if row["tok_s_min"] > demand["tok_s_max"]:
        return "above"
    if row["tok_s_max"] < demand["tok_s_min"]:
        return "below"
    return "within"


def prediction_pays(online: pd.DataFrame, full: bool) -> str:
    """Gate C's answer on the GPU for `PAYS_MODEL`, from the bars of figures/prediction_pays.png (one
    panel per install path and prompt set: demand loading, the best fitted predictor and the best
    oracle depth at each S < E), each against demand loading in the same run, by their spreads.
    `full` gives every figure with its range (docs/gpu.md); otherwise ratios only (the README)."""
    from .plotting import answer_rows, depth_floor, install_panels  # matplotlib's import only where needed

    df = online[(online["device"] == "gpu") & (online["model"] == PAYS_MODEL) & (online["tier"] == "page_cache")]
    out = []
    for (chip, pset), group in sorted(df.groupby(["chip", "prompt_set"]), key=lambda kv: kv[0]):
        for install, g in install_panels(group):
            parts = []
            for s, at in answer_rows(g, probe=True).groupby("slots"):
                kinds = {r["kind"]: r for r in at.to_dict("records")}
                demand = kinds.pop("demand", None)
                if demand is None or not kinds:
                    continue
                said = []
                for kind in ("oracle", "best fitted", "probe"):
                    if kind not in kinds:
                        continue
                    r = kinds[kind]
                    what = kind
                    if kind == "probe":  # the probe's best, where another fitted predictor beat it
                        what += f" ({depth_floor(r)})"
                    if kind == "best fitted":
                        what += f" ({r['predictor']} {depth_floor(r)})"
                    fig = f" {r['tok_s']:.1f} [{r['tok_s_min']:.1f}, {r['tok_s_max']:.1f}]," if full else ""
                    said.append(f"{what}{fig} {r['tok_s'] / demand['tok_s']:.2f}× {_against(r, demand)}")
                head = f"S = {s:g}" + (f" (demand {demand['tok_s']:.1f} [{demand['tok_s_min']:.1f}, "
                                       f"{demand['tok_s_max']:.1f}] tok/s)" if full else "")  # fmt: skip
                parts.append(f"{head}: " + ", ".join(said))
            if parts:
                out.append(f"`{install}` install, {pset} prompts ({chip}): " + "; ".join(parts))
    if not out:
        return f"No gate C run of `{PAYS_MODEL}` on a GPU is recorded yet (`scripts/device_gpu.sh OUT wide`)."
    lead = (f"Gate C of `{PAYS_MODEL}` on a GPU: the oracle at its best depth, the fitted predictor "
            "fastest at each S and the probe's best where that is another, as multiples of demand "
            "loading's tok/s in the same run (medians of "
            "interleaved repetitions"
            + (", [min, max]" if full else "")
            + "; above or below: outside both spreads; within: inside them). ")  # fmt: skip
    return lead + ". ".join(out) + "."


SERVE_TARGET = 0.3  # issue 48: 8 clients through `serve` on the GPU's full-size model, x mlx_lm.server


def serve_bench(bench: pd.DataFrame) -> str:
    """docs/serve.md's sentence on the latest `bench serve` of each machine kind: each server's
    latency, tok/s and memory; each engine server's speed against mlx_lm.server, repetition by
    repetition (issue 48's target on a GPU's full-size model), and the untimed first round's wall
    time where the run has one (a fresh server's kernel compilation)."""
    b = bench[bench["bench"] == "serve"]
    if not len(b):
        return "No `bench serve` is recorded yet (`python -m harness bench serve --record`)."
    out = []
    for (device, chip, model), g in b.groupby(["device", "chip", "model"], sort=True):
        fig = dict(zip(g["figure"], g["value"]))
        names = sorted({f.split("[", 1)[1][:-1] for f in fig if f.startswith("latency_p50_s[")})
        each = []
        for n in names:
            rss = fig.get(f"peak_rss_bytes[{n}]")
            each.append(f"{n}: latency p50 {fig[f'latency_p50_s[{n}]']:.2f} s, p99 {fig[f'latency_p99_s[{n}]']:.2f} s, "
                        f"{fig[f'tok_s[{n}]']:.1f} tok/s [{fig[f'tok_s_min[{n}]']:.1f}, {fig[f'tok_s_max[{n}]']:.1f}]"
                        + (f", peak RSS {rss / 1e6:.0f} MB" if rss else ""))  # fmt: skip
            if f"x reference[{n}]" in fig:
                x = _verdict(fig, "x reference", n, SERVE_TARGET) if _has_targets(device, model) else (
                    f"{fig[f'x reference[{n}]']:.2f}× [{fig[f'x reference_min[{n}]']:.2f}, "
                    f"{fig[f'x reference_max[{n}]']:.2f}]")  # fmt: skip
                each[-1] += f", {x.replace('×', '× of mlx_lm.server', 1)}"
            if f"warmup_s[{n}]" in fig:
                each[-1] += f", first round (untimed) {fig[f'warmup_s[{n}]']:.1f} s"
        asked = f", {int(fig['requests'])} requests to each, every one answered" if "requests" in fig else ""
        out.append(f"On {chip} ({device}), `{model}`, {int(fig['clients'])} clients at once{asked}: "
                   + "; ".join(each) + ".")  # fmt: skip
    return " ".join(out)


def full_runs(raw) -> dict:
    """{run id: (host alias, commit)} of every full run of `all` whose raw files are under `raw`."""
    runs = {}
    for f in Path(raw).rglob("*.jsonl"):
        m = FULL_RUN.match(f.name)
        if m:
            runs[f"{m.group(1)}{m.group(2) or ''}-{m.group(3)}"] = (m.group(3), m.group(1))
    return runs


def run_agreement(raw, by_file=None) -> str:
    """docs/workflow.md's sentence on whether two runs reach the same verdicts: the two latest
    full runs on one machine, compared by compare_runs.py (`by_file`: the raw files' records under
    `raw`, if already read)."""
    runs = full_runs(raw)
    by_file = compare_runs.read_by_file(Path(raw)) if by_file is None else by_file
    ends = compare_runs.run_ends(by_file, list(runs))
    by_host = {}
    for run in sorted(runs, key=lambda r: ends[r]):
        by_host.setdefault(runs[run][0], []).append(run)
    pairs = [v[-2:] for v in by_host.values() if len(v) >= 2]
    if not pairs:
        return "No two full runs of `all` on one machine are recorded yet."
    a, b = max(pairs, key=lambda p: ends[p[1]])  # the machine whose latest full run ended last
    df = compare_runs.compare(Path(raw), a, b, by_file)
    n = len(df)
    same = {c: int((df[f"{c}_a"] == df[f"{c}_b"]).sum()) for c in compare_runs.VERDICTS}
    decided = {x: int(df[f"direction_{x}"].isin(["yes", "no"]).sum()) for x in ("a", "b")}
    flips = df[
        df["direction_a"].isin(["yes", "no"])
        & df["direction_b"].isin(["yes", "no"])
        & (df["direction_a"] != df["direction_b"])
    ]
    text = (
        f"The two latest full runs on one machine, `{a}` and `{b}` (`python -m harness.report.compare_runs "
        f"{a} {b}`): of {n} claims both measured, `direction` came out the same in {same['direction']} (decided in "
        f"{decided['a']} and {decided['b']} of them) and `within_tolerance` in {same['within_tolerance']}; "
    )
    if len(flips):
        text += f"{len(flips)} went from yes to no or back: " + "; ".join(
            f"{r.claim} ({r.direction_a} -> {r.direction_b})" for r in flips.itertuples()
        )
        text += "."
    else:
        text += "none went from yes to no or back: every change was between a decision and `unresolved`."
    return text


def build(tables: dict, root=".", raw=None, by_file=None) -> list:
    """Fill every page's blocks from the published tables (and, for the run agreement, the raw
    logs under `raw`, or their records by file if already read); returns the pages that changed."""
    blocks = {"gpu-exactness": gpu_exactness(tables["suite"])}
    if "bench" in tables:
        blocks["device-install"] = device_install(tables["bench"])
        blocks["serve-bench"] = serve_bench(tables["bench"])
        blocks["many-rows"] = many_rows_targets(tables["bench"])
        blocks["many-rows-all"] = many_rows(tables["bench"])
        blocks["many-rows-tables"] = many_rows_tables(tables["bench"])
        blocks["families"] = families_table(tables["bench"])
        blocks["families-plan"] = families_plan(tables["bench"])
        blocks["families-all"] = families_detail(tables["bench"])
    if "prefetch_online" in tables:
        blocks["prediction-pays-full"] = prediction_pays(tables["prefetch_online"], full=True)
    if raw is not None:
        blocks["run-agreement"] = run_agreement(raw, by_file)
    pages = [Path(root) / "README.md", *sorted((Path(root) / "docs").glob("*.md"))]
    return [p for p in pages if p.exists() and update(p, blocks)]
