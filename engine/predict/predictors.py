"""Predictors of the experts layer l+d will route to, asked at layer l's host synchronisation.

Fitted on traces of *fit* prompts, scored on traces of held-out *eval* prompts:
- `none`: predicts nothing (demand loading);
- `popularity`: the layer's most popular experts in the fit traces;
- `previous`: the experts the target layer used for the previous token;
- `transition`: counts of expert i at layer l and expert j at layer l+d in the same token
  (O(T L K^2) to fit), summed over this token's experts at layer l;
- `probe`: one multi-label logistic regression per layer on the hidden state at layer l's
  MoE input, trained with NumPy (or MLX on a GPU); while decoding, its scores are computed on
  the device and come back with the router's indices (`Probe.device_scores`);
- `oracle`: reads the trace of the very run (the upper bound).

Depth wraps: from layer l, depth d targets layer (l + d) mod L of token t + (l + d) div L, so
the last layers of a token prefetch the first layers of the next.

The fitted predictors also estimate each expert's probability of being used (`prob`), so a
confidence floor `min_prob` can drop the unsure part of the top-`size` set: where a wasted
prefetch costs a full install (a GPU's managed-memory path), fewer and surer reads can beat
more and likelier-wasted ones. At `min_prob` 0 the prediction is the plain top-`size` set.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import resources_dir
from ..device import device_indices, kind

NAMES = ("none", "popularity", "previous", "transition", "probe", "oracle")
FITTED = ("popularity", "transition", "probe")


@dataclass
class Context:
    """What a predictor may look at when layer `layer` of the token at `position` syncs."""

    position: int
    layer: int
    target: int  # the layer whose experts are predicted
    offset: int  # 0: this token; 1: the next token
    experts: np.ndarray  # this token's experts at `layer`
    hidden: np.ndarray | None  # this token's MoE input at `layer` (float32), where a trace has it
    history: list  # per layer, the most recent expert set seen there (or None)
    scores: np.ndarray | None = None  # the predictor's own scores, computed on the device


@dataclass
class DeviceContext:
    """What a predictor may look at on the device when layer `layer` of the token at `position`
    decodes with the `device` install (nothing is read back): its MoE input `x` and router indices
    `inds` as the layer has them, each layer's indices at the last decode step (`last`), and
    `memo`, where the predictor keeps the device arrays it makes for this engine."""

    position: int
    layer: int
    target: int
    offset: int
    x: mx.array
    inds: mx.array
    last: list
    memo: dict
    num_layers: int
    num_experts: int


def target_of(layer: int, depth: int, num_layers: int):
    return (layer + depth) % num_layers, (layer + depth) // num_layers


def _top(scores: np.ndarray, m: int, tiebreak: np.ndarray | None = None) -> np.ndarray:
    """The m highest-scoring experts; ties go to `tiebreak` (e.g. popularity), then index."""
    key = (-scores, -tiebreak if tiebreak is not None else np.zeros_like(scores), np.arange(len(scores)))
    return np.lexsort(key[::-1])[:m]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp overflow is a sigmoid of exactly 0: right
        return 1.0 / (1.0 + np.exp(-x))


class Predictor:
    name = "base"
    # A predictor that scores on the device (`device_scores`) while decoding: its scores come back
    # in the synchronisation that brings the router's indices, as `Context.scores`.
    scores_on_device = False
    demand_only = False  # predicts nothing: the engine loads on demand

    def __init__(self, depth: int = 1, size: int = 8, min_prob: float = 0.0):
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must lie in [0, 1], not {min_prob}")
        self.depth, self.size, self.min_prob = depth, size, min_prob

    def _sure(self, top: np.ndarray, prob) -> np.ndarray:
        """The experts of `top` whose estimated probability reaches `min_prob` (order kept).
        `prob()` gives the estimates; it is called only under a floor, off the plain decode path."""
        if self.min_prob <= 0:
            return top
        return top[prob()[top] >= self.min_prob]

    def fit(self, trace):
        return self

    def bind(self, experts: np.ndarray):
        """The (T, L, K) expert sets of the run about to decode, for a predictor that reads them."""
        return self

    def predict(self, ctx: Context) -> np.ndarray:
        raise NotImplementedError

    def device_predict(self, ctx: DeviceContext) -> mx.array | None:
        """Layer `ctx.target`'s predicted experts on the device, lazily, (m,) int32 with -1 for
        dropped ones (shapes stay static); None: nothing to predict. The `device` install asks this."""
        raise ValueError(f"predictor {self.name!r} has no device-side prediction")

    def device_prepare(self, memo: dict):
        """Make, and evaluate, what device_predict will need before a decode starts."""

    def _floor_on_device(self, top: mx.array, prob: mx.array) -> mx.array:
        """`top` with the experts below `min_prob` (by `prob`, the estimates of every expert) as -1."""
        return mx.where(prob[top] >= self.min_prob, top, -1) if self.min_prob > 0 else top

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict):
        pass


class NoPredictor(Predictor):
    name = "none"
    demand_only = True

    def predict(self, ctx):
        return np.zeros(0, np.int64)


class Popularity(Predictor):
    name = "popularity"

    def fit(self, trace):
        L, E = trace.num_layers, trace.num_experts
        self.counts = np.zeros((L, E), np.int64)
        for l in range(L):
            np.add.at(self.counts[l], trace.experts[:, l].reshape(-1), 1)
        self.top_k = trace.experts.shape[-1]
        return self

    def prob(self, ctx):
        """The share of the fit tokens that routed to each expert at the target layer."""
        c = self.counts[ctx.target].astype(float)
        return c / max(1.0, c.sum() / self.top_k)  # the layer's counts sum to tokens x top_k

    def predict(self, ctx):
        return self._sure(_top(self.counts[ctx.target].astype(float), self.size), lambda: self.prob(ctx))

    def device_predict(self, ctx):
        key = ("popularity", ctx.target)
        if key not in ctx.memo:  # a constant per target layer
            host = Context(0, ctx.layer, ctx.target, ctx.offset, np.zeros(0, np.int64), None, [None] * ctx.num_layers)
            ctx.memo[key] = device_indices(self.predict(host), np.int32)
        return ctx.memo[key]

    def state(self):
        return {"counts": self.counts, "top_k": np.int64(self.top_k)}

    def load_state(self, state):
        self.counts, self.top_k = state["counts"], int(state["top_k"])


class Previous(Predictor):
    name = "previous"

    def predict(self, ctx):
        last = ctx.history[ctx.target]
        return np.zeros(0, np.int64) if last is None else np.asarray(last)[: self.size]

    def device_predict(self, ctx):
        last = ctx.last[ctx.target]  # the target layer's experts at the last decode step
        return None if last is None else last.reshape(-1)[: self.size]


def pairs(trace, layer: int, depth: int):
    """Row indices (source, target) of one (layer, depth) pair, within each prompt."""
    tgt, off = target_of(layer, depth, trace.num_layers)
    src_rows, tgt_rows = [], []
    for s in trace.sequences():
        idx = np.arange(s.start, s.stop - off)
        src_rows.append(idx)
        tgt_rows.append(idx + off)
    return np.concatenate(src_rows), np.concatenate(tgt_rows), tgt


class Transition(Predictor):
    name = "transition"

    def fit(self, trace):
        L, E = trace.num_layers, trace.num_experts
        self.counts = np.zeros((L, E, E), np.int64)
        self.popularity = Popularity().fit(trace).counts
        for l in range(L):
            src, dst, tgt = pairs(trace, l, self.depth)
            a = trace.experts[src, l].astype(np.int64)  # (N, K)
            b = trace.experts[dst, tgt].astype(np.int64)  # (N, K)
            # every (i, j) of a token's K x K pairs: O(T L K^2)
            np.add.at(self.counts[l], (a[:, :, None], b[:, None, :]), 1)
        self.top_k = trace.experts.shape[-1]
        return self

    def prob(self, ctx):
        """Of the fit tokens that routed to this token's experts at layer l, the share whose
        target layer used each expert: sum_i c_ij / sum_i n_i over this token's experts i, where
        n_i = sum_j c_ij / top_k (each of them was followed by top_k experts)."""
        rows = self.counts[ctx.layer][np.asarray(ctx.experts, np.int64)]
        return rows.sum(0) / max(1.0, rows.sum() / self.top_k)

    def predict(self, ctx):
        scores = self.counts[ctx.layer][np.asarray(ctx.experts, np.int64)].sum(0).astype(float)
        top = _top(scores, self.size, self.popularity[ctx.target].astype(float))
        return self._sure(top, lambda: self.prob(ctx))

    def device_predict(self, ctx):
        memo, E = ctx.memo, ctx.num_experts
        if ("counts", ctx.layer) not in memo:
            memo["counts", ctx.layer] = mx.array(self.counts[ctx.layer].astype(np.int32))
        if ("popularity", ctx.target) not in memo:
            memo["popularity", ctx.target] = mx.array(self.popularity[ctx.target].astype(np.int64))
        rows = memo["counts", ctx.layer][ctx.inds.reshape(-1).astype(mx.int32)]  # (K, E)
        scores = rows.sum(0).astype(mx.int64)
        pop = memo["popularity", ctx.target]
        # `_top`'s order (score, then popularity, then the lower index) as one integer key
        key = (scores * (pop.max() + 1) + pop) * E + (E - 1 - mx.arange(E, dtype=mx.int64))
        top = mx.argsort(-key)[: self.size].astype(mx.int32)
        if self.min_prob <= 0:
            return top
        return self._floor_on_device(
            top, scores.astype(mx.float32) / mx.maximum(1.0, rows.sum().astype(mx.float32) / self.top_k)
        )

    def state(self):
        return {"counts": self.counts, "popularity": self.popularity, "top_k": np.int64(self.top_k)}

    def load_state(self, state):
        self.counts, self.popularity, self.top_k = state["counts"], state["popularity"], int(state["top_k"])


class Probe(Predictor):
    """Per layer l, sigmoid(W h + b) over the experts of layer l+d (multi-label, BCE, Adam).

    Offline (traces) it scores on the host from the trace's MoE input; while decoding, on the
    device (`device_scores`), so that only its E scores come back, with the router's indices,
    rather than the D-wide MoE input to a host matrix product. The two agree to float32 rounding
    (tests/test_prefetch.py pins that they pick the same experts)."""

    name = "probe"
    scores_on_device = True
    steps, lr, l2 = 300, 0.05, 1e-4
    _device = None  # per layer, the state as MLX arrays (made at the first device_scores)
    backend = None  # numpy or mlx; None: by device (see _logistic)

    def fit(self, trace, seed: int = 0):
        L, E, D = trace.num_layers, trace.num_experts, trace.hidden.shape[-1]
        self.mean = np.zeros((L, D), np.float32)
        self.std = np.ones((L, D), np.float32)
        self.W = np.zeros((L, D, E), np.float32)
        self.b = np.zeros((L, E), np.float32)
        for l in range(L):
            src, dst, tgt = pairs(trace, l, self.depth)
            X = trace.hidden[src, l].astype(np.float32)
            Y = np.zeros((len(dst), E), np.float32)
            np.put_along_axis(Y, trace.experts[dst, tgt].astype(np.int64), 1.0, axis=1)
            self.mean[l], self.std[l] = X.mean(0), X.std(0) + 1e-6
            X = (X - self.mean[l]) / self.std[l]
            self.W[l], self.b[l] = _logistic(X, Y, self.steps, self.lr, self.l2, self.backend)
        self._device = None
        return self

    def scores(self, layer, hidden):
        x = (np.asarray(hidden, np.float32) - self.mean[layer]) / self.std[layer]
        return x @ self.W[layer] + self.b[layer]

    def device_scores(self, layer: int, x: mx.array) -> mx.array:
        """`scores` of the MoE input row `x` (any float dtype) as a lazy float32 MLX array, on
        MLX's default device: nothing is evaluated here."""
        if self._device is None:
            self._device = [
                tuple(mx.array(a[l]) for a in (self.mean, self.std, self.W, self.b)) for l in range(len(self.W))
            ]
        return _probe_scores(x, *self._device[layer])

    def device_predict(self, ctx):
        scores = self.device_scores(ctx.layer, ctx.x.reshape(-1, ctx.x.shape[-1])[-1])
        top = mx.argsort(-scores)[: self.size].astype(mx.int32)
        return self._floor_on_device(top, mx.sigmoid(scores)) if self.min_prob > 0 else top

    def _scores_of(self, ctx):
        return ctx.scores if ctx.scores is not None else self.scores(ctx.layer, ctx.hidden)

    def prob(self, ctx):
        return _sigmoid(self._scores_of(ctx))

    def predict(self, ctx):
        scores = self._scores_of(ctx)
        return self._sure(_top(scores, self.size), lambda: _sigmoid(scores))

    def state(self):
        return {"mean": self.mean, "std": self.std, "W": self.W, "b": self.b}

    def load_state(self, state):
        self.mean, self.std, self.W, self.b = state["mean"], state["std"], state["W"], state["b"]
        self._device = None


@mx.compile
def _probe_scores(x, mean, std, W, b):
    # compiled: the normalisation is one fused kernel ahead of the product
    return ((x.astype(mx.float32) - mean) / std) @ W + b


def _logistic(X, Y, steps, lr, l2, backend: str | None = None):
    """Full-batch Adam on the mean binary cross-entropy; deterministic (zero init) per backend.

    `numpy` on the CPU, where its BLAS is the faster one; `mlx` on a GPU, where a full-size NumPy
    probe took minutes on the host (docs/gpu.md has both measurements).
    Default: by the device MLX computes on."""
    if backend is None:
        backend = "mlx" if kind() == "gpu" else "numpy"
    if backend not in ("numpy", "mlx"):
        raise ValueError(f"unknown logistic backend {backend!r}")
    return (_logistic_mlx if backend == "mlx" else _logistic_numpy)(X, Y, steps, lr, l2)


_ADAM = (0.9, 0.999, 1e-8)


def _logistic_numpy(X, Y, steps, lr, l2):
    n, d = X.shape
    W, b = np.zeros((d, Y.shape[1]), np.float32), np.zeros(Y.shape[1], np.float32)
    m = [np.zeros_like(W), np.zeros_like(b)]
    v = [np.zeros_like(W), np.zeros_like(b)]
    b1, b2, eps = _ADAM
    for t in range(1, steps + 1):
        g = (_sigmoid(X @ W + b) - Y) / n
        grads = [X.T @ g + l2 * W, g.sum(0)]
        for i, (param, grad) in enumerate(zip((W, b), grads)):
            m[i] = b1 * m[i] + (1 - b1) * grad
            v[i] = b2 * v[i] + (1 - b2) * grad * grad
            param -= lr * (m[i] / (1 - b1**t)) / (np.sqrt(v[i] / (1 - b2**t)) + eps)
    return W, b


def _logistic_mlx(X, Y, steps, lr, l2):
    X, Y = mx.array(X, mx.float32), mx.array(Y, mx.float32)
    n = X.shape[0]
    b1, b2, eps = _ADAM

    @mx.compile
    def step(W, b, mW, mb, vW, vb, c1, c2):
        g = (mx.sigmoid(X @ W + b) - Y) / n
        new = []
        for param, grad, m, v in ((W, X.T @ g + l2 * W, mW, vW), (b, g.sum(0), mb, vb)):
            m = b1 * m + (1 - b1) * grad
            v = b2 * v + (1 - b2) * grad * grad
            new.append((param - lr * (m / c1) / (mx.sqrt(v / c2) + eps), m, v))
        (W, mW, vW), (b, mb, vb) = new
        return W, b, mW, mb, vW, vb

    state = (mx.zeros((X.shape[1], Y.shape[1])), mx.zeros((Y.shape[1],))) * 3
    for t in range(1, steps + 1):
        state = step(*state, mx.array(1 - b1**t), mx.array(1 - b2**t))
        mx.eval(state)
    return np.array(state[0]), np.array(state[1])


class Oracle(Predictor):
    """Reads the trace of the very run: exact for the decode it was recorded from."""

    name = "oracle"

    def bind(self, experts: np.ndarray):
        """The (T, L, K) expert sets of the run to predict, in token order."""
        self.sets = experts
        return self

    def predict(self, ctx):
        t = ctx.position + ctx.offset
        if t >= len(self.sets):
            return np.zeros(0, np.int64)
        return self.sets[t, ctx.target].astype(np.int64)[: self.size]

    def device_predict(self, ctx):
        t = ctx.position + ctx.offset
        if t >= len(self.sets):
            return None
        return self.device_prepare(ctx.memo)[t][ctx.target]

    def device_prepare(self, memo):
        """The bound trace's predictions on the device, uploaded once per binding and evaluated
        there as one row a token and layer: a token's prediction is then an array already made,
        not an operation of its graph (the engine prepares them when the trace is bound, so that
        no decode token waits for them)."""
        bound = memo.get("oracle")
        if bound is None or bound[0] is not self.sets:  # held here, so never another array at the same address
            trace = device_indices(self.sets[:, :, : self.size], np.int32)
            rows = [[trace[t, layer] for layer in range(trace.shape[1])] for t in range(len(self.sets))]
            mx.eval(rows)
            memo["oracle"] = bound = (self.sets, rows)
        return bound[1]


CLASSES = {c.name: c for c in (NoPredictor, Popularity, Previous, Transition, Probe, Oracle)}


def make(name: str, depth: int = 1, size: int = 8, min_prob: float = 0.0) -> Predictor:
    if name not in CLASSES:
        raise ValueError(f"unknown predictor {name!r}; choose from {', '.join(NAMES)}")
    if min_prob > 0 and name not in FITTED:
        raise ValueError(f"min_prob applies to the fitted predictors ({', '.join(FITTED)}), not to {name!r}")
    return CLASSES[name](depth=depth, size=size, min_prob=min_prob)


def fitted_path(model_id: str, prompt_set: str, name: str, depth: int, size: int, tokens: int) -> Path:
    """Where a predictor fitted on `prompt_set`'s fit traces of `tokens` decode tokens lives."""
    return resources_dir() / "predictors" / model_id / f"{prompt_set}-{name}-d{depth}-m{size}-t{tokens}.npz"


# Bumped whenever a fitted predictor's saved state changes (2: the fit's top_k, for `prob`), so an
# older saved fit is refitted rather than misread.
FORMAT = 2


def save(pred: Predictor, path, meta: dict):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **pred.state())
    meta = dict(meta, name=pred.name, depth=pred.depth, size=pred.size, format=FORMAT)
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1))


def sidecar(path) -> dict:
    """What a saved predictor was fitted on ({} if there is no readable sidecar)."""
    try:
        return json.loads(Path(path).with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}


def load(path) -> Predictor:
    """A saved predictor; its sidecar (what it was fitted on) is `pred.meta`."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no fitted predictor (fit it with `python -m engine fit`)")
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        pred = make(meta["name"], meta["depth"], meta["size"])
        with np.load(path) as z:
            pred.load_state({k: z[k] for k in z.files})
        pred.meta = meta
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: malformed fitted predictor ({e})") from None
    return pred


# -- offline evaluation on traces -------------------------------------------------------------


def contexts(trace, depth: int):
    """Every (context, actual target set) of a trace at one depth, in token order."""
    L = trace.num_layers
    for s in trace.sequences():
        T = s.stop - s.start
        for t in range(T):
            for l in range(L):
                tgt, off = target_of(l, depth, L)
                if t + off >= T:
                    continue
                hist = [trace.experts[s.start + t + off - 1, j] if t + off >= 1 else None for j in range(L)]
                ctx = Context(t, l, tgt, off, trace.experts[s.start + t, l], trace.hidden[s.start + t, l], hist)
                yield s, ctx, trace.experts[s.start + t + off, tgt]


def quality(pred: Predictor, trace) -> dict:
    """Mean precision and recall at the predicted set size over a trace and, for a predictor that
    estimates probabilities, `estimate`: their mean over the predicted experts, which a calibrated
    predictor makes equal to the share of them used (micro precision)."""
    prec, rec, est = [], [], []
    used = predicted = 0
    current = None
    for s, ctx, actual in contexts(trace, pred.depth):
        if isinstance(pred, Oracle) and current != s.start:
            pred.bind(trace.experts[s])
            current = s.start
        top = pred.predict(ctx)
        p = set(top.tolist())
        a = set(actual.tolist())
        hit = len(p & a)
        if p:  # an empty prediction has no precision
            prec.append(hit / len(p))
        rec.append(hit / len(a))
        used, predicted = used + hit, predicted + len(p)
        if hasattr(pred, "prob") and len(top):
            est.extend(pred.prob(ctx)[top].tolist())
    nan = float("nan")
    return dict(
        precision=float(np.mean(prec)) if prec else nan,
        recall=float(np.mean(rec)),
        n=len(rec),
        estimate=float(np.mean(est)) if est else None,
        used_share=used / predicted if predicted else nan,
    )
