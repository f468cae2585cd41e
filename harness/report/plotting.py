"""Figures, one per claim, drawn from the aggregated tables only (never from raw logs)."""

import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from .tables import bench as bench_tables  # noqa: E402

LINES = {"none": "-", "popularity": ":", "previous": "-.", "transition": "--", "probe": (0, (5, 1)), "oracle": "-"}
# One colour per predictor and per placement strategy, the same in every figure.
COLORS = {
    "none": "C0",
    "popularity": "C2",
    "previous": "C4",
    "transition": "C3",
    "probe": "C1",
    "oracle": "k",
    "lru": "C7",
    "belady": "C8",
    "algorithm2": "C0",
    "round_robin": "C1",
    "popularity_only": "C2",
    "node0_only": "C3",
    "adaptive": "C4",
}
NODE_MARKERS = {2: "o", 3: "s", 4: "^"}
FITTED = ("popularity", "transition", "probe", "previous")


def _read(figdir, name):
    p = Path(figdir) / "tables" / f"{name}.csv"
    df = pd.read_csv(p)
    return df if "empty" not in df.columns else df.iloc[0:0]


def _save(fig, figdir, name):
    for ext in ("png", "pdf"):
        fig.savefig(Path(figdir) / f"{name}.{ext}", dpi=110, metadata={"CreationDate": None} if ext == "pdf" else None)
    plt.close(fig)


def _empty(figdir, name, what):
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, f"no {what} in the raw logs yet", ha="center", va="center")
    _save(fig, figdir, name)


def _shared_legend(fig, axes, used, title, bottom, max_cols=None):
    """Blank the unused panels, one legend for all panels (not every panel has every series),
    then the title and layout."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    legend = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    ncol = min(max_cols or len(legend), len(legend))
    fig.legend(list(legend.values()), list(legend), fontsize=7, loc="lower center", ncol=ncol)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, bottom, 1, 0.97))


def _machine(df):
    return df["device"].astype(str) + " " + df["chip"].astype(str).str.slice(0, 28)


def _err(g, column="value"):
    """Error bars from a table's min and max columns (none for rows measured once)."""
    lo, hi = f"{column}_min", f"{column}_max"
    if lo not in g.columns or g[lo].isna().all():
        return None
    return [(g[column] - g[lo]).fillna(0).clip(lower=0), (g[hi] - g[column]).fillna(0).clip(lower=0)]


def design(figdir):
    df = _read(figdir, "design")
    if df.empty:
        return _empty(figdir, "design", "gate B results")
    df["machine"] = _machine(df)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    k = df[df["measure"] == "kernel"]
    variants = sorted(k["variant"].unique())
    machines = sorted(k["machine"].unique())
    width = 0.8 / max(len(machines), 1)
    for i, m in enumerate(machines):
        g = k[k["machine"] == m].set_index("variant").reindex(variants)
        axes[0].bar([j + i * width for j in range(len(variants))], g["value"], width, label=m, yerr=_err(g))
    axes[0].set_xticks([j + width * (len(machines) - 1) / 2 for j in range(len(variants))])
    axes[0].set_xticklabels([v.replace("_", " ") for v in variants], fontsize=8)
    axes[0].set_yscale("log")  # CPU and GPU differ by two orders of magnitude
    axes[0].set_ylabel("ms per layer per token (log)")
    axes[0].set_title("Expert kernels: loop vs gather_qmm vs restack")
    axes[0].legend(fontsize=7)
    w = df[df["measure"] == "slot_write"]
    for (m, inst), g in w.groupby(["machine", "variant"]):
        axes[1].errorbar(g["slots"], g["value"], yerr=_err(g), marker="o", capsize=3, label=f"{inst} ({m})")
    axes[1].set_xlabel("slots in the buffer")
    axes[1].set_ylabel("ms to write one expert")
    axes[1].set_title("Slot write cost against buffer size")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    _save(fig, figdir, "design")


INSTALL_PREFERENCE = ("device", "pinned", "inplace")  # what the engine's `auto` picks, where recorded


def _current_install(engine):
    """(rows of the install path the engine uses by default on that device, the other rows): a GPU
    panel shows the device install where recorded (else the pinned one), with the paths it replaced
    as demand loading in grey. Rows at S = E (every expert resident, the install immaterial) go
    with the current install's runs (install_panels)."""
    panels = dict(install_panels(engine)) if "install" in engine.columns else {}
    if len(panels) < 2:
        return engine, engine.iloc[0:0]
    current = next((m for m in INSTALL_PREFERENCE if m in panels), next(iter(panels)))
    keep = engine.index.isin(panels[current].index)
    return engine[keep], engine[~keep]


def install_panels(g):
    """One (install, rows) per install path a gate C group has partial (S < E) rows for, each with
    the resident rows (S = E, mlx-lm's) of the same commits: a panel never mixes two paths."""
    partial = g[g["slots"] < g["experts"]]
    out = []
    for install in sorted(partial["install"].dropna().unique()):
        mine = partial[partial["install"] == install]
        full = g[(g["slots"] >= g["experts"]) & g["commit"].isin(set(mine["commit"]))]
        out.append((install, pd.concat([mine, full])))
    return out


def _online(figdir, name, column, ylabel, title):
    df = _read(figdir, "prefetch_online")
    if df.empty:
        return _empty(figdir, name, "gate C results")
    df["machine"] = _machine(df)
    panels = sorted(df.groupby(["machine", "model", "tier"]).groups)
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        g = df[(df["machine"] == key[0]) & (df["model"] == key[1]) & (df["tier"] == key[2])]
        engine, earlier = _current_install(g[g["predictor"] != "mlx-lm"])
        for pset, h in earlier[earlier["predictor"] == "none"].groupby("prompt_set"):
            h = h.sort_values("slots")
            ax.plot(
                h["slots"],
                h[column],
                linestyle=":",
                marker=".",
                color="0.6",
                label=f"none, {h['install'].iloc[0]} path, earlier ({pset})",
            )
        # Demand loading, the oracle and the best fitted predictor (by tok/s at the fewest slots):
        # the comparison the gate is about, one line each per prompt set.
        fitted = engine[engine["predictor"].isin(FITTED) & (engine["slots"] < engine["experts"])]
        best = None
        if not fitted.empty:
            least = fitted[fitted["slots"] == fitted["slots"].min()]
            best = least.groupby(["predictor", "depth", "min_prob"])["tok_s"].mean().idxmax()
        for (pset, pred, depth, q), h in engine.groupby(["prompt_set", "predictor", "depth", "min_prob"]):
            if pred in FITTED and (pred, depth, q) != best:
                continue
            if pred == "oracle" and depth != engine.loc[engine["predictor"] == "oracle", "depth"].min():
                continue
            h = pd.concat(
                [
                    h,
                    engine[
                        (engine["prompt_set"] == pset)
                        & (engine["predictor"] == "none")
                        & (engine["slots"] == engine["experts"])
                    ],
                ]
            ).drop_duplicates("slots")
            h = h.sort_values("slots")
            label = f"{pred} d={depth}" + (f" q={q:g}" if q else "") if pred in FITTED or pred == "oracle" else pred
            label += f" ({pset})"
            ax.plot(
                h["slots"],
                h[column],
                linestyle="-" if pset == "general" else "--",
                marker="o" if pset == "general" else "s",
                color=COLORS.get(pred),
                label=label,
                linewidth=1.5,
            )
            lo, hi = f"{column}_min", f"{column}_max"
            if lo in h.columns and h[lo].notna().any():
                ax.fill_between(h["slots"], h[lo], h[hi], color=COLORS.get(pred), alpha=0.15, linewidth=0)
        if column == "tok_s":
            positive = g.loc[g[column] > 0, column]
            if len(positive) and positive.max() > 10 * positive.min():
                ax.set_yscale("log")  # e.g. the GPU's full-size model: 4 tok/s at S=16, 177 resident
            for pset, h in g[g["predictor"] == "mlx-lm"].groupby("prompt_set"):
                ax.axhline(h[column].iloc[0], color="k", linewidth=0.8, linestyle="--")
                ax.text(ax.get_xlim()[0], h[column].iloc[0], f" mlx-lm resident ({pset})", fontsize=6, va="bottom")
        ax.set_title(f"{key[1]}, {key[2]} tier\n{key[0]}", fontsize=8)
        ax.set_xlabel("slots per layer")
        ax.set_ylabel(ylabel)
    _shared_legend(fig, axes, len(panels), title + " (bands: min..max over repetitions, where repeated)", 0.08, 4)
    _save(fig, figdir, name)


def miss_breakdown(figdir):
    df = _read(figdir, "miss_breakdown")
    if df.empty:
        return _empty(figdir, "miss_breakdown", "demand misses")
    df = df.groupby(["device", "model", "tier", "slots", "install"], as_index=False)[
        ["per_miss_pread_ms", "per_miss_array_ms", "per_miss_install_ms", "per_miss_stall_ms"]
    ].mean()
    labels = [f"{r.model}, {r.tier}, S={r.slots}, {r.install} ({r.device})" for r in df.itertuples()]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(df) + 1.4))
    y = range(len(df))
    left = 0
    for col, name in (
        ("per_miss_pread_ms", "pread (summed over readers)"),
        ("per_miss_array_ms", "array creation"),
        ("per_miss_install_ms", "install"),
    ):
        ax.barh(list(y), df[col], left=left, label=name)
        left = left + df[col]
    ax.plot(df["per_miss_stall_ms"], list(y), "k|", markersize=12, label="stall per miss (wall)")
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms per miss")
    ax.set_title("Per-miss cost, demand loading")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    _save(fig, figdir, "miss_breakdown")


def predictor_recall(figdir):
    df = _read(figdir, "predictor_quality")
    df = df[df["recall"].notna()] if not df.empty else df
    if df.empty:
        return _empty(figdir, "predictor_recall", "predictor quality results")
    df = df.drop_duplicates(["model", "prompt_set", "predictor", "depth"])
    panels = sorted(df.groupby(["model", "prompt_set"]).groups)
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    depths = sorted(df["depth"].unique())
    for ax, (model, pset) in zip(axes.flat, panels):
        g = df[(df["model"] == model) & (df["prompt_set"] == pset)]
        for pred, h in g.groupby("predictor"):
            h = h.sort_values("depth")
            ax.plot(
                h["depth"], h["recall"], marker="o", linestyle=LINES.get(pred, "-"), color=COLORS.get(pred), label=pred
            )
        ax.set_title(f"{model}, {pset}", fontsize=8)
        ax.set_xlabel("depth d")
        ax.set_ylabel("recall at top-k")
        ax.set_ylim(0, 1.05)
        ax.set_xticks(depths)
        ax.set_xlim(min(depths) - 0.3, max(depths) + 0.3)  # a panel with d=1 only keeps the same axis
    _shared_legend(fig, axes, len(panels), "Predictor recall by prefetch depth (held-out prompts)", 0.06)
    _save(fig, figdir, "predictor_recall")


MODEL_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def routing(figdir):
    df = _read(figdir, "routing")
    if df.empty:
        return _empty(figdir, "routing", "routing statistics")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6))
    models = sorted(df["model"].unique())
    marker = {m: MODEL_MARKERS[i % len(MODEL_MARKERS)] for i, m in enumerate(models)}
    lay = df[df["kind"] == "layer"]
    for i, (model, g) in enumerate(lay.groupby("model")):
        axes[0].plot(g["layer"], g["top10_share"], marker=marker[model], color=f"C{i}", label=model)
        axes[1].plot(g["layer"], g["js_code_general_bits"], marker=marker[model], color=f"C{i}", label=model)
    axes[0].set_title("Share of routes taken by the top 10% of experts", fontsize=9)
    axes[0].set_xlabel("layer")
    axes[1].set_title("Code vs general routing (Jensen-Shannon, bits)", fontsize=9)
    axes[1].set_xlabel("layer")
    axes[0].legend(fontsize=7)
    pr = df[df["kind"] == "predictability"]
    for (model, pred), g in pr.groupby(["model", "predictor"]):
        g = g.groupby("depth", as_index=False)["recall"].mean()
        axes[2].plot(
            g["depth"],
            g["recall"],
            marker=marker[model],
            color=COLORS.get(pred),
            linestyle=LINES.get(pred, "-"),
            label=f"{pred}, {model}",
        )
    if not pr.empty:
        axes[2].axhline(pr["chance"].iloc[0], color="k", linestyle=":", linewidth=0.8, label="chance")
        depths = sorted(pr["depth"].dropna().unique())
        axes[2].set_xticks(depths, [f"{d:g}" for d in depths])
    axes[2].set_title("Cross-layer predictability (recall; colour: predictor, marker: model)", fontsize=9)
    axes[2].set_xlabel("depth d")
    axes[2].set_ylim(0, 1)
    axes[2].legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    _save(fig, figdir, "routing")


def train_loss(figdir):
    df = _read(figdir, "train_loss")
    if df.empty:
        return _empty(figdir, "train_loss", "training run")
    models = list(dict.fromkeys(df["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3.6), squeeze=False)
    for ax, m in zip(axes[0], models):
        d = df[df["model"] == m]
        ax.plot(d["step"], d["cross_entropy"], label="cross-entropy")
        ax.plot(d["step"], d["loss"], label="with load-balancing loss", alpha=0.6)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats)")
        ax.set_title(f"Training {m} ({d['chip'].iloc[0]}, {d['seconds'].max() / 60:.0f} min)")
        ax.legend()
    fig.tight_layout()
    _save(fig, figdir, "train_loss")


def placement(figdir):
    sim, meas = _read(figdir, "placement_sim"), _read(figdir, "multinode")
    if sim.empty and meas.empty:
        return _empty(figdir, "placement", "gate F results")
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2))
    if not sim.empty:
        s = sim[sim["strategy"] != "adaptive"]
        s = s[s["capacity_share"] == s["capacity_share"].min()]
        for (strategy, n), g in s.groupby(["strategy", "nodes"]):
            g = g.sort_values("link")
            axes[0].plot(
                g["link"],
                g["replayed"],
                marker=NODE_MARKERS.get(n, "x"),
                linestyle=LINES.get(strategy, "-"),
                color=COLORS.get(strategy),
                label=f"{strategy}, {n} nodes",
            )
        links = sorted(s["link"].unique())
        axes[0].set_xscale("log")
        axes[0].set_xticks(links, [f"{x:g}" for x in links], minor=False)
        axes[0].xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axes[0].set_xlabel("link cost rho (units of c)")
        axes[0].set_ylabel("cost per token (replayed on eval traces)")
        axes[0].set_title(f"Simulated cost (capacity {s['capacity_share'].min():g} of experts per node)", fontsize=9)
        axes[0].legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    if not meas.empty:
        for (strategy, n), g in meas.groupby(["strategy", "nodes"]):
            axes[1].scatter(
                g["expected"],
                g["ms_per_token"],
                marker=NODE_MARKERS.get(n, "x"),
                color=COLORS.get(strategy),
                s=40,
                label=f"{strategy}, {n} nodes",
            )
        axes[1].set_xlabel("expected cost per token (simulated)")
        axes[1].set_ylabel("measured ms per token (local processes)")
        axes[1].set_title("Measured against simulated, per placement", fontsize=9)
        axes[1].legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    _save(fig, figdir, "placement")


def _bench_memory(figdir):
    """The widest `bench throughput` run that measured memory, per machine and model: one row per
    configuration (S=16/device, S=E, mlx-lm...) with its tok/s median and range and the memory it
    held. One run only, since the bench table keeps each figure's newest run and runs differ in
    what they measured: figures of several runs in one panel would set unlike decodes side by side."""
    b = _read(figdir, "bench")
    b = b[b["bench"] == "throughput"] if not b.empty else b
    cols = ["machine", "model", "config", "memory_bytes", "tok_s", "tok_s_min", "tok_s_max", "run_id"]
    if b.empty:
        return pd.DataFrame(columns=cols)
    b = b.assign(machine=_machine(b), name=b["figure"].str.extract(r"^([a-z_ ]+)\[")[0],
                 config=b["figure"].str.extract(r"\[(.*)\]$")[0],
                 run_id=b["run_id"].fillna("") if "run_id" in b else "")  # fmt: skip
    b = b[b["name"].isin(["memory_bytes", "tok_s", "tok_s_min", "tok_s_max"])]
    wide = b.pivot_table(
        index=["machine", "model", "config", "run_id"], columns="name", values="value", aggfunc="first"
    )
    wide = wide.reset_index()
    if "memory_bytes" not in wide.columns:
        return pd.DataFrame(columns=cols)
    wide = wide[wide["memory_bytes"].notna()]
    # the widest run (most configurations), the latest of those: a quick run of one S beside a
    # sweep is the sweep's footnote, not its replacement
    runs = wide.groupby(["machine", "model", "run_id"]).size().reset_index(name="n")
    widest = runs.sort_values(["n", "run_id"]).groupby(["machine", "model"]).tail(1)
    return wide.merge(widest[["machine", "model", "run_id"]]).reindex(columns=cols)


INSTALL_COLORS = {"device": "C5", "pinned": "C9", "inplace": "C6", "copy": "C7"}


def _bench_lines(ax, b):
    """One line per install path of one bench run, S ascending and ending at the run's S = E."""
    parsed = b["config"].str.extract(bench_tables.CONFIG)
    b = b.assign(slots=parsed["slots"], install=parsed["install"].fillna(""), loop=parsed["loop"].fillna(""))
    full, offloaded = b[b["slots"] == "E"], b[b["slots"].notna() & (b["slots"] != "E")]
    if offloaded.empty:  # a run of resident decoding alone: its points
        ax.scatter(full["memory_bytes"] / 1e6, full["tok_s"], marker="D", color="C5", label="S=E (bench throughput)")
    for (install, loop), h in offloaded.groupby(["install", "loop"]):
        h = h.assign(n=h["slots"].astype(int)).sort_values("n")
        h = pd.concat([h, full[full["loop"] == loop]])
        label = f"{install or 'offloaded'}{' through mlx-lm' if loop else ''} (bench throughput)"
        ax.errorbar(h["memory_bytes"] / 1e6, h["tok_s"], yerr=_err(h, "tok_s"), marker="D",
                    color=INSTALL_COLORS.get(install, "C5"), capsize=3, label=label)  # fmt: skip
        for r in h.itertuples():
            ax.annotate(f"S={r.slots}", (r.memory_bytes / 1e6, r.tok_s), fontsize=6, xytext=(3, -9),
                        textcoords="offset points")  # fmt: skip


def memory(figdir):
    """Tokens/s against the memory a configuration holds (its model: weights not offloaded and
    slot tables; plus what one decode adds), resident mlx-lm as the reference point."""
    df = _read(figdir, "prefetch_online")
    df = df[df["memory_bytes"].notna()] if "memory_bytes" in df.columns else df.iloc[0:0]
    bench = _bench_memory(figdir)
    if df.empty and bench.empty:
        return _empty(figdir, "throughput_vs_memory", "memory measurements")
    if df.empty:  # bench runs only: no gate C panel rows
        df = pd.DataFrame(columns=["machine", "model", "predictor", "tier", "slots", "memory_bytes", "tok_s"])
    else:
        df = df.assign(machine=_machine(df))
    df = df[df["predictor"].isin(["mlx-lm", "none", "oracle"])]
    panels = sorted(set(df.groupby(["machine", "model"]).groups) | set(bench.groupby(["machine", "model"]).groups))
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        g = df[(df["machine"] == key[0]) & (df["model"] == key[1])]
        for (pred, tier), h in g[g["predictor"] != "mlx-lm"].groupby(["predictor", "tier"]):
            h = h.groupby("slots", as_index=False)[["memory_bytes", "tok_s"]].median().sort_values("memory_bytes")
            ax.plot(h["memory_bytes"] / 1e6, h["tok_s"], marker="o", color=COLORS.get(pred),
                    linestyle="-" if tier == "page_cache" else "--", label=f"{pred} ({tier})")  # fmt: skip
            for r in h.itertuples():
                ax.annotate(f"S={r.slots}", (r.memory_bytes / 1e6, r.tok_s), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
        b = bench[(bench["machine"] == key[0]) & (bench["model"] == key[1])]
        if not b.empty:
            _bench_lines(ax, b)
        ref = pd.concat([g[g["predictor"] == "mlx-lm"], b[b["config"].str.startswith("mlx-lm")]])
        if not ref.empty:
            ax.scatter(ref["memory_bytes"] / 1e6, ref["tok_s"], marker="*", s=120, color="k", label="mlx-lm resident")
        ax.set_title(f"{key[1]}\n{key[0]}", fontsize=8)
        ax.set_xlabel("memory held (MB): model + one decode's peak growth")
        ax.set_ylabel("decode tok/s")
        ax.set_ylim(bottom=0)  # differences read at their true size (the CPU's full-size: 0.68 vs 0.69)
    _shared_legend(fig, axes, len(panels), "Throughput against memory", 0.07, 5)
    _save(fig, figdir, "throughput_vs_memory")


def _latest_figures(b: pd.DataFrame, bench: str, name: str) -> pd.DataFrame:
    """Per machine and model, the latest `bench` run's figures `name[config@x]`, one row each:
    machine, model, config, x, value, value_min, value_max."""
    b = b[b["bench"] == bench] if not b.empty else b
    cols = ["machine", "model", "config", "x", "value", "value_min", "value_max"]
    if b.empty:
        return pd.DataFrame(columns=cols)
    b = b.assign(machine=_machine(b))
    parts = b["figure"].str.extract(r"^(?P<name>[a-z_ ]+?)(?P<stat>_min|_max)?\[(?P<config>[^@\]]+)@B?(?P<x>\d+)\]$")
    b = b.assign(**{c: parts[c] for c in parts.columns})
    b = b[b["name"] == name]
    last = b.groupby(["machine", "model"])["run_id"].transform("max")
    b = b[b["run_id"] == last].assign(stat="value" + b["stat"].fillna(""), x=b["x"].astype(float))
    wide = b.pivot_table(index=["machine", "model", "config", "x"], columns="stat", values="value", aggfunc="first")
    return wide.reset_index().reindex(columns=cols)


def many_rows(figdir):
    """Many rows through a layer at once: time to first token against prompt length (left) and
    batch_generate's aggregate tok/s against the batch (right), one line per configuration of the
    latest run of each machine and model (and of its latest run of another install alone),
    resident as the reference."""
    b = _read(figdir, "bench")
    # the latest run of the install `auto` gives, and beside it the latest run of another install
    # alone (an ablation: `--installs pinned`), its resident left out
    mine, other = bench_tables.measured_default(b), bench_tables.measured_default(b, default=False)

    def both(bench, name):
        theirs = _latest_figures(other, bench, name)
        return pd.concat([_latest_figures(mine, bench, name), theirs[theirs["config"] != "resident"]])

    prefill, batch = both("prefill", "ttft_ms"), both("batch", "tok_s")
    limits = _latest_figures(mine, "batch", "bus limit x resident")
    least = _latest_figures(mine, "batch", "bus cache limit x resident")  # recorded since 1825098
    keys = sorted(set(prefill.groupby(["machine", "model"]).groups) | set(batch.groupby(["machine", "model"]).groups))
    if not keys:
        return _empty(figdir, "many_rows", "bench prefill or batch records")
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 3.8 * len(keys)), squeeze=False)
    for (ax, bx), key in zip(axes, keys):
        for panel, df, xlabel, ylabel in ((ax, prefill, "prompt tokens", "time to first token (ms)"),
                                          (bx, batch, "sequences at once (B)", "aggregate tok/s")):  # fmt: skip
            g = df[(df["machine"] == key[0]) & (df["model"] == key[1])]
            for i, (config, h) in enumerate(g.groupby("config", sort=True)):
                h = h.sort_values("x")
                ref = config == "resident"
                err = [h["value"] - h["value_min"].fillna(h["value"]), h["value_max"].fillna(h["value"]) - h["value"]]
                panel.errorbar(h["x"], h["value"], yerr=err, marker="*" if ref else "o", capsize=3,
                               color="k" if ref else f"C{i}", linewidth=2 if ref else 1, label=config)  # fmt: skip
            if panel is bx:
                for lim, style, what in ((limits, "--", "bus's limit"), (least, ":", "fewest misses' limit")):
                    _bus_limits(bx, g, lim[(lim["machine"] == key[0]) & (lim["model"] == key[1])], style, what)
            panel.set_xscale("log", base=2)
            panel.set_xlabel(xlabel)
            panel.set_ylabel(ylabel)
            if not g.empty:
                panel.legend(fontsize=6)
            else:  # this machine measured the other bench only
                panel.text(0.5, 0.5, "not measured here", ha="center", va="center", transform=panel.transAxes)
        ax.set_yscale("log")
        ax.set_title(f"{key[1]}, {key[0]}: time to first token", fontsize=8)
        bx.set_title(f"{key[1]}, {key[0]}: batch_generate", fontsize=8)
    fig.suptitle("Many rows at once (medians; whiskers: min..max over interleaved repeats)", fontsize=9)
    fig.tight_layout()
    _save(fig, figdir, "many_rows")


def _bus_limits(panel, g: pd.DataFrame, limits: pd.DataFrame, style: str = "--", what: str = "bus's limit"):
    """The bus's limit of each S at each B the run bounds (where it counted the experts the rows
    named, every B; before, the B whose rows name every expert), as tok/s (the limit's multiple of
    resident's tok/s at that B): a bar in `style` at each such B, one colour an S. The same for the
    limit with the fewest misses any S slots allow (dotted)."""
    res = g[g["config"] == "resident"].set_index("x")["value"]
    limits = limits.assign(S=limits["config"].str.extract(r"^S=(\d+)/", expand=False))
    for j, (S, h) in enumerate(limits.dropna(subset=["S"]).groupby("S", sort=True)):
        h = h.drop_duplicates("x").sort_values("x")
        h = h[h["x"].isin(res.index)]
        if len(h):
            y = h["value"].to_numpy() * res[h["x"]].to_numpy()  # a short dashed bar at each such B
            panel.hlines(y, h["x"] / 1.3, h["x"] * 1.3, linestyles=style, linewidth=1.5,
                         colors="C3" if j == 0 else f"C{3 + j}", label=f"{what}, S = {S}")  # fmt: skip


def _config_figures(g: pd.DataFrame) -> dict:
    """{figure: value} of one run's rows."""
    return dict(zip(g["figure"], g["value"]))


def families(figdir):
    """The families users run: decode tok/s against the device memory each configuration held,
    one panel per family (its latest `bench families` run on each machine), resident as a star,
    the bus-bound limit of the bytes each configuration read a token as a dashed line."""
    b = _read(figdir, "bench")
    b = b[b["bench"] == "families"] if not b.empty else b
    if b.empty:
        return _empty(figdir, "families", "bench families records")
    b = b.assign(machine=_machine(b))
    keys = sorted(b.groupby(["machine", "model"]).groups)
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    # at least 8 inches wide: the title and the legend span the figure, whatever the panels
    fig, axes = plt.subplots(rows, cols, figsize=(max(8.0, 4.2 * cols), 3.4 * rows + 0.6), squeeze=False)
    for ax, (machine, model) in zip(axes.flat, keys):
        g = bench_tables.without_settings(b[(b["machine"] == machine) & (b["model"] == model)])
        fig_ = _config_figures(g[g["run_id"] == g["run_id"].max()])
        configs = sorted((f[len("tok_s[") : -1] for f in fig_ if f.startswith("tok_s[") and f != "tok_s[resident]"),
                         key=lambda c: fig_[f"memory_bytes[{c}]"])  # fmt: skip
        mem = [fig_[f"memory_bytes[{c}]"] / 1e9 for c in configs]
        tok = [fig_[f"tok_s[{c}]"] for c in configs]
        # the default install's configurations as one line; the pinned ablation as points of its own
        styles = ((False, dict(marker="o", color="C0", label="offloaded (the default install)")),
                  (True, dict(marker="s", color="C1", linestyle="none", label="pinned (ablation)")))  # fmt: skip
        for pinned, style in styles:
            mine = [i for i, c in enumerate(configs) if c.startswith("pinned ") == pinned]
            if mine:
                err = [[tok[i] - fig_[f"tok_s_min[{configs[i]}]"] for i in mine],
                       [fig_[f"tok_s_max[{configs[i]}]"] - tok[i] for i in mine]]  # fmt: skip
                ax.errorbar([mem[i] for i in mine], [tok[i] for i in mine], yerr=err, capsize=3, **style)
        for c, x, y in zip(configs, mem, tok):
            ax.annotate(c, (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
        res = fig_.get("tok_s[resident]")
        if res is not None:
            ax.plot([fig_["memory_bytes[resident]"] / 1e9], [res], marker="*", markersize=12, color="k",
                    linestyle="none", label="resident")  # fmt: skip
            ax.plot(mem, [res * fig_[f"limit x resident[{c}]"] for c in configs], "--", color="C3",
                    label="bus-bound limit of the bytes read a token")  # fmt: skip
        ax.set_xlabel("device memory held (GB)")
        ax.set_ylabel("decode tok/s")
        ax.set_title(f"{model}, {machine}", fontsize=8)
    _shared_legend(fig, axes, len(keys), "The families users run: speed against memory (medians; whiskers: "
                   "min..max over the repeats)", bottom=0.12 if rows == 1 else 0.06)  # fmt: skip
    _save(fig, figdir, "families")


# The parts of a token's time the records measure; `other` is the rest of the median token time.
SPLIT_PARTS = (
    ("sync_ms_per_token", "sync", "C4"),
    ("stall_ms_per_token", "stall", "C3"),
    ("predict_ms_per_token", "predict", "C2"),
)


ANSWER_KINDS = (("demand", "C0"), ("best fitted", "C1"), ("oracle", "k"))


def depth_floor(r) -> str:
    """A fitted configuration's depth and confidence floor, as the figures and sentences name it."""
    return f"d{r['depth']:g}" + (f" q{r['min_prob']:g}" if r["min_prob"] else "")


def answer_rows(g, probe=False):
    """One panel's bars (one machine, model and prompt set of the gate C table): at each S < E,
    demand loading, the fitted predictor with the highest median tok/s at that S (any depth and
    floor) and the best oracle depth; each with the ms-per-token parts its record has and `other`,
    the rest of its median token. `probe`: also the probe's best configuration (kind "probe"),
    the predictor the paper's question is asked of, where another fitted predictor was faster."""
    engine, _ = _current_install(g[g["predictor"] != "mlx-lm"])
    rows = []
    for s in sorted(x for x in engine["slots"].unique() if x < engine["experts"].max()):
        at = engine[engine["slots"] == s]
        picks = {
            "demand": at[at["predictor"] == "none"],
            "best fitted": at[at["predictor"].isin(FITTED)],
            "oracle": at[at["predictor"] == "oracle"],
            "probe": at[at["predictor"] == "probe"],
        }
        kinds = [k for k, _ in ANSWER_KINDS]
        if probe and not picks["best fitted"].empty:
            best = picks["best fitted"].loc[picks["best fitted"]["tok_s"].idxmax(), "predictor"]
            kinds += ["probe"] if best != "probe" else []
        for kind in kinds:
            if picks[kind].empty:
                continue
            r = picks[kind].loc[picks[kind]["tok_s"].idxmax()]
            row = dict(r, kind=kind)
            parts = {part: r.get(col) for col, part, _ in SPLIT_PARTS}
            parts = {k: v for k, v in parts.items() if pd.notna(v)}
            row.update(parts, other=1e3 / r["tok_s"] - sum(parts.values()))
            rows.append(row)
    return pd.DataFrame(rows)


def prediction_pays(figdir, trained):
    """At each S of every trained model (`trained`: the models whose routing was learnt, the ones
    on which whether prediction pays means something) on the page-cache tier: demand loading, the
    best fitted predictor at that S (by median tok/s) and the best oracle depth, beside resident
    mlx-lm; left tok/s with its spread, right where a token's time goes."""
    df = _read(figdir, "prefetch_online")
    if not df.empty:
        df = df[(df["tier"] == "page_cache") & df["model"].isin(list(trained))]
    if df.empty:
        return _empty(figdir, "prediction_pays", "gate C results on a trained model")
    df = df.assign(machine=_machine(df))
    panels = [
        (*key, install, g)
        for key, group in sorted(df.groupby(["machine", "model", "prompt_set"]), key=lambda kv: kv[0])
        for install, g in install_panels(group)
    ]
    if not panels:
        return _empty(figdir, "prediction_pays", "gate C results on a trained model")
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 2.9 * len(panels)), squeeze=False)
    colors = dict(ANSWER_KINDS)
    offset = {kind: j - 1 for j, (kind, _) in enumerate(ANSWER_KINDS)}
    for (ax, bx), (*key, install, g) in zip(axes, panels):
        bars = answer_rows(g)
        slots = sorted(bars["slots"].unique()) if not bars.empty else []
        for r in bars.to_dict("records"):
            x = slots.index(r["slots"]) + offset[r["kind"]] * 0.27
            err = _err(pd.DataFrame([r]), "tok_s")
            ax.bar(x, r["tok_s"], 0.25, yerr=err, capsize=2, color=colors[r["kind"]], alpha=0.8, label=r["kind"])
            if r["kind"] == "best fitted":
                name = f"{r['predictor']} {depth_floor(r)}"
                top = r["tok_s_max"] if pd.notna(r.get("tok_s_max")) else r["tok_s"]
                ax.text(x, top, name, rotation=90, fontsize=6, ha="center", va="bottom")
            bottom = 0.0
            for _, part, pc in SPLIT_PARTS:
                v = r.get(part)
                if pd.notna(v) and v > 0:  # None: a record from before the part was measured
                    bx.bar(x, v, 0.25, bottom=bottom, color=pc, label=part)
                    bottom += v
            bx.bar(x, max(r["other"], 0), 0.25, bottom=bottom, color="0.75", label="other (compute, host)")
            bx.text(x, 1e3 / r["tok_s"], r["kind"][0], fontsize=6, ha="center", va="bottom")
        for a in (ax, bx):
            a.set_xticks(range(len(slots)), [f"S={s:g}" for s in slots])
        for _, h in g[g["predictor"] == "mlx-lm"].iterrows():
            ax.axhline(h["tok_s"], color="k", linewidth=0.8, linestyle="--", label="mlx-lm resident")
        ax.margins(y=0.3)  # room for the best fitted predictor's name
        ax.set_ylabel("decode tok/s")
        bx.set_ylabel("ms per token")
        ax.set_title(f"{key[1]}, {key[2]} prompts, {key[0]}, {install} install", fontsize=8)
        bx.set_title("where a token's time goes (d: demand, b: best fitted, o: oracle)", fontsize=8)
    _shared_legend(
        fig,
        axes,
        axes.size,
        "Does prediction pay? Demand loading, the best fitted predictor and the oracle at each S "
        "(bars: median; whiskers: min..max over repetitions)",
        0.05,
        8,
    )
    _save(fig, figdir, "prediction_pays")


def drawings(figdir, trained) -> dict:
    """Every figure's name and the call that draws it (each reads its own tables and writes its
    PNG and PDF), the slowest first."""
    return {
        "prediction_pays": partial(prediction_pays, figdir, trained),
        "throughput_vs_slots": partial(_online, figdir, "throughput_vs_slots", "tok_s", "decode tok/s",
                                       "Throughput against slots, by predictor"),
        "throughput_vs_memory": partial(memory, figdir),
        "stall_vs_slots": partial(_online, figdir, "stall_vs_slots", "stall_ms_per_token", "stall ms per token",
                                  "Stall against slots, by predictor"),
        "predictor_recall": partial(predictor_recall, figdir),
        "placement": partial(placement, figdir),
        "design": partial(design, figdir),
        "miss_breakdown": partial(miss_breakdown, figdir),
        "routing": partial(routing, figdir),
        "train_loss": partial(train_loss, figdir),
        "many_rows": partial(many_rows, figdir),
        "families": partial(families, figdir),
    }  # fmt: skip


def build(figdir, trained, jobs=1):
    """Every figure from the tables in `figdir`/tables. `trained`: the models whose routing was
    learnt (the registry's models with a training recipe; the workflow says which, so that drawing
    needs no engine). `jobs` > 1 draws in that many processes (forked on Linux, where they share
    the imports already made): matplotlib's text layout, not reading, is what a figure costs."""
    draws = list(drawings(figdir, trained).values())
    if jobs <= 1:
        for draw in draws:
            draw()
        return
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        for done in [pool.submit(draw) for draw in draws]:
            done.result()  # a figure that fails stops the job with its own traceback
