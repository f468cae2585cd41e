"""Where two runs of plain mlx-lm first part ways: every module's output of a greedy decode and of a
teacher-forced one on the same tokens, in call order, compared (each output evaluated as it is made).
Usage: python scripts/first_difference.py MODEL"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine.models import registry  # noqa: E402
from engine.runtime.loop import decode  # noqa: E402

PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"
model, tok, _ = registry.load_reference(sys.argv[1])
log = []


def hook(name, m):
    cls = type(m)

    def call(self, *a, **k):
        out = cls.__call__(self, *a, **k)
        outs = out if isinstance(out, tuple) else (out,)
        log.append((name, [np.array(o.astype(mx.float32)) if isinstance(o, mx.array) else None for o in outs]))
        return out

    m.__class__ = type(cls.__name__, (cls,), {"__call__": call})


for name, m in model.named_modules():
    if name:
        hook(name, m)
ids = tok.encode(PROMPT)
tokens, _, _ = decode(model, ids, 6)
first, log = log, []
decode(model, ids, 6, forced=tokens)
for i, ((n1, a), (_, b)) in enumerate(zip(first, log)):
    for x, y in zip(a, b):
        if x is not None and (x.shape != y.shape or not np.array_equal(x, y, equal_nan=True)):
            d = np.abs(x - y) if x.shape == y.shape else None
            worst = np.nanmax(d) if d is not None else "shape"
            print(f"call {i} {n1}: differs, max {worst}; NaN {np.isnan(x).any()} {np.isnan(y).any()}")
            print([n for n, _ in first[max(0, i - 8) : i + 1]])
            sys.exit(0)
print("no difference in", len(first), "module calls")
