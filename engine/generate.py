"""Text generation through mlx-lm's own `stream_generate` on an engine model: its samplers
(temperature, top-p, min-p, top-k), its logits processors (repetition penalty), the tokenizer's
chat template when the model has one. At temperature 0 the tokens are plain mlx-lm's."""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from .api import check_context
from .models import registry
from .runtime.loop import MemoryWatch
from .sampling import RANGES


@dataclass
class Sampling:
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    repetition_penalty: float | None = None
    seed: int | None = None


FLAGS = dict(temperature="temp", top_p="top_p", min_p="min_p", top_k="top_k",
             repetition_penalty="repetition_penalty", seed="seed")  # fmt: skip


def check_sampling(sampling: Sampling, max_tokens: int, limits: dict):
    """The options against their ranges and the model's ends (`limits`: its vocabulary and
    context, engine.sampling), each named by its flag."""
    for field, attr in FLAGS.items():
        value = getattr(sampling, attr)
        if value is not None:
            RANGES[field].check(value, RANGES[field].flag, limits)
    RANGES["max_tokens"].check(max_tokens, "--max-tokens", limits)


def prompt_text(tokenizer, prompt: str, chat: bool | None = None) -> str:
    """The prompt as the model expects it: through the tokenizer's chat template when it has one
    (or when `chat` says so), as given otherwise."""
    template = getattr(tokenizer, "chat_template", None)
    if chat is None:
        chat = template is not None
    if not chat:
        return prompt
    if template is None:
        raise ValueError("--chat: this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )


def stream(eng, prompt: str, max_tokens: int = 256, sampling: Sampling | None = None, chat: bool | None = None):
    """Yield mlx-lm's GenerationResponse objects (text pieces, tokens, speeds) as they come."""
    sampling = sampling or Sampling()
    check_sampling(sampling, max_tokens, registry.limits_of(eng.spec["id"]))
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    text = prompt_text(eng.tokenizer, prompt, chat)
    if not text:
        raise ValueError("the prompt is empty: give some text")
    # as stream_generate encodes it: a prompt past the context is refused by name, as decode does
    tok = eng.tokenizer
    special = tok.bos_token is None or not text.startswith(tok.bos_token)
    check_context(eng.spec["id"], len(tok.encode(text, add_special_tokens=special)), max_tokens, "--max-tokens")
    sampler = make_sampler(sampling.temp, sampling.top_p, sampling.min_p, top_k=sampling.top_k)
    processors = make_logits_processors(repetition_penalty=sampling.repetition_penalty)
    yield from stream_generate(eng.model, eng.tokenizer, text, max_tokens=max_tokens, sampler=sampler,
                               logits_processors=processors)  # fmt: skip


def generate(eng, prompt: str, max_tokens: int = 256, sampling: Sampling | None = None, chat: bool | None = None):
    """The whole text, and figures: tokens/s, the expert cache's hit rate, peak memory."""
    watch = MemoryWatch()
    before = eng.counters()
    pieces, last = [], None
    for r in stream(eng, prompt, max_tokens, sampling, chat):
        pieces.append(r.text)
        last = r
    return "".join(pieces), figures(eng, last, before, watch)


def figures(eng, last, before: dict, watch: MemoryWatch) -> dict:
    now = eng.counters()
    hits, misses = now["hits"] - before["hits"], now["misses"] - before["misses"]
    out = dict(
        tokens=last.generation_tokens if last else 0,
        tok_s=last.generation_tps if last else 0.0,
        prompt_tok_s=last.prompt_tps if last else 0.0,
        hit_rate=hits / (hits + misses) if hits + misses else None,
        misses=misses,
        slots=eng.slots,
        experts=eng.num_experts,
    )
    out.update(watch.peaks())
    return out
