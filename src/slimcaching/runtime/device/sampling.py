"""How a served request picks its tokens and when it stops: temperature, nucleus (top-p) sampling
with its own seeded generator, end of sequence, stop strings, a token budget and cancellation.

:class:`Decoding` is shared by both ways a device generates (SlimCaching-style through
transformers' ``generate``, split-style through :func:`slimcaching.runtime.device.split_client.generate_split`),
so a request decodes the same whichever way its user is served. Temperature 0 is greedy: the
argmax of the model's logits, what ``generate(do_sample=False)`` picks.

Text is streamed as it becomes final: the detokenised text of all new tokens, less a trailing
incomplete UTF-8 character and less the longest tail that could still grow into a stop string.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters (validated at the HTTP boundary).

    Beyond temperature and top-p, vLLM's sampling extensions that benchmark and evaluation tools
    send: ``top_k`` (0: off), ``min_p`` (tokens less likely than ``min_p`` times the likeliest
    dropped), ``min_tokens`` (end of sequence and ``stop_token_ids`` masked until
    that many tokens), ``ignore_eos`` (end of sequence is an ordinary token), ``repetition_penalty``
    (the CTRL rule over the prompt and the output: positive logits divided, negative multiplied),
    ``presence_penalty`` / ``frequency_penalty`` (OpenAI's: subtracted per output token seen, once
    / per occurrence), ``logit_bias`` (token id -> added to its logit) and ``stop_token_ids``.
    ``logprobs``: how many alternatives to report per token (None: no log-probabilities).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but temperature, top-k and top-p changes the logits before sampling."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias or self.min_tokens)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model (the raw logits: before temperature, penalties
    and truncation, as vLLM reports by default) and the ``top`` most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits, chosen: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``chosen[i]`` under ``logits[i]`` (rows of raw logits), with the ``top``
    most likely tokens of each row."""
    import torch  # optional extra (hf)

    lp = torch.log_softmax(torch.as_tensor(logits).float(), dim=-1)
    out = []
    for row, tok in zip(lp, chosen, strict=True):
        alts = ()
        if top > 0:
            vals, idx = torch.topk(row, min(top, row.shape[-1]))
            alts = tuple((int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True))
        out.append(TokenLogprob(int(tok), float(row[tok]), alts))
    return out


@dataclass
class Decoding:
    """Chooses tokens for one request and tracks its text; ``emit(text_delta, logprobs)`` gets the
    text as it becomes final with the :class:`TokenLogprob` of the tokens finalised with it (empty
    without ``params.logprobs``). ``finish_reason`` is ``"stop"`` (end of sequence, a stop token or a
    stop string), ``"length"`` (``max_tokens``) or ``"cancelled"`` once :meth:`after` returned True.
    ``prompt_ids``: what the repetition penalty counts besides the output."""

    params: SamplingParams
    tokenizer: object
    eos_ids: frozenset[int]
    emit: object = None
    cancel: threading.Event = field(default_factory=threading.Event)
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already emitted
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token (an ending one too)
    lp_sent: int = 0

    def __post_init__(self):
        import torch  # optional extra (hf)

        self._gen = None
        self._pending: TokenLogprob | None = None
        if self.params.temperature > 0:
            self._gen = torch.Generator()
            self._gen.manual_seed(self.params.seed if self.params.seed is not None
                                  else int(torch.randint(0, 2**62, (1,)).item()))

    def shaped(self, logits):
        """The logits after the bias, the penalties and the ``min_tokens`` mask (a copy when changed)."""
        import torch  # optional extra (hf)

        p = self.params
        if not p.shapes_logits:
            return logits
        x = logits.clone()
        for tok, bias in p.logit_bias:
            x[tok] += bias
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(self.prompt_ids) | set(self.tokens)), dtype=torch.long)
            if len(seen):
                v = x[seen]
                x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.tokens:
            ids, counts = torch.unique(torch.tensor(self.tokens, dtype=torch.long), return_counts=True)
            x[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(x.dtype)
        if len(self.tokens) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
            if banned:
                x[torch.tensor(sorted(banned), dtype=torch.long)] = -math.inf
        return x

    def choose(self, logits) -> int:
        """The next token from a vector of logits (float32 on the CPU)."""
        import torch  # optional extra (hf)

        p = self.params
        raw = logits.float()
        x = self.shaped(raw)
        if p.temperature <= 0:
            tok = int(torch.argmax(x))
        else:
            probs = torch.softmax(x / p.temperature, dim=-1)
            if 0 < p.top_k < probs.shape[-1]:
                kth = torch.topk(probs, p.top_k).values[-1]
                probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
                probs = probs / probs.sum()
            if p.min_p > 0:
                probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
                probs = probs / probs.sum()
            if p.top_p < 1.0:
                sorted_p, order = torch.sort(probs, descending=True)
                keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < p.top_p  # the smallest set reaching top_p
                keep[0] = True
                probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
            tok = int(torch.multinomial(probs, 1, generator=self._gen))
        if p.logprobs is not None:
            self._pending = token_logprobs(raw[None], [tok], p.logprobs)[0]
        return tok

    def after(self, token: int) -> bool:
        """Record ``token``; True when generation should stop (and ``finish_reason`` says why)."""
        if self.cancel.is_set():
            self.finish_reason = "cancelled"
            return True
        if self._pending is not None and self._pending.token == token:
            self.logprobs.append(self._pending)
        self._pending = None
        p = self.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
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
        if len(self.tokens) >= p.max_tokens:
            self.finish_reason = "length"
            self._flush()
            return True
        final = len(self.text.rstrip("\ufffd"))  # an incomplete character waits for its next bytes
        hold = max((len(s) - 1 for s in p.stop), default=0)
        self._emit_to(max(self.sent, final - hold))
        return False

    def _stop_at(self) -> int | None:
        if not self.params.stop:
            return None
        lo = max(0, self.sent - max(len(s) for s in self.params.stop))
        hits = [i for i in (self.text.find(s, lo) for s in self.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _flush(self) -> None:
        self._emit_to(len(self.text), every=True)

    def _emit_to(self, end: int, every: bool = False) -> None:
        # log-probabilities go with the text they produced: all of them once the text is final
        upto = len(self.logprobs) if every or end >= len(self.text) else self.lp_sent
        if end > self.sent or upto > self.lp_sent:
            delta, self.sent = self.text[self.sent:end], max(self.sent, end)
            entries, self.lp_sent = self.logprobs[self.lp_sent:upto], upto
            if self.emit is not None:
                self.emit(delta, entries)


def eos_ids(model, tokenizer) -> frozenset[int]:
    """End-of-sequence ids: the generation config's (one or several) and the tokenizer's."""
    out = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    out.update([eos] if isinstance(eos, int) else list(eos or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        out.add(int(tokenizer.eos_token_id))
    return frozenset(out)
