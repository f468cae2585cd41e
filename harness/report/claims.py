"""The paper's quantitative claims against the published tables: each a pair whose ratio is
compared with the paper's (absolute times from different hardware never are), decided from the
spread of the repetitions, and the claims table that says so (figures/claims.md)."""

from pathlib import Path

import pandas as pd

# The paper's quantitative claims (shared/seeds/004_f9dda6381342b645.txt, "Implementation"), each
# as a pair whose ratio is compared: absolute times from different hardware never are.
# The tables the claims are made from (claims_table reads no other).
SOURCES = ("design", "sync_ablation", "wire_ablation", "bench")
TOLERANCE = 1.5  # a reproduced ratio agrees when within a factor of 1.5 of the paper's


def _verdict(lo, hi, band):
    """yes: the whole interval [lo, hi] lies in `band`; no: none of it does; else unresolved."""
    if band[0] <= lo and hi <= band[1]:
        return "yes"
    if hi < band[0] or lo > band[1]:
        return "no"
    return "unresolved"


def _agree(paper_ratio, interval):
    """(direction, within_tolerance) of a reproduced ratio's interval against the paper's ratio.
    Without a spread (a single run, or a record from before repetitions) nothing is decided."""
    if paper_ratio is None:
        return "", ""
    if interval is None or any(x is None or x != x for x in interval):
        return "unresolved (no spread)", "unresolved (no spread)"
    lo, hi = interval
    if paper_ratio == 1:
        side = (1 / TOLERANCE if TOLERANCE > 1 else 0.0, TOLERANCE)  # "does not grow": within the tolerance of 1
    elif paper_ratio > 1:
        side = (1.0 + 1e-12, float("inf"))
    else:
        side = (0.0, 1.0 - 1e-12)
    return _verdict(lo, hi, side), _verdict(lo, hi, (paper_ratio / TOLERANCE, paper_ratio * TOLERANCE))


def _batched_vs_per_miss(v, metric: str):
    """The sync ablation's batched / per-miss ratio of `metric` and its interval over repetitions."""
    b, p = v.loc["batched"], v.loc["per_miss"]
    spread = (b[f"{metric}_min"], b[f"{metric}_max"]), (p[f"{metric}_min"], p[f"{metric}_max"])
    return b[metric] / p[metric], _ratio_interval(*spread)


def _ratio_interval(num, den):
    """The range of num / den over the two figures' (min, max) ranges; None without both."""
    (n_lo, n_hi), (d_lo, d_hi) = num, den
    if any(x is None or x != x or x <= 0 for x in (n_lo, n_hi, d_lo, d_hi)):
        return None
    return n_lo / d_hi, n_hi / d_lo


def claims_table(tables):
    """One row per claim and machine: the paper's figure and ratio, the reproduced ones."""
    rows = []

    def add(
        claim,
        paper,
        paper_ratio,
        machine,
        reproduced,
        ratio,
        source,
        direction=None,
        within=None,
        note="",
        interval=None,
        basis=None,
    ):
        d, w = _agree(paper_ratio, interval)
        # what the verdict rests on: the fewest runs pooled into any of its figures, and their code
        runs = int(basis["runs"].min()) if basis is not None and "runs" in basis else None
        commits = ", ".join(sorted(set(basis["commit"]) - {""})) if basis is not None and "commit" in basis else ""
        rows.append(
            dict(
                claim=claim,
                paper=paper,
                paper_ratio=paper_ratio,
                machine=machine,
                reproduced=reproduced,
                ratio=ratio,
                ratio_low=None if interval is None else interval[0],
                ratio_high=None if interval is None else interval[1],
                direction=direction or d,
                within_tolerance=within or w,
                runs=runs,
                commit=commits,
                note=note,
                source=source,
            )
        )

    def usable(name):
        assert name in SOURCES, f"claims_table read {name}, which SOURCES does not name"
        df = tables[name]
        return df if not df.empty and {"device", "chip"} <= set(df.columns) else None

    design = usable("design")
    for m, g in design.groupby(["device", "chip"], sort=True) if design is not None else ():
        mname = f"{m[0]} {m[1]}"
        w = g[g["measure"] == "slot_write"]
        for inst, gi in w.groupby("variant", sort=True):
            gi = gi.set_index("slots")
            v = gi["value"]
            if 8 in v and 64 in v:
                spread = gi.reindex(columns=["value_min", "value_max"])
                add(
                    f"slot write cost does not grow with the buffer ({inst}; S=64 / S=8)",
                    "0.305 ms at 64 slots, buffer reused",
                    1.0,
                    mname,
                    f"{v[8]:.3f} ms at 8, {v[64]:.3f} ms at 64",
                    v[64] / v[8],
                    "tables/design",
                    interval=_ratio_interval(tuple(spread.loc[64]), tuple(spread.loc[8])),
                    basis=gi.loc[[8, 64]],
                )
        kt = g[g["measure"] == "kernel"].set_index("variant")
        k = kt["value"]

        def kernel_interval(a, b, kt=kt):
            sp = kt.reindex(columns=["value_min", "value_max"])
            return _ratio_interval(tuple(sp.loc[a]), tuple(sp.loc[b]))

        if {"gather_qmm", "loop_quantized_matmul", "restack_gather_qmm"} <= set(k.index):
            add(
                "per-expert loop vs gather_qmm (loop / gather_qmm)",
                "0.43 vs 0.26 ms",
                0.43 / 0.26,
                mname,
                f"{k['loop_quantized_matmul']:.3f} vs {k['gather_qmm']:.3f} ms",
                k["loop_quantized_matmul"] / k["gather_qmm"],
                "tables/design",
                interval=kernel_interval("loop_quantized_matmul", "gather_qmm"),
                basis=kt.loc[["loop_quantized_matmul", "gather_qmm"]],
            )
            add(
                "restack vs gather_qmm (restack / gather_qmm)",
                "0.50 vs 0.26 ms",
                0.50 / 0.26,
                mname,
                f"{k['restack_gather_qmm']:.3f} vs {k['gather_qmm']:.3f} ms",
                k["restack_gather_qmm"] / k["gather_qmm"],
                "tables/design",
                interval=kernel_interval("restack_gather_qmm", "gather_qmm"),
                basis=kt.loc[["restack_gather_qmm", "gather_qmm"]],
            )
        par = g[g["measure"] == "parity"]
        for model, gp in par.groupby("model", sort=True):
            v = gp.set_index("variant")["value"]
            if "unfused" in v and "compiled_swiglu" in v:
                ok = "yes" if v["unfused"] > 0 and v["compiled_swiglu"] == 0.0 else "no"
                add(
                    f"activation parity: unfused vs compiled SwiGLU ({model}, max |dlogit|)",
                    "0.0195 vs 0.0",
                    None,
                    mname,
                    f"{v['unfused']:.4g} vs {v['compiled_swiglu']:.4g}",
                    None,
                    "tables/design",
                    direction=ok,
                    within="n/a (exact)",
                    basis=gp,
                )

    bench = usable("bench")
    miss = bench[(bench["bench"] == "miss") & (bench["tier"] == "page_cache")] if bench is not None else None
    for m, g in miss.groupby(["device", "chip", "model"], sort=True) if miss is not None else ():
        v = g.set_index("figure")["value"]
        keys = ["copy_split_ms[pread]", "copy_split_ms[array]", "copy_split_ms[install]"]
        if all(k in v for k in keys):
            p, a_, i = (v[k] for k in keys)
            add(
                f"per-miss cost split: pread vs array creation ({m[2]}, copy mode; pread / array)",
                "0.21 ms = 0.13 pread + 0.06 array + 0.02 install",
                0.13 / 0.06,
                f"{m[0]} {m[1]}",
                f"pread {p:.3f} + array {a_:.3f} + install {i:.3f} ms",
                p / a_,
                "tables/bench",
                note="pread summed over the reader threads of a batch of 8 misses",
                basis=g[g["figure"].isin(keys)],
            )

    sync = usable("sync_ablation")
    paper_sync = {"general": (28, 51), "code": (41, 73)}
    keys = ["device", "chip", "model", "prompt_set", "install", "slots"]
    for key, g in sync.groupby(keys, sort=True) if sync is not None else ():
        v = g.set_index("sync")
        if not {"per_miss", "batched"} <= set(v.index):
            continue
        dev, chip, model, pset, inst, S = key
        mname = f"{dev} {chip}"
        before, after = paper_sync[pset]
        ratio, interval = _batched_vs_per_miss(v, "tok_s")
        add(
            f"batched reads vs per-miss sync, tok/s at {S} slots ({pset}; {model}, {inst})",
            f"{before} -> {after} tok/s",
            after / before,
            mname,
            f"{v.loc['per_miss', 'tok_s']:.1f} -> {v.loc['batched', 'tok_s']:.1f} tok/s",
            ratio,
            "tables/sync_ablation",
            interval=interval,
            note=f"{int(v.loc['batched', 'misses'])} misses in {int(v.loc['batched', 'tokens'])} tokens",
            basis=v.loc[["per_miss", "batched"]],
        )
        ratio, interval = _batched_vs_per_miss(v, "stall_ms_per_token")
        add(
            f"stall halved by batching ({pset}; {model}, {inst}; batched / per-miss)",
            "halved",
            0.5,
            mname,
            f"{v.loc['per_miss', 'stall_ms_per_token']:.2f} -> {v.loc['batched', 'stall_ms_per_token']:.2f} ms/token",
            ratio,
            "tables/sync_ablation",
            interval=interval,
            note=f"{int(v.loc['batched', 'misses'])} misses in {int(v.loc['batched', 'tokens'])} tokens",
            basis=v.loc[["per_miss", "batched"]],
        )

    wire = usable("wire_ablation")
    for key, g in wire.groupby(["device", "chip", "model"], sort=True) if wire is not None else ():
        v = g.set_index("wire")
        if not {"model", "float16"} <= set(v.index):
            continue
        dtype = v.loc["model", "dtype"]
        f16, own = v.loc["float16", "max_abs_logit_diff"], v.loc["model", "max_abs_logit_diff"]
        if dtype == "bfloat16":
            ok = "yes" if f16 > 0 and own == 0.0 else "no"
            claim = f"float16 wire breaks bfloat16 parity, model dtype exact ({key[2]})"
        else:
            ok = "yes" if f16 == 0.0 and own == 0.0 else "no"
            claim = f"float16 wire exact for a float16 model ({key[2]})"
        add(
            claim,
            "Qwen3 (bf16): 0.65 vs 0.0; OLMoE (f16): exact",
            None,
            f"{key[0]} {key[1]}",
            f"float16 wire {f16:.4g}, model dtype {own:.4g}",
            None,
            "tables/wire_ablation",
            direction=ok,
            within="n/a (exact)",
            basis=v.loc[["model", "float16"]],
        )
    cols = [
        "claim",
        "paper",
        "paper_ratio",
        "machine",
        "reproduced",
        "ratio",
        "ratio_low",
        "ratio_high",
        "direction",
        "within_tolerance",
        "runs",
        "commit",
        "note",
        "source",
    ]
    return pd.DataFrame(rows, columns=cols)


CLAIMS_HEADER = f"""Each quantitative claim of the paper's implementation section, as a pair whose ratio is
compared (absolute times from different hardware never are). `direction`: the reproduction is
on the same side of 1 as the paper's ratio (or, for parity, exact where the paper is exact and
non-zero where it is not); `within_tolerance`: the ratio is within a factor of {TOLERANCE:g} of the
paper's. Each is decided from the spread of the repetitions: `ratio_low`..`ratio_high` is the range
the ratio takes over the two figures' min..max, and a verdict is `yes` or `no` only when that whole
range lies on one side, `unresolved` otherwise (and for single runs, which have no spread).
Every run of the latest commit that measured a figure is pooled into it (the median of their
figures, the widest range): `runs` is the fewest runs behind any figure of a claim, `commit` the
code they ran. Generated from results/raw/ by harness/report/aggregate.py and claims.py.
"""


def write_claims(df, path):
    """figures/claims.md: the claims table with how to read it (the README links to it)."""
    cols = [
        "claim",
        "paper",
        "machine",
        "reproduced",
        "ratio",
        "ratio_low",
        "ratio_high",
        "paper_ratio",
        "direction",
        "within_tolerance",
        "runs",
        "commit",
        "note",
    ]
    lines = [CLAIMS_HEADER, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.reindex(columns=cols).itertuples(index=False):
        cells = [
            (f"{v:.3g}" if isinstance(v, float) and v == v else ("" if v is None or v != v else str(v))) for v in row
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
