"""Using the engine as one uses mlx-lm: `generate` (mlx-lm's stream_generate with its samplers), a
memory budget instead of a slot count, the command line (the server: tests/test_serve.py)."""

import json
import os
import subprocess
import sys

import mlx_lm
import pytest
from conftest import ROOT
from conftest import run_cli as run

from engine import generate as generation
from engine import load
from engine.memory import parse_size, plan
from engine.models.registry import load_reference
from engine.runtime.installs import InplaceInstall

MODEL = "qwen3moe-tiny"


# -- generate --------------------------------------------------------------------------------------
def test_greedy_generate_gives_plain_mlx_lms_tokens():
    model, tok, _ = load_reference(MODEL)
    plain = list(mlx_lm.stream_generate(model, tok, "def fibonacci(n):", max_tokens=16))
    want = [r.token for r in plain]
    eng = load(MODEL, slots=16, predictor="previous")
    try:
        got = [r.token for r in generation.stream(eng, "def fibonacci(n):", 16)]
        text, figures = generation.generate(eng, "def fibonacci(n):", 16)
    finally:
        eng.close()
    assert got == want
    assert text == "".join(r.text for r in plain)  # mlx-lm's own detokenizer, as mlx-lm streams it
    assert figures["tokens"] == 16 and figures["misses"] > 0 and 0 < figures["hit_rate"] < 1
    assert figures["peak_memory_bytes"] > 0


def test_sampling_follows_its_seed_and_its_settings():
    eng = load(MODEL, slots=32)
    try:
        s = generation.Sampling(temp=1.0, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=7)
        a, _ = generation.generate(eng, "import os", 12, s)
        b, _ = generation.generate(eng, "import os", 12, s)
        c, _ = generation.generate(eng, "import os", 12, generation.Sampling(temp=1.0, seed=8))
    finally:
        eng.close()
    assert a == b and a != c


def test_a_chat_template_is_applied_when_there_is_one():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return f"<user>{messages[0]['content']}</user><assistant>"

    assert generation.prompt_text(Tok(), "hi") == "<user>hi</user><assistant>"
    assert generation.prompt_text(Tok(), "hi", chat=False) == "hi"

    class Plain:
        chat_template = None

    assert generation.prompt_text(Plain(), "hi") == "hi"
    with pytest.raises(ValueError, match="--chat: this model's tokenizer has no chat template"):
        generation.prompt_text(Plain(), "hi", chat=True)


def test_generate_on_the_command_line_from_stdin_and_a_file(tmp_path):
    r = run("generate", "--model", MODEL, "--slots", "16", "--max-tokens", "6", "--prompt-file", "-",
            stdin="def main():")  # fmt: skip
    assert r.returncode == 0, r.stderr
    text, _, figures = r.stdout.rpartition("\n---\n")
    assert text and "6 tokens at" in figures and "hit rate" in figures and "peak memory" in figures
    prompt = tmp_path / "p.txt"
    prompt.write_text("def main():")
    r2 = run("generate", "--model", MODEL, "--slots", "16", "--max-tokens", "6", "--prompt-file", str(prompt))
    assert r2.stdout.rpartition("\n---\n")[0] == text  # greedy: the same text either way


@pytest.mark.parametrize(
    "args,named",
    [
        (["--temp", "-1"], "argument --temp: must be a finite number >= 0 (0: greedy), not '-1'"),
        (["--top-p", "2"], "argument --top-p: must be a finite number > 0 and <= 1 (1: off), not '2'"),
        (["--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, not '0'"),
        (["--top-p", "0"], "argument --top-p: must be a finite number > 0"),
        (["--temp", "nan"], "argument --temp: must be a finite number"),
        (["--prompt", ""], "--prompt: the prompt is empty"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file: /nonexistent/prompt.txt: No such file"),
        (["--memory", "lots"], "argument --memory: not a size: 'lots'"),
        (["--memory", "8GB", "--slots", "8"], "not allowed with argument"),
    ],
)
def test_generate_refuses_bad_options_by_name(args, named):
    r = run("generate", "--model", MODEL, *args)
    assert r.returncode == 2 and named in r.stderr, r.stderr


# -- a memory budget -------------------------------------------------------------------------------
def test_sizes_parse():
    assert parse_size("8GB") == 8_000_000_000 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5g") == 1_500_000_000 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_size("8 parsecs")


# From 7MB: beside the many-rows area (1.8 MB; on a CUDA GPU the device install's two, 3.5 MB),
# the weights, the KV cache and the margin (2.4 MB), top-k slots in each layer; from 7.9 MB every
# expert fits (5.3 MB) and no area is kept.
@pytest.mark.parametrize("budget", ["7MB", "7.5MB"])
def test_the_memory_budget_chooses_slots_and_the_peak_stays_under_it(budget):
    r = run("decode", "--model", MODEL, "--memory", budget, "--context", "64", "--tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    assert "memory budget" in r.stderr and "experts per MoE layer" in r.stderr
    summary = json.loads(r.stdout)["summary"]
    assert summary["peak_memory_bytes"] <= parse_size(budget)
    assert summary["misses"] > 0  # the budget really left experts out


def test_a_bigger_budget_gives_more_slots_up_to_every_expert():
    model, _, _ = load_reference(MODEL)
    small = plan(model, parse_size("5MB"), 8, InplaceInstall, 64)
    big, huge = (
        plan(model, parse_size("7MB"), 8, InplaceInstall, 64),
        plan(model, parse_size("1GB"), 8, InplaceInstall, 64),
    )
    assert 8 <= small.slots < big.slots < huge.slots == 128
    assert small.total <= small.budget and big.total <= big.budget


def test_a_budget_too_small_is_refused_naming_what_it_needs():
    r = run("decode", "--model", MODEL, "--memory", "1MB", "--context", "64", "--tokens", "2")
    assert r.returncode == 2
    assert "--memory 1.0 MB cannot hold this model" in r.stderr and "top-8 experts" in r.stderr, r.stderr


@pytest.mark.parametrize("model", [MODEL, "tiny-gpt-oss-mxfp4", "tiny-deepseek-v2"])
def test_a_plan_reads_the_shapes_a_load_has_without_loading(model):
    """engine.plan reads a model's parameters from mlx-lm's classes alone (registry.skeleton):
    every name, shape and dtype is the loaded model's (quantized layers, microscaling, shared
    experts), so a budget's plan is the one `--memory` makes on the loaded model, or its refusal
    the same words (12 MB: a plan on the CPU, too small for a CUDA card's pinned install's
    staging records with gpt-oss's and DeepSeek's experts)."""
    from mlx.utils import tree_flatten

    from engine import EngineConfig, api
    from engine.models import registry

    loaded = registry.load(model, lazy=True)[0]
    shapes = [{k: (v.shape, v.dtype) for k, v in tree_flatten(m.parameters())}
              for m in (registry.skeleton(model), loaded)]  # fmt: skip
    assert shapes[0] == shapes[1]
    budget = parse_size("12MB")
    planned = api.plan(model, [budget])["budgets"][budget]
    try:
        made = api.plan_memory(loaded, EngineConfig(memory=budget))[0]
    except ValueError as e:  # api.plan says why where a load refuses
        made = str(e)
    assert planned == made


def test_a_budget_that_holds_every_expert_plans_them_all_and_no_area():
    """Where the fixed part and every expert fit, every expert is resident and no many-rows area is
    kept (it serves only a layer whose rows need more experts than it holds)."""
    from engine.runtime.installs import DeviceInstall

    model, _, _ = load_reference(MODEL)
    p = plan(model, parse_size("7MB"), 8, DeviceInstall, 64)
    every = p.weights + p.kv_cache + p.buffers + p.margin + p.experts * p.moe_layers * p.expert_bytes
    full = plan(model, every, 8, DeviceInstall, 64)
    assert full.slots == full.experts and full.area == 0 and full.total == every
    assert plan(model, every - 1, 8, DeviceInstall, 64).slots < full.experts


def test_plan_says_which_cards_hold_a_model_without_building_it(tmp_path):
    """`engine plan MODEL --cuda`: a 26 GB family planned for CUDA cards on this CPU, in resources
    where nothing is built, and nothing is built: a card too small is said so with the least budget,
    the others with the experts a layer they hold and the device install that auto chooses there."""
    env = dict(os.environ, TITAN_RESOURCES=str(tmp_path))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, cwd=ROOT,
                              env=env, timeout=300)  # fmt: skip

    r = run("plan", "mixtral-8x7b-shape", "--cuda", "--memory", "8GB", "16GB", "40GB", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    small, mid, big = (out["budgets"][k] for k in ("8.00 GB", "16.00 GB", "40.00 GB"))
    assert isinstance(small, str) and "cannot hold this model" in small and out["least"] > 8e9
    assert 2 <= mid["slots"] < 8 and mid["install"] == "device" and mid["area"] > 0
    assert big["slots"] == 8 and out["resident"] > 26e9
    assert not (tmp_path / "models").exists()  # nothing built
    text = run("plan", "mixtral-8x7b-shape", "--cuda", "--memory", "8GB", "16GB").stdout
    assert "does not fit" in text and f"{mid['slots']} of 8 experts a layer" in text


def test_a_listing_piped_into_a_reader_that_stops_early_ends_quietly():
    """`python -m engine list | head -1` stops without a traceback and exits 0; the reader here closes
    before reading anything, so the first write already meets a closed pipe."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "list"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err


def test_the_many_rows_area_counts_in_the_plan_of_the_install_that_runs():
    """--memory plans with the install that will run: the device install keeps two many-rows areas
    (a layer's and the next one's, copied ahead), a host install one; a budget that cannot hold them
    beside the fixed part and top-k slots is refused naming the area."""
    from engine.runtime.installs import DeviceInstall

    model, _, _ = load_reference(MODEL)
    host, dev = (
        plan(model, parse_size("7MB"), 8, InplaceInstall, 64),
        plan(model, parse_size("7MB"), 8, DeviceInstall, 64),
    )
    assert dev.area == 2 * host.area == 2 * host.experts * host.expert_bytes
    assert dev.slots < host.slots and "many-rows area" in dev.describe() and dev.install == "device"
    with pytest.raises(ValueError, match=r"the many-rows area .* for the device install"):
        plan(model, parse_size("5MB"), 8, DeviceInstall, 64)
