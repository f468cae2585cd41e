"""Every numeric option of `decode`, `generate`, `serve`, `fit`, `trace` and `harness bench` is
refused up front when the model cannot take it, naming the option: before anything is built,
traced, fitted, loaded, served or measured. The commands run here with their actions replaced by
nothing, so what is checked is exactly what runs before the action."""

import contextlib
import io
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import harness.__main__ as harness_main
from engine import cli, sampling
from harness import bench

MODEL = "olmoe-tiny"  # 64 experts, top-8, 4 layers, a context of 4096 positions, 1024 tokens
CONTEXT, VOCAB = 4096, 1024
INF = math.inf
TINY = 5e-324  # the least float above 0: an option whose 0 is excluded

# (command line before the option, option, lowest and highest value allowed, integer-valued)
OPTIONS = [
    (["decode", "--model", MODEL], "--slots", 8, 64, True),
    (["decode", "--model", MODEL], "--readers", 1, 256, True),
    (["decode", "--model", MODEL, "--predictor", "transition"], "--depth", 1, 4, True),
    (["decode", "--model", MODEL, "--predictor", "transition"], "--predict-size", 1, 64, True),
    (["decode", "--model", MODEL], "--min-prob", 0, 1, False),
    (["decode", "--model", MODEL], "--tokens", 0, CONTEXT - 1, True),
    (["decode", "--model", MODEL, "--memory", "1GB"], "--context", 1, INF, True),
    (["generate", "--model", MODEL], "--max-tokens", 1, CONTEXT - 1, True),
    (["generate", "--model", MODEL], "--temp", 0, INF, False),
    (["generate", "--model", MODEL], "--top-p", TINY, 1, False),  # 0 is refused: 1 is off
    (["generate", "--model", MODEL], "--min-p", 0, 1, False),
    (["generate", "--model", MODEL], "--top-k", 0, VOCAB, True),
    (["generate", "--model", MODEL], "--repetition-penalty", TINY, INF, False),
    (["generate", "--model", MODEL], "--seed", 0, 2**64 - 1, True),
    (["serve", "--model", MODEL], "--queue", 1, INF, True),
    (["serve", "--model", MODEL], "--request-timeout", 1e-9, 1e300, False),
    (["serve", "--model", MODEL], "--slots", 8, 64, True),
    (["fit", "--model", MODEL], "--depth", 1, 4, True),
    (["fit", "--model", MODEL], "--size", 1, 64, True),
    (["fit", "--model", MODEL], "--tokens", 0, CONTEXT - 1, True),
    (["trace", "--model", MODEL], "--tokens", 0, CONTEXT - 1, True),
    (["trace", "--model", MODEL], "--limit", 1, INF, True),
    (["bench", "throughput", "--model", MODEL], "--slots", 8, 64, True),
    (["bench", "throughput", "--model", MODEL], "--tokens", 1, CONTEXT - 1, True),
    (["bench", "throughput", "--model", MODEL], "--repeats", 1, 1000, True),
    (["bench", "serve", "--model", MODEL], "--clients", 1, 256, True),
    (["bench", "batch", "--model", MODEL], "--batches", 1, 256, True),
    (["bench", "prefetch", "--model", MODEL], "--depths", 1, 4, True),
]
VALUES = ["0", "-1", "1e20", "99999999999999999999", "abc", "", "nan", "inf", "2.5"]


def checked(argv, actions=False) -> tuple[int, str]:
    """(exit status, stderr) of the command line `argv`, its action replaced by nothing unless
    `actions`; the environment is left as it was (`--models` sets TITAN_MODELS)."""
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        mp.setenv("TITAN_MODELS", "")  # recorded as it was (absent, mostly), so restored so, whatever main sets
        mp.delenv("TITAN_MODELS")
        for name in dir(cli) if not actions else ():
            if name.startswith("cmd_"):
                mp.setattr(cli, name, lambda *a: None)
        for name in ("throughput", "miss", "install", "prefetch_bench", "serve") if not actions else ():
            mp.setattr(bench, name, lambda a: {})
        for name in ("prefill", "batch") if not actions else ():
            mp.setattr(bench.manyrows, name, lambda a: {})
        try:
            (harness_main.main if argv[0] == "bench" else cli.main)(argv)
        except SystemExit as e:
            return e.code or 0, err.getvalue()
    return 0, err.getvalue()


def allowed(value: str, low, high, integer: bool) -> bool:
    try:
        x = int(value) if integer else float(value)
    except ValueError:
        return False
    return math.isfinite(x) and low <= x <= high  # no option takes NaN or infinity


@pytest.mark.parametrize("head,option,low,high,integer", OPTIONS, ids=[f"{h[0]}{o}" for h, o, *_ in OPTIONS])
def test_every_value_is_taken_or_refused_naming_the_option(head, option, low, high, integer):
    edges = [str(v) for v in (low - 1, low, high, high + 1) if v not in (INF, -INF)]
    for value in VALUES + edges:
        status, err = checked([*head, option, value])
        if allowed(value, low, high, integer):
            assert status == 0, (option, value, err)
        else:
            assert status == 2 and option in err, (option, value, err)
        assert "Traceback" not in err


@settings(max_examples=40, deadline=None)
@given(slots=st.integers(-(10**30), 10**30), depth=st.integers(-(10**30), 10**30))
def test_slots_and_depth_are_taken_exactly_within_their_ranges(slots, depth):
    status, err = checked(["decode", "--model", MODEL, "--slots", str(slots), "--depth", str(depth)])
    ok = 8 <= slots <= 64 and 1 <= depth <= 4
    assert (status == 0) == ok, err
    if not ok:
        assert ("--slots" in err) or ("--depth" in err)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(-(10**30), 10**30), prob=st.floats(allow_nan=True, allow_infinity=True))
def test_tokens_and_probabilities_are_taken_exactly_within_their_ranges(tokens, prob):
    status, err = checked(["generate", "--model", MODEL, "--max-tokens", str(tokens), "--top-p", repr(prob)])
    ok = 1 <= tokens <= CONTEXT - 1 and 0 < prob <= 1
    assert (status == 0) == ok, err


def test_a_models_option_leaves_the_environment_as_it_was(tmp_path):
    before = os.environ.get("TITAN_MODELS")
    models = tmp_path / "models.yaml"
    models.write_text("models: {}\n")
    status, err = checked(["--models", str(models), "list"], actions=True)  # main sets TITAN_MODELS, then reads it
    assert status == 2 and f"{models}: field models" in err
    assert os.environ.get("TITAN_MODELS") == before


def test_the_files_an_option_names_are_refused_by_name(tmp_path):
    binary = tmp_path / "binary"
    binary.write_bytes(bytes(range(256)))
    for argv, says in [
        (["--models", str(tmp_path), "list"], f"--models: {tmp_path}: a directory, not a models file"),
        (["--models", str(binary), "list"], f"{binary}: not a models file (not UTF-8 text"),
        (["generate", "--model", MODEL, "--prompt-file", str(binary)], f"--prompt-file: {binary}: not UTF-8 text"),
        (["generate", "--model", MODEL, "--prompt-file", str(tmp_path)], f"--prompt-file: {tmp_path}: Is a directory"),
    ]:
        status, err = checked(argv, actions=True)
        assert status == 2 and says in err, err


# -- a request's sampler fields (engine.sampling: the server's and the command line's ranges) ------
JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(), st.text(max_size=3),
    st.lists(st.integers(), max_size=2), st.sampled_from([0, 1, -1, 0.0, 1.0, CONTEXT, VOCAB, VOCAB + 1, 2**64]),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(sorted(sampling.RANGES)), value=JSON_VALUES)
def test_a_request_field_is_taken_exactly_within_its_range_and_refused_by_name(field, value):
    """Taken iff it is a number of the field's kind (an integer where it must be one; never a bool,
    NaN or infinity) within the field's ends, the model's vocabulary and context included."""
    rng = sampling.RANGES[field]
    limits = {"vocab": VOCAB, "context": CONTEXT}
    ends = [limits[e] if isinstance(e, str) else e for e in (rng.low, rng.high)]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    fits = number and (isinstance(value, int) or (not rng.integer and math.isfinite(value)))
    if fits and ends[0] is not None:
        fits = value > ends[0] if rng.low_open else value >= ends[0]
    if fits and ends[1] is not None:
        fits = value <= ends[1]
    body = {field: value}
    if fits:
        sampling.check_request(body, limits)
    elif value is not None:  # an absent field (null) is the default, not a value
        with pytest.raises(sampling.SamplingError, match=f"^{field} "):
            sampling.check_request(body, limits)


@settings(max_examples=200, deadline=None)
@given(token=st.integers(min_value=-5, max_value=2 * VOCAB), bias=st.one_of(st.floats(), st.booleans(), st.text()))
def test_a_logit_bias_is_taken_for_token_ids_in_the_vocabulary_and_finite_numbers_only(token, bias):
    body = {"logit_bias": {str(token): bias}}
    fine = 0 <= token < VOCAB and isinstance(bias, float) and math.isfinite(bias)
    if fine:
        assert sampling.check_request(body, {"vocab": VOCAB}) is None
    else:
        with pytest.raises(sampling.SamplingError, match="^logit_bias"):
            sampling.check_request(body, {"vocab": VOCAB})
