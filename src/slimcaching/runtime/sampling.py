"""How a served request picks its tokens and when it stops: temperature, nucleus (top-p) sampling
with its own seeded generator, end of sequence, stop strings, a token budget and cancellation.

:class:`Decoding` is shared by both ways a device generates (SlimCaching-style through
transformers' ``generate``, split-style through :func:`slimcaching.runtime.split.generate_split`),
so a request decodes the same whichever way its user is served. Temperature 0 is greedy: the
argmax of the model's logits, what ``generate(do_sample=False)`` picks.

Text is streamed as it becomes final: the detokenised text of all new tokens, less a trailing
incomplete UTF-8 character and less the longest tail that could still grow into a stop string.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters (validated at the HTTP boundary)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Decoding:
    """Chooses tokens for one request and tracks its text; ``emit(text_delta)`` gets the text as it
    becomes final. ``finish_reason`` is ``"stop"`` (end of sequence or a stop string), ``"length"``
    (``max_tokens``) or ``"cancelled"`` once :meth:`after` returned True."""

    params: SamplingParams
    tokenizer: object
    eos_ids: frozenset[int]
    emit: object = None
    cancel: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already emitted
    finish_reason: str | None = None

    def __post_init__(self):
        import torch  # optional extra (hf)

        self._gen = None
        if self.params.temperature > 0:
            self._gen = torch.Generator()
            self._gen.manual_seed(self.params.seed if self.params.seed is not None
                                  else int(torch.randint(0, 2**62, (1,)).item()))

    def choose(self, logits) -> int:
        """The next token from a vector of logits (float32 on the CPU)."""
        import torch  # optional extra (hf)

        p = self.params
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < p.top_p  # the smallest set reaching top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self._gen))

    def after(self, token: int) -> bool:
        """Record ``token``; True when generation should stop (and ``finish_reason`` says why)."""
        if self.cancel.is_set():
            self.finish_reason = "cancelled"
            return True
        if token in self.eos_ids:
            self.finish_reason = "stop"
            self._flush()
            return True
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = self._stop_at()
        if cut is not None:
            self.text = self.text[:cut]
            self.finish_reason = "stop"
            self._flush()
            return True
        if len(self.tokens) >= self.params.max_tokens:
            self.finish_reason = "length"
            self._flush()
            return True
        final = len(self.text.rstrip("\ufffd"))  # an incomplete character waits for its next bytes
        hold = max((len(s) - 1 for s in self.params.stop), default=0)
        self._emit_to(max(self.sent, final - hold))
        return False

    def _stop_at(self) -> int | None:
        if not self.params.stop:
            return None
        lo = max(0, self.sent - max(len(s) for s in self.params.stop))
        hits = [i for i in (self.text.find(s, lo) for s in self.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _flush(self) -> None:
        self._emit_to(len(self.text))

    def _emit_to(self, end: int) -> None:
        if end > self.sent:
            delta, self.sent = self.text[self.sent:end], end
            if self.emit is not None:
                self.emit(delta)


def eos_ids(model, tokenizer) -> frozenset[int]:
    """End-of-sequence ids: the generation config's (one or several) and the tokenizer's."""
    out = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    out.update([eos] if isinstance(eos, int) else list(eos or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        out.add(int(tokenizer.eos_token_id))
    return frozenset(out)
