"""What each sampler option may be, in one place: its type and its range, checked alike for the
command line (`generate`), a server request's fields (`serve`) and the harness, before anything
reaches MLX. A value out of range is an error naming the option (or field) and what it may be.

The ranges are mlx-lm's sampler's own where it has them, and where a value would be accepted but
mean nothing (a NaN or infinite temperature, `top_p` 0, which mlx-lm reads as "off" though 1 is
off, a penalty of 0 or infinity, a `top_k` beyond the vocabulary, a token id outside it), it is
refused here instead: mlx-lm's sampler double-frees on a `logit_bias` token id outside the
vocabulary, killing the server."""

import argparse
import math
from dataclasses import dataclass

SEED_MAX = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit seed


class SamplingError(ValueError):
    """A sampler option or request field out of its range; the message names it."""


@dataclass(frozen=True)
class Range:
    """One option: the request field, the command-line flag, integer or real, its ends (`low`,
    `high`; None: unbounded, "vocab"/"context": the model's), whether `low` itself is excluded,
    and what its values mean at their ends."""

    field: str
    flag: str | None
    integer: bool
    low: float | str | None = None
    high: float | str | None = None
    low_open: bool = False
    note: str = ""

    def bounds(self, limits: dict) -> tuple:
        lo, hi = (limits.get(b) if isinstance(b, str) else b for b in (self.low, self.high))
        return lo, hi

    def describe(self, limits: dict | None = None) -> str:
        lo, hi = self.bounds(limits or {})
        kind = "an integer" if self.integer else "a finite number"
        left = "" if lo is None else (f"> {lo:g}" if self.low_open else f">= {lo:g}")
        model = f" (the model's {self.high})" if isinstance(self.high, str) else ""
        right = "" if hi is None else f"<= {hi:g}{model}"
        span = " and ".join(p for p in (left, right) if p)
        return f"{kind}{' ' + span if span else ''}" + (f" ({self.note})" if self.note else "")

    def check(self, value, where: str, limits: dict | None = None):
        """`value` as this option's type, or SamplingError naming `where` and what it may be."""
        lo, hi = self.bounds(limits or {})
        fine = not isinstance(value, bool) and isinstance(value, int if self.integer else (int, float))
        if fine and not self.integer:
            fine = math.isfinite(value)
        if fine and lo is not None:
            fine = value > lo if self.low_open else value >= lo
        if fine and hi is not None:
            fine = value <= hi
        if not fine:
            raise SamplingError(f"{where} {value!r}: must be {self.describe(limits)}")
        return int(value) if self.integer else float(value)


RANGES = {
    r.field: r
    for r in (
        Range("temperature", "--temp", False, 0.0, note="0: greedy"),
        Range("top_p", "--top-p", False, 0.0, 1.0, low_open=True, note="1: off"),
        Range("min_p", "--min-p", False, 0.0, 1.0, note="0: off"),
        Range("top_k", "--top-k", True, 0, "vocab", note="0: off"),
        Range("repetition_penalty", "--repetition-penalty", False, 0.0, low_open=True, note="1: none"),
        Range("repetition_context_size", None, True, 0, "context"),
        Range("presence_penalty", None, False),
        Range("presence_context_size", None, True, 0, "context"),
        Range("frequency_penalty", None, False),
        Range("frequency_context_size", None, True, 0, "context"),
        Range("xtc_probability", None, False, 0.0, 1.0),
        Range("xtc_threshold", None, False, 0.0, 1.0),
        Range("max_tokens", "--max-tokens", True, 1, "context"),
        Range("seed", "--seed", True, 0, SEED_MAX),
    )
}
# request fields that name another's range (OpenAI's newer name)
ALIASES = {"max_completion_tokens": "max_tokens"}


def check_logit_bias(bias, limits: dict) -> dict:
    """`logit_bias`: an object of token ids (within the vocabulary) to finite numbers."""
    if not isinstance(bias, dict):
        raise SamplingError(f"logit_bias: must be an object of token ids to numbers, not {type(bias).__name__}")
    vocab, out = limits.get("vocab"), {}
    for k, v in bias.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise SamplingError(f"logit_bias: key {k!r} is not a token id") from None
        if token < 0 or (vocab is not None and token >= vocab):
            raise SamplingError(f"logit_bias: token id {token} is outside the vocabulary (0..{(vocab or 1) - 1})")
        out[token] = Range("logit_bias", None, False).check(v, f"logit_bias[{k}]")
    return out


def check_stop(stop):
    """`stop`: a string or a list of strings."""
    if stop is None or isinstance(stop, str):
        return stop
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise SamplingError("stop: must be a string or a list of strings")


def check_request(body: dict, limits: dict) -> None:
    """Every sampler field a request gives, against its range (`limits`: the model's `vocab` and
    `context`); raises SamplingError naming the first one out of range."""
    for field, value in body.items():
        name = ALIASES.get(field, field)
        if name in RANGES and value is not None:
            RANGES[name].check(value, field, limits)
    if body.get("logit_bias") is not None:
        check_logit_bias(body["logit_bias"], limits)
    check_stop(body.get("stop"))


def arg_type(field: str):
    """An argparse type for the option of `field`: its value parsed and checked against what holds
    for every model (the model's own ends, its vocabulary and context, are checked once it is
    known: generate.check_sampling)."""
    rng = RANGES[field]

    def parse(text: str):
        try:
            return rng.check(int(text) if rng.integer else float(text), "")
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rng.describe()}, not {text!r}") from None

    parse.__name__ = field
    return parse
