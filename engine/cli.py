"""Command line (`python -m engine`, or `titan`): {list,plan,build,pin,store,decode,trace,fit,train,version} ...

Every option is checked before anything loads: a bad value is an error naming the option."""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from . import api, serve, versions
from . import generate as generation
from .arguments import (
    ERRORS,
    memory_size,
    non_negative,
    positive,
    probability,
    seconds,
)
from .config import EngineConfig, build_lock, resources_dir
from .device import kind as device_kind
from .memory import CARDS_GB, fmt
from .models import embedded, registry, train
from .models.anatomy import expert_params, moe_blocks, top_k_of
from .predict import predictors, prompts
from .runtime import installs
from .runtime import store as store_mod
from .runtime.engine import open_store, store_dir
from .runtime.loop import MemoryWatch, decode, summarize
from .sampling import arg_type
from .tracing import fitting, trace


def add_engine_args(p):
    p.add_argument("--model", default="olmoe-tiny", help="model id from the registry (default: olmoe-tiny)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--slots", type=positive, default=None, help="slots per MoE layer (default: every expert)")
    size.add_argument(
        "--memory",
        type=memory_size,
        default=None,
        metavar="BUDGET",
        help="a memory budget (e.g. 8GB, 512MiB) instead of --slots: the engine picks the slots",
    )
    p.add_argument(
        "--context",
        type=positive,
        default=None,
        help="tokens of KV cache a --memory budget keeps room for (with --memory; default 4096)",
    )
    p.add_argument(
        "--tier", choices=["page_cache", "cold"], default="page_cache", help="storage tier of the expert store"
    )
    p.add_argument(
        "--install",
        choices=installs.CHOICES,
        default="auto",
        help="inplace: reads land in slot memory (pinned on a GPU); copy: NumPy record, mx.array, lazy buffer write; "
        "pinned: pinned staging and a copy kernel (CUDA); device: every expert in pinned host memory "
        "and the slot maps on the device, no host synchronisation inside a token (CUDA; MLX "
        "operations elsewhere); auto: inplace on the CPU, device on a CUDA GPU (pinned where the "
        "host tier does not fit or a predictor prefetches), copy on other GPUs",
    )
    p.add_argument(
        "--sync",
        choices=["batched", "per_miss"],
        default="batched",
        help="per_miss: read misses one at a time and evaluate the slot table after each (ablation)",
    )
    p.add_argument("--readers", type=positive, default=4, help="reader threads of the expert store")
    p.add_argument(
        "--eviction", choices=["lru", "lfu", "lru-predicted"], default="lru", help="eviction policy of the slot tables"
    )
    p.add_argument(
        "--predictor", choices=list(predictors.NAMES), default="none", help="what to prefetch (none: demand loading)"
    )
    p.add_argument(
        "--depth",
        type=positive,
        default=1,
        help="prefetch depth d, 1..L (the model's MoE layers): layer l prefetches layer l+d of the same token, "
        "wrapping onto the next token's layers (d = L: the same layer, next token)",
    )
    p.add_argument("--predict-size", type=positive, default=None, help="experts predicted per layer (default: top_k)")
    p.add_argument(
        "--min-prob",
        type=probability,
        default=0.0,
        help="issue only predicted experts at least this likely (fitted predictors; default 0: all)",
    )
    p.add_argument(
        "--fit-set",
        choices=list(prompts.SETS),
        default="general",
        help="prompt set whose fit traces fitted predictors learn from",
    )
    p.add_argument(
        "--verify",
        choices=["first", "always", "never"],
        default="first",
        help="check an expert's checksum on its first read (default), every read, or never",
    )


def add_generation_args(p):
    p.add_argument("--prompt", default="The Python language", help="prompt text")
    p.add_argument("--prompt-file", default=None, metavar="FILE", help="read the prompt from FILE (- for stdin)")
    p.add_argument("--max-tokens", type=arg_type("max_tokens"), default=256, help="tokens to generate at most")
    p.add_argument("--temp", type=arg_type("temperature"), default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=arg_type("top_p"), default=1.0, help="nucleus sampling threshold in (0, 1] (1: off)")
    p.add_argument("--min-p", type=arg_type("min_p"), default=0.0, help="min-p sampling threshold (0: off)")
    p.add_argument("--top-k", type=arg_type("top_k"), default=0, help="sample among the k likeliest tokens (0: off)")
    p.add_argument("--repetition-penalty", type=arg_type("repetition_penalty"), default=None,
                   help="e.g. 1.1, above 0 (default: off)")  # fmt: skip
    p.add_argument("--seed", type=arg_type("seed"), default=None, help="random seed for sampling (0..2**64-1)")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="apply the tokenizer's chat template (default: when the model has one)",
    )
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the prompt as it is")


def engine_config(a) -> EngineConfig:
    return EngineConfig(
        slots=a.slots,
        tier=a.tier,
        install=a.install,
        sync=a.sync,
        readers=a.readers,
        eviction=a.eviction,
        verify=a.verify,
        predictor=a.predictor,
        depth=a.depth,
        predict_size=a.predict_size,
        min_prob=a.min_prob,
        fit_set=a.fit_set,
        memory=a.memory,
        context=a.context or EngineConfig.context,
    )


def cmd_list(a):
    for mid, spec in registry.load_registry().items():
        if spec["kind"] == "real":
            state = f"{spec['repo']} @ {spec['revision'] or 'not pinned'}"
        else:
            built = (resources_dir() / "models" / mid / embedded.MANIFEST).exists()
            shape = {k: ("default" if v is None else v) for k, v in registry.shape_of(spec).items()}
            state = (
                f"{spec['architecture']} {spec['dtype']} E={shape['experts']} K={shape['top_k']} L={shape['layers']} "
                + ("built" if built else "not built")
            )
        print(f"{mid:24s} {spec['kind']:9s} {state}")


def cmd_plan(a):
    budgets = a.memory or [gb * 10**9 for gb in CARDS_GB]
    cfg = EngineConfig(install=a.install, context=a.context)
    out = api.plan(a.model, budgets, cfg, card=a.cuda)
    if a.json:
        rows = {fmt(b): (p if isinstance(p, str) else dataclasses.asdict(p)) for b, p in out["budgets"].items()}
        print(json.dumps(dict(out, budgets=rows), indent=2))
        return
    where = "a CUDA card" if a.cuda else f"this machine ({device_kind()})"
    print(f"{a.model} on {where}, {a.context} tokens of context: decoding with every expert in memory takes "
          f"{fmt(out['resident'])}; the {out['install']} install decodes in {fmt(out['least'])} and up")  # fmt: skip
    for b, p in out["budgets"].items():
        if isinstance(p, str):
            print(f"  {fmt(b):>9s}  does not fit (at least {fmt(out['least'])})")
        else:
            share = "every expert" if p.slots == p.experts else f"{100 * p.slots / p.experts:.0f} % of them"
            print(f"  {fmt(b):>9s}  {p.slots:4d} of {p.experts} experts a layer ({share}), {p.install} install, "
                  f"{fmt(p.total)} planned")  # fmt: skip


def cmd_build(a):
    spec = registry.get_spec(a.model)
    if spec["kind"] != "embedded":
        raise registry.RegistryError(f"model '{a.model}' is real: it is pinned and loaded, never built")
    out = resources_dir() / "models" / a.model
    if a.force:
        with build_lock(out):
            embedded.build(spec, out)
    else:
        embedded.check_or_build(spec, out)
    print(out)


def cmd_pin(a):
    rev = registry.pin(a.model)
    print(f"{a.model}: revision {rev} written to {registry.get_spec(a.model)['source']}")


def cmd_store(a):
    model, _, spec, path = registry.load(a.model, lazy=True)
    if a.action == "build":
        with build_lock(store_dir(a.model)):
            if a.force or not store_mod.built_from(store_dir(a.model), path):
                store_mod.build(model, path, store_dir(a.model), a.model)
            else:
                # Kept: newer than its model now, so a workflow does not schedule it (and every
                # sweep that reads it) again on its next run.
                os.utime(store_dir(a.model) / "index.json")
        print(store_dir(a.model))
    else:
        n = registry.verify(a.model)  # the model's own files first: the store is built from them
        print(f"{path}: {n} model files verified")
        with open_store(a.model, model, path, build=False) as s:
            s.verify_all()
            print(f"{s.path}: {sum(l['experts'] for l in s.layers)} experts in {s.num_layers} layers verified")


def cmd_decode(a):
    eng = api.load(a.model, engine_config(a))
    try:
        tok = eng.tokenizer
        ids = tok.encode(a.prompt)
        if not ids:
            raise ValueError("--prompt: the prompt encodes to no token; give some text")
        api.check_context(a.model, len(ids), a.tokens, "--tokens")
        if a.predictor == "oracle":
            # The oracle reads this very run: record it first with plain mlx-lm (same tokens).
            eng.bind_oracle(trace.record(registry.load_reference(a.model)[0], ids, a.tokens)["experts"])
        tokens, records, _ = decode(eng.model, ids, a.tokens, eos_id=tok.eos_token_id if a.stop_at_eos else None)
        s = summarize(records)
        if a.json:
            print(json.dumps(dict(summary=s, counters=eng.counters(), steps=records, text=tok.decode(tokens))))
            return
        print(a.prompt + tok.decode(tokens))
        print("---")
        if not s:
            print(f"{a.model}: prefill only (--tokens 0)")
            return
        hr = "n/a (all resident)" if s.get("hit_rate") is None else f"{s['hit_rate']:.3f}"
        print(
            f"{a.model} S={eng.slots}/{eng.num_experts} tier={a.tier} install={eng.install.name}: "
            f"{s['tok_s']:.2f} tok/s over {s['tokens']} tokens, hit rate {hr}, "
            f"{s['bytes_read_per_token'] / 1e6:.2f} MB read/token, stall {1e3 * s['stall_s_per_token']:.2f} ms/token"
        )
        if s.get("misses") and not eng.install.host_reads:
            print("per miss: read by the device from the host tier, inside the token's graph (no host work to split)")
        elif s.get("misses"):
            print(
                f"per miss: pread {s['per_miss_pread_ms']:.3f} ms (summed over readers), "
                f"array {s['per_miss_array_ms']:.3f} ms, install {s['per_miss_install_ms']:.3f} ms, "
                f"stall {s['per_miss_stall_ms']:.3f} ms"
            )
        if a.predictor != "none":
            print(
                f"prefetch {a.predictor} d={a.depth}: "
                + " ".join(f"{k}={s[k]}" for k in ("issued", "useful", "wasted", "late", "cancelled"))
                + f" late_stall={1e3 * s['late_stall_s_per_token']:.2f} ms/token"
            )
        print("counters: " + " ".join(f"{k}={v}" for k, v in eng.counters().items()))
    finally:
        eng.close()


def read_prompt(a) -> str:
    if a.prompt_file == "-":
        return sys.stdin.read()
    if a.prompt_file:
        try:
            return Path(a.prompt_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompt-file: {a.prompt_file}: not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise ValueError(f"--prompt-file: {a.prompt_file}: {e.strerror}") from None
    return a.prompt


def sampling(a) -> generation.Sampling:
    return generation.Sampling(temp=a.temp, top_p=a.top_p, min_p=a.min_p, top_k=a.top_k,
                               repetition_penalty=a.repetition_penalty, seed=a.seed)  # fmt: skip


def cmd_generate(a):
    prompt = read_prompt(a)
    if not prompt:
        raise ValueError("--prompt: the prompt is empty; give some text (or --prompt-file FILE, - for stdin)")
    eng = api.load(a.model, engine_config(a))
    try:
        watch, before, last = MemoryWatch(), eng.counters(), None
        for r in generation.stream(eng, prompt, a.max_tokens, sampling(a), a.chat):
            print(r.text, end="", flush=True)
            last = r
        f = generation.figures(eng, last, before, watch)
        hr = "n/a (all resident)" if f["hit_rate"] is None else f"{f['hit_rate']:.3f}"
        print(f"\n---\n{a.model} S={f['slots']}/{f['experts']}: {f['tokens']} tokens at {f['tok_s']:.2f} tok/s "
              f"(prompt {f['prompt_tok_s']:.1f} tok/s), hit rate {hr}, peak memory "
              f"{fmt(f['peak_memory_bytes'])} (MLX), {fmt(f['peak_rss_bytes'] or 0)} (process)")  # fmt: skip
    finally:
        eng.close()


def check_args(a):
    """What a command's options mean for its model, checked before anything is built, traced,
    fitted, loaded or served (the parser has checked each value alone): a bad one names the
    option and its range."""
    if hasattr(a, "slots"):  # the commands that load an engine
        if a.context is not None and a.memory is None:
            raise api.OptionError("--context: the KV cache a --memory budget keeps room for; give --memory too")
        api.check(a.model, engine_config(a))
    if a.cmd == "fit":
        shape = registry.shape(a.model)
        api.check_prediction(shape, a.depth, a.size, "--size")
    for option in ("tokens", "max_tokens"):
        if getattr(a, option, None) is not None:
            api.check_context(a.model, 1, getattr(a, option), "--" + option.replace("_", "-"))
    if a.cmd == "generate":  # the model's own ends: its vocabulary (--top-k)
        generation.check_sampling(sampling(a), a.max_tokens, registry.limits_of(a.model))


def cmd_serve(a, rest):
    cfg = engine_config(a)
    model = registry.limits_of(a.model)
    limits = serve.ServeLimits(model["context"], a.queue, a.request_timeout, vocab=model["vocab"], batch=a.batch)
    serve.main(a.model, cfg, limits, rest)


def cmd_trace(a):
    print(trace.run(a.model, a.set, a.split, a.tokens, limit=a.limit))


def cmd_fit(a):
    size = a.size or registry.shape(a.model).get("top_k") or 8
    pred = fitting.fitted_predictor(a.model, a.predictor, a.depth, size, a.set, a.tokens, refit=True)
    print(predictors.fitted_path(a.model, a.set, a.predictor, a.depth, size, a.tokens))
    eval_path = trace.trace_path(a.model, a.set, "eval", a.tokens)
    if not eval_path.exists():
        trace.run(a.model, a.set, "eval", a.tokens)
    q = predictors.quality(pred, trace.load(eval_path))
    print(
        f"{a.predictor} d={a.depth} m={size} on the held-out {a.set} eval prompts: "
        f"precision {q['precision']:.3f} recall {q['recall']:.3f} over {q['n']} predictions"
    )


def cmd_train(a):
    spec = registry.get_spec(a.model)
    if "training" not in spec:
        raise registry.RegistryError(f"model '{a.model}' has no training block in {spec['source']}")
    out = train.train(a.model)
    last = out["curve"][-1]
    print(f"{a.model}: {len(out['curve'])} steps, final loss {last['loss']:.4f}; " + ", ".join(out["outputs"].values()))


def architectures_table() -> str:
    """The coverage table: every MoE architecture of mlx-lm with its tiny embedded model, what its
    experts are made of (read from the built model), and whether the engine offloads it exactly
    (tests/test_architectures.py checks every `yes`)."""
    rows = ["| architecture | model | experts | top-k | per-expert tensors | exact |", "|---|---|---|---|---|---|"]
    for mid, spec in sorted(registry.load_registry().items(), key=lambda kv: kv[1].get("architecture", "").lower()):
        if spec.get("source") != str(registry.ARCHITECTURES):
            continue
        shape = registry.shape_of(spec)
        tensors = "?"
        try:
            model, _, _, _ = registry.load(mid, lazy=True)
            blocks = moe_blocks(model)
            tensors = ", ".join(n for n, _ in expert_params(blocks[0].switch))
            shape["experts"] = expert_params(blocks[0].switch)[0][1].shape[0]
            shape["top_k"] = top_k_of(model, blocks[0]) or shape["top_k"]
        except Exception as e:  # noqa: BLE001 - the table says what stopped it
            tensors = f"(cannot load: {type(e).__name__})"
        exact = "yes" if spec.get("exact", True) else f"no: {spec.get('reason', '')}"
        rows.append(
            f"| `{spec['architecture']}` | `{mid}` | {shape['experts']} | {shape['top_k']} | {tensors} | {exact} |"
        )
    return "\n".join(rows) + "\n"


def cmd_architectures(a):
    print(architectures_table(), end="")


def cmd_version(a):
    print(
        json.dumps(
            dict(versions=dict(versions.versions(), **{"engine-code": versions.code_digest()}), device=device_kind()),
            sort_keys=True,
        )
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    ap.add_argument(
        "--models",
        default=None,
        metavar="FILE",
        help="a models file that extends the packaged registry (default: $TITAN_MODELS, else "
        "configs/models.yaml here if present)",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("list", help="the registered models and whether they are built")
    p.set_defaults(fn=cmd_list)

    p = sub.add_parser(
        "plan", help="whether a model decodes within memory budgets (a card's memory) and how, without loading it"
    )
    p.add_argument("model")
    p.add_argument("--memory", type=memory_size, nargs="+", default=None, metavar="SIZE",
                   help=f"budgets to plan (default: cards of {', '.join(map(str, CARDS_GB))} GB)")  # fmt: skip
    p.add_argument("--context", type=positive, default=EngineConfig.context, help="tokens of KV cache to hold")
    p.add_argument("--install", choices=installs.CHOICES, default="auto", help="the install to plan for")
    p.add_argument("--cuda", action="store_true",
                   help="plan for a CUDA card, from any machine (where auto chooses the device install)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("build", help="build an embedded model (deterministic from its spec and seed)")
    p.add_argument("model")
    p.add_argument("--force", action="store_true", help="rebuild even if built")
    p.set_defaults(fn=cmd_build)

    p = sub.add_parser("pin", help="write the commit of the locally cached copy of a real model into its models file")
    p.add_argument("model")
    p.set_defaults(fn=cmd_pin)

    p = sub.add_parser("store", help="build or verify a model's expert store")
    p.add_argument("action", choices=["build", "verify"])
    p.add_argument("model")
    p.add_argument("--force", action="store_true", help="rebuild even if built from this very model")
    p.set_defaults(fn=cmd_store)

    p = sub.add_parser("decode", help="greedy decoding through the engine; prints the text and tok/s")
    add_engine_args(p)
    p.add_argument("--tokens", type=non_negative, default=64, help="tokens to generate after the prompt")
    p.add_argument("--prompt", default="The Python language", help="prompt text")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at the end-of-text token")
    p.add_argument("--json", action="store_true", help="print one JSON object with every step's figures")
    p.set_defaults(fn=cmd_decode)

    p = sub.add_parser(
        "trace", help="record routing traces (experts, router probabilities, hidden states) over a prompt set"
    )
    p.add_argument("--model", default="olmoe-tiny")
    p.add_argument("--set", choices=list(prompts.SETS), default="general")
    p.add_argument("--split", choices=list(prompts.SPLITS), default="fit")
    p.add_argument("--tokens", type=non_negative, default=32, help="decode tokens per prompt after its prefill")
    p.add_argument("--limit", type=positive, default=None, help="only the first N prompts")
    p.set_defaults(fn=cmd_trace)

    p = sub.add_parser("generate", help="generate text through mlx-lm's stream_generate, with its samplers")
    add_engine_args(p)
    add_generation_args(p)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser(
        "serve",
        help="mlx-lm's OpenAI-compatible HTTP server backed by an engine model (mlx_lm.server's own options pass "
        "through: --host, --port, --max-tokens, ...)",
        epilog="Options not listed here (--host, --port, --max-tokens, ...) pass through to mlx_lm.server.",
    )
    add_engine_args(p)
    p.add_argument(
        "--queue",
        type=positive,
        default=8,
        help="requests admitted at once (default 8); past it: 503",
    )
    p.add_argument(
        "--no-batch",
        dest="batch",
        action="store_false",
        help="serve requests one after the other (default: concurrent requests decode as one batch, as "
        "mlx_lm.server's do; docs/serve.md)",
    )
    p.add_argument(
        "--request-timeout",
        type=seconds,
        default=300.0,
        metavar="SECONDS",
        help="a request stops generating after this long (default 300; finish_reason: length)",
    )
    p.set_defaults(fn=cmd_serve, passthrough=True)

    p = sub.add_parser("fit", help="fit a predictor on the fit traces and score it on the eval traces")
    p.add_argument("--model", default="olmoe-tiny")
    p.add_argument("--set", choices=list(prompts.SETS), default="general")
    p.add_argument("--predictor", choices=list(predictors.FITTED), default="transition")
    p.add_argument("--depth", type=positive, default=1)
    p.add_argument("--size", type=positive, default=None, help="experts predicted per layer (default: top_k)")
    p.add_argument("--tokens", type=non_negative, default=32, help="decode tokens per prompt in the traces")
    p.set_defaults(fn=cmd_fit)

    p = sub.add_parser("train", help="train a model with a training block (e.g. olmoe-trained)")
    p.add_argument("model", nargs="?", default="olmoe-trained")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("architectures", help="the MoE architectures of mlx-lm and whether each is offloaded exactly")
    p.set_defaults(fn=cmd_architectures)

    p = sub.add_parser("version", help="this node's mlx, mlx-lm and engine versions and device, as JSON")
    p.set_defaults(fn=cmd_version)
    return ap


def main(argv=None):
    ap = parser()
    a, rest = ap.parse_known_args(argv)
    if rest and not getattr(a, "passthrough", False):
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.models:
        if not os.path.isfile(a.models):
            why = "a directory, not a models file" if os.path.isdir(a.models) else "no such models file"
            print(f"error: --models: {a.models}: {why}", file=sys.stderr)
            sys.exit(2)
        os.environ["TITAN_MODELS"] = a.models
    try:
        check_args(a)
        a.fn(a, rest) if getattr(a, "passthrough", False) else a.fn(a)
    except ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:
        # A reader such as `head` closed the pipe: stop quietly, as command-line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
