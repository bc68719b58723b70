"""The OpenAI-compatible API's requests: their schemas (strict JSON types), the fields refused
or taken without effect, and the sampling parameters a request asks for."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slimcaching.inputs.limits import limit
from slimcaching.runtime.device.sampling import SamplingParams

USER_HEADER = "x-slimcaching-user"
MAX_BODY_BYTES = 8 * 2**20  # a prompt of prompt_chars characters fits; more is refused before parsing
MAX_STOP = 4


class APIError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


MAX_CHOICES = 64  # prompts x n in one request
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    """JSON types as sent: no booleans as numbers, no strings as booleans, no NaN or infinity;
    fields that are not OpenAI's or vLLM's are ignored (as vLLM does)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = False


class RequestCommon(_Strict):
    """What both generation endpoints take: OpenAI's sampling parameters and vLLM's extensions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extensions (what guidellm, aiperf and lm-eval send)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stop_token_ids: list[int] | None = Field(None, max_length=64)


class CompletionRequest(RequestCommon):
    """``POST /v1/completions``: one prompt or a batch (strings, or lists of token ids)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None


class TextPart(_Strict):
    """One text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class ChatRequest(RequestCommon):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # OpenAI fields without an effect here (taken, nothing to do: no storage, no tiers, no cache keys)
    metadata: object = None
    store: object = None
    service_tier: object = None
    prompt_cache_key: object = None
    prompt_cache_options: object = None
    prompt_cache_retention: object = None
    safety_identifier: object = None
    parallel_tool_calls: object = None
    # OpenAI fields that would change the output and are not implemented: refused unless harmless
    tools: object = None
    tool_choice: object = None
    functions: object = None
    function_call: object = None
    response_format: object = None
    audio: object = None
    modalities: object = None
    prediction: object = None
    reasoning_effort: object = None
    verbosity: object = None
    web_search_options: object = None
    moderation: object = None


NO_EFFECT = ("metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_options",
             "prompt_cache_retention", "safety_identifier", "parallel_tool_calls")
"""OpenAI chat fields accepted and without effect here (documented in docs/runtime.md)."""

REFUSED = {
    # field: (a value that asks for nothing, why it is refused)
    "tools": (lambda v: v == [], "tools (function calling) are not supported"),
    "tool_choice": (lambda v: v == "none", "tool_choice is not supported (only \"none\")"),
    "functions": (lambda v: v == [], "functions are not supported"),
    "function_call": (lambda v: v == "none", "function_call is not supported"),
    "response_format": (lambda v: v == {"type": "text"}, "response_format is not supported (only "
                        "{\"type\": \"text\"}): structured output would be a lie here"),
    "audio": (lambda v: False, "audio output is not supported"),
    "modalities": (lambda v: v == ["text"], "only the text modality is supported"),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: False, "reasoning_effort is not supported"),
    "verbosity": (lambda v: False, "verbosity is not supported"),
    "web_search_options": (lambda v: False, "web search is not supported"),
    "moderation": (lambda v: False, "moderation is not supported"),
    "suffix": (lambda v: v == "", "suffix (insertion) is not supported"),
}
"""OpenAI fields refused by name when given (a value that asks for nothing passes)."""

UNION_HINTS = {
    "prompt": "expected a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "expected a string or a list of strings",
    "content": "expected a string or a list of text parts",
}


def refuse_unsupported(req: RequestCommon) -> None:
    """Refuse what would change the output and is not implemented (silently ignoring it would lie)."""
    for name, (harmless, why) in REFUSED.items():
        v = getattr(req, name, None)
        if v is not None and not harmless(v):
            raise APIError(400, why, name, code="unsupported_parameter")
    if isinstance(req, CompletionRequest) and req.best_of is not None and req.best_of != (req.n or 1):
        raise APIError(400, "best_of must equal n (choosing the best of several is not supported)", "best_of",
                       code="unsupported_parameter")
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop sequences", "stop")


def lone_surrogate(value, path: str = "") -> str | None:
    """The path of the first string in a parsed JSON body that is not valid Unicode text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and lone_surrogate(k) is not None:
            return path or "body"
        got = lone_surrogate(v, f"{path}.{k}" if path else str(k))
        if got is not None:
            return got
    return None


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    """The model's chat template applied (with the generation prompt); a model without one gets
    ``role: content`` lines and ``assistant:``."""
    msgs = [{"role": m.role, "content": m.content if isinstance(m.content, str) or m.content is None
             else "".join(p.text for p in m.content)} for m in messages]
    for m in msgs:
        m["content"] = m["content"] or ""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in msgs) + "\nassistant:"


def validation_error(exc: ValidationError) -> APIError:
    """One OpenAI-shaped 400 for a body that does not fit the schema, naming the top-level field."""
    errors = exc.errors()
    e = errors[0]
    loc = [str(x) for x in e["loc"]]
    param = loc[0] if loc else None
    same = [x for x in errors if x["loc"][:1] == e["loc"][:1]]
    if param in UNION_HINTS and len(same) > 1:
        return APIError(400, f"{param}: {UNION_HINTS[param]}", param)
    where = ".".join(x for x in loc if x not in ("str", "list[str]", "list[int]", "list[list[int]]",
                                                 "list[TextPart]", "bool", "int", "float"))
    return APIError(400, f"{where}: {e['msg']}" if where else e["msg"], param)


def sampling_params(req: RequestCommon, prompt_ids: list[int], max_tokens: int | None, param: str,
                logprobs: int | None, seed: int | None, *, context: int | None, vocab: int) -> SamplingParams:
    """The sampling parameters of a request, checked against the model's context and vocabulary
    (an OpenAI-shaped 400 naming the field otherwise)."""
    if not prompt_ids:
        where = "messages" if isinstance(req, ChatRequest) else "prompt"
        raise APIError(400, "the prompt is empty (no tokens)", where)
    if len(prompt_ids) > limit("request_rows"):
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens, over the request_rows limit of "
                       f"{limit('request_rows')}", "prompt")
    room = (context - len(prompt_ids)) if context else None
    if room is not None and room < 1:
        raise APIError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                       f"{len(prompt_ids)}", "prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = 16 if param == "max_tokens" and isinstance(req, CompletionRequest) else (room or 256)
    if room is not None and max_tokens > room:
        raise APIError(400, f"this model's maximum context length is {context} tokens; you requested "
                       f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt, {max_tokens} for "
                       "the completion)", param, code="context_length_exceeded")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(not s for s in stop):
        raise APIError(400, "stop sequences must not be empty", "stop")
    bias = []
    for key, value in (req.logit_bias or {}).items():
        if not key.isdigit() or not 0 <= int(key) < vocab:
            raise APIError(400, f"logit_bias: {key[:20]!r} is not a token id in [0, {vocab})", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias: {value} is outside [-100, 100]", "logit_bias")
        bias.append((int(key), float(value)))
    stop_ids = tuple(req.stop_token_ids or ())
    if any(not 0 <= t < vocab for t in stop_ids):
        raise APIError(400, f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
    if req.min_tokens and req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) is over max_tokens ({max_tokens})", "min_tokens")
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, seed=seed, stop=stop,
        top_k=max(0, req.top_k or 0), min_p=req.min_p or 0.0, min_tokens=req.min_tokens or 0,
        ignore_eos=bool(req.ignore_eos), repetition_penalty=req.repetition_penalty or 1.0,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=tuple(bias), stop_token_ids=stop_ids, logprobs=logprobs)
