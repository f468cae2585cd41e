"""What the command lines (`python -m engine`, `python -m harness`) share: the argument types,
each an error naming what it wanted, and the errors a command reports as one line and exit 2
rather than a traceback."""

import argparse

from .api import SEED_MAX
from .device import CudaError
from .memory import parse_size
from .models.embedded import BuildError
from .models.registry import RegistryError
from .runtime.store import StoreError
from .tracing.trace import TraceError


def positive(value: str) -> int:
    n = _int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def at_most(high: int):
    """A positive integer of at most `high` (an option whose huge value would run until killed)."""

    def parse(value: str) -> int:
        n = positive(value)
        if n > high:
            raise argparse.ArgumentTypeError(f"must lie within 1..{high}, not {n}")
        return n

    parse.__name__ = f"at_most_{high}"
    return parse


def non_negative(value: str) -> int:
    n = _int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {n}")
    return n


def probability(value: str) -> float:
    q = _float(value)
    if not 0.0 <= q <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], not {q}")
    return q


def memory_size(value: str) -> int:
    try:
        n = parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, not {value!r}")
    return n


def seed(value: str) -> int:
    n = _int(value)
    if not 0 <= n <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must lie within 0..2**64-1, not {n}")
    return n


def seconds(value: str) -> float:
    x = _float(value)
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {value}")
    return x


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None


def non_negative_float(value: str) -> float:
    x = _float(value)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return x


ERRORS = (
    RegistryError,
    BuildError,
    StoreError,
    TraceError,
    CudaError,
    ValueError,
    FileNotFoundError,
)
