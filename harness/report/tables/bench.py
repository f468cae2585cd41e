"""The engine-core benchmarks (`harness bench`): one row per figure, each a ratio measured in one run."""

import re
import statistics

import pandas as pd

from .common import MACHINE, latest, machine_cols, paired, res_get


def throughput_key(rec):
    """A `bench throughput` configuration's name with its install path: a run of one install named
    its offloaded configurations `S=16`, and runs of different days' defaults must not share a
    row. Records from before they named it ran the default of their day (as in online_rows)."""
    installs = rec["result"].get("install") or {}
    default = "copy" if rec["device"] == "gpu" else "inplace"
    # decoded through mlx-lm's own generate_step (`--loop mlx-lm`): another row than the engine's loop
    loop = "@mlx-lm" if rec["result"].get("loop") == "mlx-lm" else ""

    def key(k):
        if k.startswith("S=") and k != "S=E" and "/" not in k:
            return f"{k}/{installs.get(k, default)}{loop}"
        return f"{k}{loop}"

    return key


# throughput_key's names read back: S=16/device@mlx-lm is S = 16 on the device install through
# mlx-lm's generate_step; S=E is resident decoding by the engine (mlx-lm's own is `mlx-lm`).
# The server `bench serve` sets each engine server against (harness.servebench.REFERENCE; a test
# holds the two together: this layer imports no bench).
REFERENCE_SERVER = "mlx_lm.server"
CONFIG = re.compile(r"^S=(?P<slots>\d+|E)(?:/(?P<install>[a-z-]+))?(?P<loop>@mlx-lm)?$")


def paired_figures(key: str, ratios: dict) -> dict:
    """A configuration's paired ratios to resident decoding (common.paired) as table figures."""
    names = dict(median="x resident paired", min="x resident paired_min", max="x resident paired_max")
    return {f"{name}[{key}]": ratios[stat] for stat, name in names.items()}


def many_rows_key(res: dict):
    """A `bench prefill` or `bench batch` configuration's name with its install path, as
    throughput_key names them: `S=16/device/ahead` (`resident`: mlx-lm's own model)."""
    installs = res.get("install") or {}

    def key(k):
        if k == "resident" or k not in installs or f"/{installs[k]}" in k:
            return k
        s, _, rest = k.partition("/")
        return f"{s}/{installs[k]}" + (f"/{rest}" if rest else "")

    return key


def config_slots(config: str) -> int:
    """S of a `bench prefill` or `bench batch` configuration's name (`S=16/device/union`: 16)."""
    return int(config.split("/")[0].removeprefix("S="))


def measured_default(rows: pd.DataFrame, default: bool = True) -> pd.DataFrame:
    """The rows of the many-rows runs that measured the install `auto` gives on their machine
    (`default[...]` 1 for a configuration; runs from before they said which count as such), or,
    with `default` False, of the runs that measured another install alone (an ablation such as
    `--installs pinned`): a target is read from the first kind, never from the second."""
    if rows.empty:
        return rows
    said = rows[rows["figure"].str.startswith("default[")]
    other = set(said.groupby("run_id")["value"].max().loc[lambda v: v < 1].index) if len(said) else set()
    return rows[rows["run_id"].isin(other) != default]


def _spread_figures(figs: dict, name: str, key: str, sp: dict):
    figs[f"{name}[{key}]"] = sp["median"]
    figs[f"{name}_min[{key}]"], figs[f"{name}_max[{key}]"] = sp["min"], sp["max"]


def many_rows_figures(res: dict) -> dict:
    """A prefill or batch record's figures: each configuration's time to first token (ms) per
    prompt length, or aggregate tok/s per batch size, with its ratio to resident's in the same
    repeat (median, min, max), whether its tokens were resident's, (prefill) the decode after the
    longest prompt and the memory it held, and (batch) the bus's limit at each B."""
    k_, figs = many_rows_key(res), {}
    if res["bench"] == "prefill":
        for k, per in res["ttft_s"].items():
            for n, sp in per.items():
                _spread_figures(figs, "ttft_ms", f"{k_(k)}@{n}", {x: 1e3 * v for x, v in sp.items() if x != "n"})
                _spread_figures(figs, "x resident", f"{k_(k)}@{n}", res["x_resident"][k][n])
            _spread_figures(figs, "decode x resident", k_(k), res["decode_x_resident"][k])
            figs[f"decode_tok_s[{k_(k)}]"] = res["decode_tok_s"][k]["median"]
            figs[f"memory_bytes[{k_(k)}]"] = res["memory_bytes"][k]
            figs[f"memory x resident[{k_(k)}]"] = res["memory_x_resident"][k]
    else:
        for k, per in res["tok_s"].items():
            for b, sp in per.items():
                _spread_figures(figs, "tok_s", f"{k_(k)}@B{b}", sp)
                _spread_figures(figs, "x resident", f"{k_(k)}@B{b}", res["x_resident"][k][b])
        for b, x in res.get("bus_limit_x_resident", {}).items():  # recorded since the bus was measured
            figs[f"bus limit x resident[B{b}]"] = x
            figs[f"step_bytes[B{b}]"] = res["step_bytes"][b]
            every = int(b) * res["top_k"] >= res["experts"]
            figs[f"rows name every expert[B{b}]"] = float(every)
            named = res.get("named_experts", {}).get(b)
            if named is not None:  # counted since: how many a step's rows named, a layer's mean
                total = sum(int(u) * n for u, n in named["counts"].items())
                figs[f"named experts a layer[B{b}]"] = total / max(1, sum(named["counts"].values()))
                figs["experts"] = res["experts"]
            if every or named is not None:
                figs.update(_slot_limits(res, b, k_))
        if "bus" in res:
            figs["bus_gb_s"] = res["bus"]["gb_s"]
    figs.update({f"tokens_match[{k_(k)}]": float(v) for k, v in res["tokens_match"].items()})
    if "default_install" in res:  # which configurations run what `auto` gives there (recorded since)
        figs.update({f"default[{k_(k)}]": float(v == res["default_install"]) for k, v in res["install"].items()})
    figs["repeats"] = res["repeats"]
    return figs


def named_limit(
    named: dict,
    slots: int,
    expert_bytes: int,
    gb_s: float,
    resident_tok_s: float,
    serial: bool = False,
    fewest: bool = False,
) -> float:
    """The bus's limit of a path holding `slots` experts a layer, from what a batch's decode steps
    named (`harness.manyrows.named_experts`: how many (step, layer) pairs named u experts, and the
    rows, tokens, of those steps): the slots may hold named ones, the other max(0, u - slots)
    cross the bus; resident's seconds a token over the larger of its own and the bus's for a
    token's share of those bytes, or with `serial`, over their sum: a path whose copies do not
    overlap its compute. With `fewest`, the bytes are those of the fewest experts any cache of
    `slots` must bring in over the steps (`named["fewest_misses"]`, Belady's rule): the slots
    cannot hold at every step just the experts that step names."""
    if fewest:
        beyond = named["fewest_misses"][str(slots)] * expert_bytes
    else:
        beyond = sum(max(0, int(u) - slots) * n for u, n in named["counts"].items()) * expert_bytes
    resident_s, bus_s = 1 / resident_tok_s, beyond / max(1, named["rows"]) / (gb_s * 1e9)
    return resident_s / (resident_s + bus_s if serial else max(resident_s, bus_s))


def _slot_limits(res: dict, b: str, k_) -> dict:
    """Each configuration's bus limit at B. Where the record counted the experts its rows named
    (`named_experts`), from those: the slots may hold S of them, the rest cross the bus once a
    step (`named_limit`). Before that, only at a B whose rows name every expert of a layer: the
    S experts its slots hold reach the many-rows area from the device (a resident one from its
    slot), so the bus carries the other E - S a layer once a step; resident's time a step over the
    larger of that time and the bus's for those bytes. With the count, also the speed of a path
    that copies those bytes and then computes (`bus serial x resident`): where a path reaches that
    and not the limit, its copies do not overlap its compute."""
    E, out = res["experts"], {}
    resident_s = int(b) / res["tok_s"]["resident"][b]["median"]
    named = res.get("named_experts", {}).get(b)
    for k in res["tok_s"]:
        if not k.startswith("S="):
            continue
        S, at = config_slots(k), f"{k_(k)}@B{b}"
        if named is not None:
            args = (named, S, res["expert_bytes"], res["bus"]["gb_s"], res["tok_s"]["resident"][b]["median"])
            x, out[f"bus serial x resident[{at}]"] = named_limit(*args), named_limit(*args, serial=True)
            least = named.get("fewest_misses", {}).get(str(S))
            if least is not None:  # counted since: any cache's least
                out[f"bus cache limit x resident[{at}]"] = named_limit(*args, fewest=True)
                out[f"fewest misses a layer[{at}]"] = least / max(1, sum(named["counts"].values()))
        else:
            bus_s = res["step_bytes"][b] * max(0, E - S) / E / (res["bus"]["gb_s"] * 1e9)
            x = resident_s / max(resident_s, bus_s)
        out[f"bus limit x resident[{at}]"] = x
    return out


def families_figures(res: dict) -> dict:
    """A `bench families` record's figures: per configuration (`25%`, `16.0 GB`, `pinned 25%`, and
    `resident`) its decode tok/s and ratio to resident's in the same repeat (median, min, max), the
    bus-bound limit of the bytes it read a token and its ratio to that limit, time to first token,
    device memory, bytes read and host time a layer, whether its tokens were resident's; and the
    family's least budget that decodes, its weights and the bus's bandwidth."""
    figs, res_mem = {}, res["resident"]["device_memory_bytes"]
    if res["resident"]["tok_s"]:
        _spread_figures(figs, "tok_s", "resident", res["resident"]["tok_s"])
        figs["ttft_ms[resident]"] = 1e3 * res["resident"]["ttft_s"]["median"]
    figs["memory_bytes[resident]"] = res_mem
    for k, c in res["configurations"].items():
        _spread_figures(figs, "tok_s", k, c["tok_s"])
        _spread_figures(figs, "x resident", k, c["x_resident"])
        figs[f"limit x resident[{k}]"] = c["limit_x_resident"]
        figs[f"x limit[{k}]"] = c["x_limit"]
        figs[f"ttft_ms[{k}]"] = 1e3 * c["ttft_s"]["median"]
        figs[f"memory_bytes[{k}]"] = c["device_memory_bytes"]
        figs[f"memory x resident[{k}]"] = c["device_memory_bytes"] / res_mem
        figs[f"bytes_read_per_token[{k}]"] = c["bytes_read_per_token"]
        figs[f"host_ms_per_layer[{k}]"] = c["host_ms_per_layer"]
        figs[f"slots[{k}]"] = c["slots"]
        figs[f"tokens_match[{k}]"] = float(c["tokens_match"])
        if "tokens_in_resident_runs" in c:  # each repeat's tokens were one of resident's own runs
            figs[f"tokens in resident runs[{k}]"] = float(c["tokens_in_resident_runs"])
        first = [i for i in c.get("first_difference", []) if i is not None]
        if first:  # the earliest token where a repeat parted from resident's (0: the prompt's own)
            figs[f"first difference[{k}]"] = min(first)
    if not res["resident"].get("tokens_stable", True):
        figs["resident tokens unstable"] = 1.0
    if "exactness" in res:  # the full-size exactness test on this run's model: 1 passed, 0 not (absent: skipped)
        e = res["exactness"]["outcome"]
        if e != "skipped":
            figs["exact_full_size"] = float(e == "passed")
    figs.update(least_budget_bytes=res["least_budget_bytes"], weights_bytes=res["weights_bytes"],
                bus_gb_s=res["bus"]["gb_s"], repeats=res["repeats"], experts=res["shape"]["experts"],
                layers=res["shape"]["layers"])  # fmt: skip
    if res["bus"].get("tier", {}).get("gb_s"):  # the device install's own kernel reading its host tier
        figs["tier_gb_s"] = res["bus"]["tier"]["gb_s"]
    # the first decode token apart from the rest (records since): what a prompt left queued waits there
    for k, c in [("resident", res["resident"]), *res["configurations"].items()]:
        if c.get("first_decode_ms"):
            figs[f"first_decode_ms[{k}]"] = c["first_decode_ms"]["median"]
            _spread_figures(figs, "tok_s_after_first", k, c["tok_s_after_first"])
        if "x_resident_after_first" in c:
            _spread_figures(figs, "x resident after first", k, c["x_resident_after_first"])
        if c.get("step_ms"):  # the engine's loop over a short prompt: its first decode step, the rest's mean
            figs[f"loop_first_ms[{k}]"], figs[f"loop_later_ms[{k}]"] = c["step_ms"]["first"], c["step_ms"]["later"]
    return figs


def plan_figures(res: dict) -> dict:
    """A `bench plan` result's figures: a family's weights, what resident decoding takes, the least
    budget its install decodes in, and at each card's budget the slots a layer planned (0 where
    the budget cannot hold it) and the bytes planned."""
    figs = dict(weights_bytes=res["weights_bytes"], resident_bytes=res["resident_bytes"],
                least_budget_bytes=res["least_budget_bytes"], experts=res["shape"]["experts"],
                layers=res["shape"]["layers"], context=res["context"])  # fmt: skip
    for card, c in res["cards"].items():
        figs[f"slots[{card}]"] = c.get("slots", 0)
        if "planned_bytes" in c:
            figs[f"planned_bytes[{card}]"] = c["planned_bytes"]
    return figs


def without_settings(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of runs made under no MLX or CUDA settings (`settings` empty; a CSV reads it as NaN),
    or, where every run had some (a diagnosis alone), `rows` itself: what the headline tables show."""
    if "settings" not in rows.columns:
        return rows
    plain = rows["settings"].isna() | (rows["settings"] == "")
    return rows[plain] if plain.any() else rows


# Benches whose every run measures the whole of its model on a machine: a figure that the latest
# commit's runs do not have (a configuration whose tokens now equal resident's has no "first
# difference") is not left standing from an older run beside them.
WHOLE_RUNS = ("families",)


def _whole_runs_latest(rows: list, benches) -> list:
    """`rows` less those of `benches` whose run's commit is not the commit of the latest run of
    the same machine, bench, model and settings."""
    group = MACHINE + ["bench", "model", "settings"]
    newest = {}
    for r in rows:
        if r["bench"] in benches:
            k = tuple(r[c] for c in group)
            newest[k] = max(newest.get(k, ("", "", "")), (r["started_utc"], r["run_id"], r["commit"]))
    return [r for r in rows if r["bench"] not in benches or r["commit"] == newest[tuple(r[c] for c in group)][2]]


def bench_table(recs):
    """The engine-core benchmarks, one row per figure: each a ratio measured in one run."""
    rows = []
    for r in recs:
        res, base = (
            r["result"],
            dict(
                **machine_cols(r),
                bench=res_get(r, "bench"),
                model=res_get(r, "model"),
                tokens=res_get(r, "tokens"),  # a decode's length: short ones pay more cold misses a token
                started_utc=r["started_utc"],
                run_id=r["run_id"],
                # a run under MLX or CUDA environment variables (a diagnosis, MLX_USE_CUDA_GRAPHS=0):
                # not the default path's measurement, so the headline tables take it only where alone
                settings=" ".join(f"{k}={v}" for k, v in r.get("settings", {}).items()),
            ),
        )
        figs = {}
        if base["bench"] == "throughput":
            k_ = throughput_key(r)
            figs = {f"tok_s[{k_(k)}]": v for k, v in res["tok_s"].items()}
            for k, sp in res.get("tok_s_spread", {}).items():
                figs[f"tok_s_min[{k_(k)}]"], figs[f"tok_s_max[{k_(k)}]"] = sp["min"], sp["max"]
            figs.update({f"x resident[{k_(k)}]": v for k, v in res.get("ratio_vs_resident", {}).items()})
            runs = res.get("tok_s_runs", {})
            if res.get("ratio_vs_resident") and "S=E" in runs:
                figs[f"repeats[{k_('S=E')}]"] = len(runs["S=E"])
                for k, v in runs.items():  # each repeat against resident decoding in the same repeat
                    figs.update(paired_figures(k_(k), paired(v, runs["S=E"])))
            figs.update({f"memory_bytes[{k_(k)}]": v for k, v in res.get("memory_bytes", {}).items()})
            # a prompt's prefill (records since it was measured): its speed and what it read
            figs.update({f"prefill_tok_s[{k_(k)}]": v for k, v in res.get("prefill_tok_s", {}).items()})
            figs.update({f"prefill_bytes_read[{k_(k)}]": v for k, v in res.get("prefill_bytes_read", {}).items()})
            if res.get("ratio_engine_full_vs_mlx_lm") is not None:  # None: not decoded resident
                figs["ratio engine S=E / mlx-lm"] = res["ratio_engine_full_vs_mlx_lm"]
        elif base["bench"] == "miss":
            figs = {f"per_miss_ms[{k}]": v for k, v in res["per_miss_ms"].items()}
            figs.update({f"copy_split_ms[{k}]": v for k, v in res.get("copy_split_ms", {}).items()})
            figs.update({f"split_ms[{k}]": v for k, v in res.get("split_ms", {}).items()})
            figs.update({f"x raw_preadv[{k}]": v for k, v in res["ratio_vs_raw"].items()})
            figs.update({f"x raw_preadv_h2d[{k}]": v for k, v in res.get("ratio_vs_raw_h2d", {}).items()})
            figs.update({f"x pinned floor[{k}]": v for k, v in res.get("ratio_vs_floor", {}).items()})
            base["tier"] = res["tier"]
        elif base["bench"] == "install":
            figs = {f"install_ms[{k}]": v for k, v in res["install_ms"].items()}
            figs.update({f"S64/S8[{k}]": v for k, v in res["ratio_S64_vs_S8"].items()})
            figs.update({f"diagnosis_ms[{k}]": v for k, v in res.get("diagnosis_ms", {}).items()})
        elif base["bench"] == "prefetch":
            base["tier"], base["slots"] = res["tier"], res["slots"]
            base["prompt_set"] = res["prompt_set"]
            for k, v in res["results"].items():
                k = k if "install" not in res else f"{k}/{v['install']}"
                figs[f"tok_s[{k}]"] = v["tok_s"]
                figs[f"stall_ms_per_token[{k}]"] = v["stall_ms_per_token"]
                if "tok_s_min" in v:
                    figs[f"tok_s_min[{k}]"], figs[f"tok_s_max[{k}]"] = v["tok_s_min"], v["tok_s_max"]
                if "x_resident_paired" in v:  # each prompt against resident decoding of that prompt
                    figs.update(paired_figures(k, v["x_resident_paired"]))
                if "call_split_ms" in v:  # the host building a token's graph, and waiting for it, in ms
                    figs[f"graph_ms[{k}]"] = v["call_split_ms"]["graph"]
                    figs[f"eval_ms[{k}]"] = v["call_split_ms"]["eval"]
                    if "queue" in v["call_split_ms"]:  # a pipelined decode's handing over
                        figs[f"queue_ms[{k}]"] = v["call_split_ms"]["queue"]
                    figs[f"pipelined[{k}]"] = float(res.get("loop") == "pipelined")
        elif base["bench"] in ("prefill", "batch"):
            figs = many_rows_figures(res)
            # a run of other installs (an ablation: `--installs pinned`) keeps its own resident,
            # measured in its own repeats, beside the default run's of the same commit
            base["installs"] = ",".join(sorted(set(res["install"].values())))
        elif base["bench"] == "families":
            figs = families_figures(res)
        elif base["bench"] == "plan":
            figs = plan_figures(res)
        elif base["bench"] == "serve":
            base["slots"] = res["slots"]
            for k, v in res["servers"].items():
                figs[f"latency_p50_s[{k}]"], figs[f"latency_p99_s[{k}]"] = v["latency_p50_s"], v["latency_p99_s"]
                figs[f"tok_s[{k}]"] = statistics.median(v["tok_s"])
                figs[f"tok_s_min[{k}]"], figs[f"tok_s_max[{k}]"] = min(v["tok_s"]), max(v["tok_s"])
                if v["peak_rss_bytes"]:
                    figs[f"peak_rss_bytes[{k}]"] = v["peak_rss_bytes"]
                if "warmup_s" in v:
                    figs[f"warmup_s[{k}]"] = v["warmup_s"]
                ref = res["servers"].get(REFERENCE_SERVER)
                if ref and k != REFERENCE_SERVER:  # each repetition's ratio: the servers ran in turn within it
                    x = paired(v["tok_s"], ref["tok_s"])
                    figs[f"x reference[{k}]"], figs[f"x reference_min[{k}]"] = x["median"], x["min"]
                    figs[f"x reference_max[{k}]"] = x["max"]
            figs["clients"], figs["requests"] = res["clients"], res["clients"] * res["requests"] * res["repeats"]
        for name, value in figs.items():
            rows.append(dict(base, figure=name, value=value))
    keys = MACHINE + ["bench", "model", "tier", "slots", "prompt_set", "tokens", "installs", "settings", "figure"]
    cols = keys + ["value", "runs", "commit", "run_id"]  # run_id: the latest run's, to read one run's figures together
    for row in rows:
        for k in keys:
            row.setdefault(k, None)
    rows = _whole_runs_latest(rows, WHOLE_RUNS)
    df = latest(rows, keys)
    return df.reindex(columns=cols) if not df.empty else pd.DataFrame(columns=cols)
