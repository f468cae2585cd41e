"""Where a resident model's peak memory goes over a prompt (issue 49: on an H100, `bench families`
measured peaks above the `--memory` budgets their configurations were planned for).

mlx-lm's own model and `generate_step`, nothing of the engine: for each prompt length and each
prefill chunk (mlx-lm's `prefill_step_size`), a fresh KV cache, MLX's peak memory after the prompt
(its first token) and after `--tokens` more, each less the weights; beside them the figures a plan
counts (the KV cache for those tokens, its margin for activations) and two terms it does not: the
attention scores of one chunk where they are materialized (heads x chunk x prompt x 4 bytes, twice:
scores and their softmax) and the logits of the last position. A probe: no record; its lines say
what a plan would have to count.

`--bound-layers N`: a prompt's layer waits until the output of the layer N before it has been
computed (an evaluation), as the device install's many-rows calls do. A test of why a GPU's peak
is several layers' scores where the CPU's is one (docs/gpu.md, "Memory"): MLX's CUDA backend frees
a kernel's temporaries only once the CUDA graph that ran it has completed, and nothing bounds how
far the host queues a prompt's layers ahead of the device.

    python scripts/probe_peak.py MODEL [PROMPT_TOKENS ...] [--chunks 512,2048] [--tokens 8] [--bound-layers N]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from engine import memory  # noqa: E402
from engine.models.registry import load_reference  # noqa: E402


class Bounded(nn.Module):
    """A model layer whose call over more than one row first waits for the output `n` layers back."""

    def __init__(self, inner, outs: list, i: int, n: int):
        super().__init__()
        self.inner, self.outs, self.i, self.n = inner, outs, i, n

    def __call__(self, x, *args, **kwargs):
        if x.ndim == 3 and x.shape[1] > 1 and self.i >= self.n and self.outs[self.i - self.n] is not None:
            mx.eval(self.outs[self.i - self.n])
        y = self.inner(x, *args, **kwargs)
        self.outs[self.i] = y
        return y


def bound_layers(model, n: int):
    layers = model.layers  # mlx-lm's models hand back their own list
    outs = [None] * len(layers)
    for i in range(len(layers)):
        layers[i] = Bounded(layers[i], outs, i, n)
    assert all(isinstance(m, Bounded) for m in model.layers), "the model's layers are not one list"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("prompts", nargs="*", type=int, default=[16, 512, 2048], metavar="PROMPT_TOKENS")
    ap.add_argument("--chunks", default="512,2048", help="prefill chunks, comma-separated (default 512,2048)")
    ap.add_argument("--tokens", type=int, default=8, help="tokens decoded after the prompt (default 8)")
    ap.add_argument("--bound-layers", type=int, default=0, metavar="N",
                    help="a prompt's layer waits for the output N layers back (default 0: none)")  # fmt: skip
    a = ap.parse_args(argv)
    chunks = [int(c) for c in a.chunks.split(",")]
    model, tok, _ = load_reference(a.model)
    mx.eval(model.parameters())
    if a.bound_layers > 0:
        bound_layers(model, a.bound_layers)
    weights = memory.weight_bytes(model)
    vocab = memory._arg(model, "vocab_size") or 0
    heads = memory._arg(model, "num_attention_heads", "num_heads", "n_heads") or 1
    loaded = memory.fmt(mx.get_active_memory())
    bound = f", layers in flight bounded to {a.bound_layers}" if a.bound_layers else ""
    print(f"{a.model} on {mx.default_device()}{bound}: weights {memory.fmt(weights)}, {heads} attention heads, "
          f"vocabulary {vocab}; MLX active after loading {loaded}")  # fmt: skip
    print("prompt  chunk  | peak over weights: prompt  decode | plan: KV cache  margin | not planned: scores  logits")
    text = tok.encode("The quick brown fox jumps over the lazy dog, and then it runs far away. ")
    for n in a.prompts:
        ids = mx.array((text * (n // len(text) + 1))[:n])
        for chunk in sorted({min(c, n) for c in chunks}):  # a chunk past the prompt is the whole prompt
            cache = make_prompt_cache(model)
            mx.clear_cache()
            mx.reset_peak_memory()
            steps = generate_step(ids, model, max_tokens=a.tokens + 1, prompt_cache=cache, prefill_step_size=chunk)
            first, _ = next(steps)
            mx.eval(first)
            prompt_peak = mx.get_peak_memory()
            for _ in steps:
                pass
            peak = mx.get_peak_memory()
            kv = memory.kv_cache_bytes(model, n + a.tokens)
            margin = memory.resident_bytes(model, n + a.tokens) - weights - kv  # the plan's own
            scores = 2 * heads * chunk * n * 4
            logits = vocab * 4
            cells = [memory.fmt(x) for x in (prompt_peak - weights, peak - weights, kv, margin, scores, logits)]
            print(f"{n:6d} {chunk:6d}  | {cells[0]:>24s} {cells[1]:>8s} | {cells[2]:>14s} {cells[3]:>7s} | "
                  f"{cells[4]:>19s} {cells[5]:>7s}")  # fmt: skip
            del cache, steps
    return 0


if __name__ == "__main__":
    sys.exit(main())
