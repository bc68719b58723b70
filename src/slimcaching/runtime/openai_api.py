"""The OpenAI-compatible HTTP API of ``slimcaching serve`` (Starlette; the ``serve`` extra).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events
with ``"stream": true``: ``data: {chunk}`` lines, then ``data: [DONE]``), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health`` and ``GET /metrics`` (Prometheus). Request and response
shapes are the OpenAI API's, as vLLM accepts them:

- sampling: ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature``, ``top_p``,
  ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, and vLLM's
  ``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty``, ``stop_token_ids``;
- ``n`` choices, a batch of prompts (strings or lists of token ids) in one completions request;
- ``logprobs`` (completions: the number of alternatives; chat: ``logprobs`` and ``top_logprobs``),
  from the raw logits the device decodes with, and ``echo`` with the prompt's log-probabilities
  (what ``lm-eval`` scores multiple choice with);
- ``stream_options.include_usage`` and ``usage`` counts.

Every other field of OpenAI's request schemas that would change the output (``response_format``,
``tools``, ``tool_choice``, ``suffix``, ...) is refused naming it (:data:`REFUSED`); the few that
cannot change it (``store``, ``metadata``, ...) are taken (:data:`NO_EFFECT`); fields that are not
OpenAI's or vLLM's are ignored, as vLLM does. JSON types are strict (no ``true`` for a number,
no ``"yes"`` for a boolean, no NaN).

Every request is served by one scenario user's device: the ``X-SlimCaching-User`` header names
it, else the assigner picks one (:mod:`slimcaching.runtime.assign`); the response says which in
the same header. Errors have the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
A client that goes away cancels its request (streamed or not): the device stops at the next token
and a split host's session is ended.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from slimcaching.limits import limit
from slimcaching.runtime.assign import Assigner
from slimcaching.runtime.engine import Busy, Job
from slimcaching.runtime.sampling import SamplingParams

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


class _Common(_Strict):
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


class CompletionRequest(_Common):
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


class ChatRequest(_Common):
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


def _unsupported(req: _Common) -> None:
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


def _lone_surrogate(value, path: str = "") -> str | None:
    """The path of the first string in a parsed JSON body that is not valid Unicode text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and _lone_surrogate(k) is not None:
            return path or "body"
        got = _lone_surrogate(v, f"{path}.{k}" if path else str(k))
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


class API:
    """The endpoints over an :class:`~slimcaching.runtime.engine.Engine`; ``assigner`` picks the
    user of a request that names none (:mod:`slimcaching.runtime.assign`)."""

    def __init__(self, engine, tokenizer, *, model_name: str, context: int | None, vocab: int,
                 metrics=None, node_status=None, api_key: str | None = None, log=None, assigner=None,
                 body_timeout_s: float = 30.0, health_every_s: float = 1.0):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.context, self.vocab = context, vocab
        self.metrics, self.node_status, self.api_key = metrics, node_status, api_key
        self.log = log or (lambda msg: None)
        self.created = int(time.time())
        self.tokenize_lock = threading.Lock()  # one tokenizer object: calls are serialised
        if assigner is None:
            ctx = engine.ctx
            users = [u for u in ctx.scenario.users if u.name in ctx.layout.homes]  # those of the served model
            assigner = Assigner([u.name for u in users], [u.rate for u in users], "auto", load=engine.load)
        self.assigner = assigner
        self.body_timeout_s, self.health_every_s = body_timeout_s, health_every_s
        self._health: tuple[float, dict] | None = None
        self._health_lock = asyncio.Lock()

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics_endpoint, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed})

    # ---- plumbing ------------------------------------------------------------------------------
    async def _not_found(self, request: Request, exc) -> JSONResponse:
        return self._error(request, APIError(404, f"no such endpoint: {request.url.path[:100]}", code="not_found"))

    async def _not_allowed(self, request: Request, exc) -> JSONResponse:
        return self._error(request, APIError(405, f"method {request.method} not allowed here"))

    def _count(self, request: Request, status: int) -> None:
        if self.metrics is not None:
            path = request.url.path
            endpoint = ("/v1/models" if path.startswith("/v1/models") else path) if path.startswith(
                ("/v1/", "/health", "/metrics")) else "other"
            self.metrics.http.labels(endpoint, str(status)).inc()

    def _error(self, request: Request, err: APIError) -> JSONResponse:
        self._count(request, err.status)
        return JSONResponse(err.body(), status_code=err.status)

    def _authorise(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        token = got[7:] if got.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "invalid API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    async def _read(self, request: Request) -> bytes:
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
            raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
        return bytes(raw)

    async def _body(self, request: Request, schema: type[BaseModel]):
        try:  # a body that trickles in is cut off: it would hold a connection (and a file) without end
            raw = await asyncio.wait_for(self._read(request), self.body_timeout_s)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                           code="timeout") from None
        except ClientDisconnect:  # the client went away mid-body: nobody to answer, nothing to log
            raise APIError(400, "the client disconnected before sending its whole body") from None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise APIError(400, "the body is not valid JSON (UTF-8)") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        bad = _lone_surrogate(data)
        if bad is not None:
            raise APIError(400, f"{bad}: a string holds a lone surrogate (not valid Unicode text)",
                           bad.split(".")[0])
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    def _named_user(self, request: Request, field: str | None) -> str | None:
        """The user the header names (checked), or None when the assigner should choose."""
        header = request.headers.get(USER_HEADER)
        if header is None:
            return None
        if header not in self.assigner.known:
            some = ", ".join(self.engine.users[:5])
            raise APIError(400, f"{header[:64]!r} is not a user of the scenario (e.g. {some})", USER_HEADER,
                           code="unknown_user")
        return header

    def _pick_user(self, request: Request, named: str | None, field: str | None) -> tuple[str, str]:
        if named is not None:
            return named, "header"
        client = request.client.host if request.client else None
        return self.assigner.pick(field, client)

    def _tokenize(self, text: str) -> list[int]:
        with self.tokenize_lock:
            return self.tokenizer(text)["input_ids"]

    def _decode(self, ids: list[int]) -> str:
        with self.tokenize_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _pieces(self, ids: list[int]) -> list[str]:
        """Each token's own text (what ``logprobs`` names tokens by)."""
        with self.tokenize_lock:
            return [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]

    async def _encode(self, text: str) -> list[int]:
        if len(text) > limit("prompt_chars"):
            raise APIError(400, f"the prompt has over {limit('prompt_chars')} characters", "prompt")
        return await asyncio.to_thread(self._tokenize, text)

    def _params(self, req: _Common, prompt_ids: list[int], max_tokens: int | None, param: str,
                logprobs: int | None, seed: int | None) -> SamplingParams:
        if not prompt_ids:
            where = "messages" if isinstance(req, ChatRequest) else "prompt"
            raise APIError(400, "the prompt is empty (no tokens)", where)
        if len(prompt_ids) > limit("request_rows"):
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens, over the request_rows limit of "
                           f"{limit('request_rows')}", "prompt")
        room = (self.context - len(prompt_ids)) if self.context else None
        if room is not None and room < 1:
            raise APIError(400, f"this model's maximum context length is {self.context} tokens; the prompt has "
                           f"{len(prompt_ids)}", "prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = 16 if param == "max_tokens" and isinstance(req, CompletionRequest) else (room or 256)
        if room is not None and max_tokens > room:
            raise APIError(400, f"this model's maximum context length is {self.context} tokens; you requested "
                           f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt, {max_tokens} for "
                           "the completion)", param, code="context_length_exceeded")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if any(not s for s in stop):
            raise APIError(400, "stop sequences must not be empty", "stop")
        bias = []
        for key, value in (req.logit_bias or {}).items():
            if not key.isdigit() or not 0 <= int(key) < self.vocab:
                raise APIError(400, f"logit_bias: {key[:20]!r} is not a token id in [0, {self.vocab})", "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise APIError(400, f"logit_bias: {value} is outside [-100, 100]", "logit_bias")
            bias.append((int(key), float(value)))
        stop_ids = tuple(req.stop_token_ids or ())
        if any(not 0 <= t < self.vocab for t in stop_ids):
            raise APIError(400, f"stop_token_ids must be in [0, {self.vocab})", "stop_token_ids")
        if req.min_tokens and req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({req.min_tokens}) is over max_tokens ({max_tokens})", "min_tokens")
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, seed=seed, stop=stop,
            top_k=max(0, req.top_k or 0), min_p=req.min_p or 0.0, min_tokens=req.min_tokens or 0,
            ignore_eos=bool(req.ignore_eos), repetition_penalty=req.repetition_penalty or 1.0,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=tuple(bias), stop_token_ids=stop_ids, logprobs=logprobs)

    # ---- endpoints -------------------------------------------------------------------------------
    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "slimcaching",
                "max_model_len": self.context}

    async def models(self, request: Request) -> Response:
        try:
            self._authorise(request)
        except APIError as err:
            return self._error(request, err)
        self._count(request, 200)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        try:
            self._authorise(request)
            if request.path_params["model_id"] != self.model_name:
                raise APIError(404, f"the model {request.path_params['model_id'][:100]!r} does not exist",
                               "model", code="model_not_found")
        except APIError as err:
            return self._error(request, err)
        self._count(request, 200)
        return JSONResponse(self._card())

    async def _node_states(self) -> dict:
        """The nodes' states, read at most every ``health_every_s`` whatever the number of callers."""
        if self.node_status is None:
            return {}
        async with self._health_lock:
            if self._health is None or time.monotonic() - self._health[0] >= self.health_every_s:
                self._health = (time.monotonic(), await asyncio.to_thread(self.node_status))
            return self._health[1]

    async def health(self, request: Request) -> Response:
        nodes = await self._node_states()
        down = sorted(n for n, st in nodes.items() if not st)
        status = "ok" if not down else ("degraded" if len(down) < len(nodes) else "down")
        self._count(request, 503 if status == "down" else 200)
        return JSONResponse({"status": status, "nodes": len(nodes), "nodes_down": down,
                             "devices_loaded": self.engine.loaded_devices()},
                            status_code=503 if status == "down" else 200)

    async def metrics_endpoint(self, request: Request) -> Response:
        if self.metrics is None:
            return self._error(request, APIError(404, "metrics are off", code="not_found"))
        body, ctype = await asyncio.to_thread(self.metrics.render)
        self._count(request, 200)
        return Response(body, media_type=ctype)

    async def completions(self, request: Request) -> Response:
        try:
            self._authorise(request)
            req = await self._body(request, CompletionRequest)
            self._check_model(req)
            _unsupported(req)
            named = self._named_user(request, req.user)
            prompts = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(
                req.prompt[0], int) else [req.prompt]
            if len(prompts) * (req.n or 1) > MAX_CHOICES:
                raise APIError(400, f"{len(prompts)} prompts x n={req.n or 1} is over {MAX_CHOICES} choices",
                               "prompt")
            batch = []
            for p in prompts:
                if isinstance(p, list):
                    if any(not 0 <= t < self.vocab for t in p):
                        raise APIError(400, f"token ids must be in [0, {self.vocab})", "prompt")
                    ids = list(p)
                else:
                    ids = await self._encode(p)
                batch.append(ids)
            lp = req.logprobs
            specs = []
            for i, ids in enumerate(batch):
                for j in range(req.n or 1):
                    seed = None if req.seed is None else (req.seed + j) % 2**63
                    params = self._params(req, ids, req.max_tokens, "max_tokens", lp, seed)
                    specs.append((i * (req.n or 1) + j, ids, params))
        except APIError as err:
            return self._error(request, err)
        echo = bool(req.echo)
        return await self._run(request, req, named, specs, chat=False, echo=echo)

    async def chat(self, request: Request) -> Response:
        try:
            self._authorise(request)
            req = await self._body(request, ChatRequest)
            self._check_model(req)
            _unsupported(req)
            named = self._named_user(request, req.user)
            text = await asyncio.to_thread(self._chat_text, req.messages)
            ids = await self._encode(text)
            which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            lp = (req.top_logprobs or 0) if req.logprobs else None
            specs = [(j, ids, self._params(req, ids, req.max_completion_tokens or req.max_tokens, which, lp,
                                           None if req.seed is None else (req.seed + j) % 2**63))
                     for j in range(req.n or 1)]
        except APIError as err:
            return self._error(request, err)
        return await self._run(request, req, named, specs, chat=True, echo=False)

    def _chat_text(self, messages: list[ChatMessage]) -> str:
        with self.tokenize_lock:
            return chat_prompt(self.tokenizer, messages)

    def _check_model(self, req: _Common) -> None:
        if req.model != self.model_name:
            raise APIError(404, f"the model {req.model[:100]!r} does not exist (this server serves "
                           f"{self.model_name!r})", "model", code="model_not_found")

    # ---- running a request -----------------------------------------------------------------------
    async def _run(self, request: Request, req: _Common, named: str | None, specs: list, chat: bool,
                   echo: bool) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        jobs: list[Job] = []
        users: list[str] = []
        for index, ids, params in specs:
            def emit(event, index=index) -> None:  # from the device's thread
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:  # the loop is gone (shutting down)
                    pass

            user, how = self._pick_user(request, named, req.user)  # no await from here to submit
            job = Job(user, ids, params, emit,
                      echo_logprobs=params.logprobs if echo and params.logprobs is not None else None)
            try:
                self.engine.submit(job)
            except Busy as exc:
                for j in jobs:
                    self._finished(j)
                return self._error(request, APIError(429, str(exc), code="rate_limit_exceeded",
                                                     kind="rate_limit_error"))
            jobs.append(job)
            users.append(user)
            if self.metrics is not None:
                self.metrics.in_progress.inc()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        who = ",".join(dict.fromkeys(users))
        self.log(f"request {rid}: user {who} ({how}), {len(jobs)} choice(s)")
        headers = {USER_HEADER: who, "x-request-id": rid}
        out = _Choices(self, specs, chat, echo, req)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            self._count(request, 200)
            return JobStream(self._sse(events, out, rid, created, include_usage),
                             on_close=lambda: [self._finished(j) for j in jobs], media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **headers})
        try:
            done, checked = 0, time.monotonic()
            while done < len(jobs):
                try:  # whether tokens flow or not, the client is looked at every 0.1 s
                    index, ev = await asyncio.wait_for(events.get(), max(0.0, checked + 0.1 - time.monotonic()))
                except TimeoutError:
                    index, ev = None, None
                if time.monotonic() >= checked + 0.1:
                    checked = time.monotonic()
                    if await request.is_disconnected():  # the device is freed at its next token
                        return Response(status_code=499)
                if ev is None:
                    continue
                if ev[0] == "error":
                    return self._error(request, APIError(ev[1], ev[2], kind="server_error"
                                                         if ev[1] >= 500 else "invalid_request_error"))
                out.add(index, ev)
                done += ev[0] == "done"
        finally:
            for j in jobs:
                self._finished(j)
        self._count(request, 200)
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_name, "choices": await asyncio.to_thread(out.final), "usage": out.usage()}
        return JSONResponse(body, headers=headers)

    def _finished(self, job: Job) -> None:
        job.cancel.set()  # a no-op when the job ended; stops it at the next token otherwise
        if not job.released:
            job.released = True
            if self.metrics is not None:
                self.metrics.in_progress.dec()

    async def _sse(self, events: asyncio.Queue, out: _Choices, rid: str, created: int, include_usage: bool):
        obj = "chat.completion.chunk" if out.chat else "text_completion"

        def chunk(choices: list, usage=None) -> bytes:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n".encode()

        if out.chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in out.indexes])
        done = 0
        while done < len(out.indexes):
            index, ev = await events.get()
            if ev[0] == "error":
                err = APIError(ev[1], ev[2], kind="server_error" if ev[1] >= 500 else "invalid_request_error")
                yield f"data: {json.dumps(err.body())}\n\n".encode()
                return
            piece = await asyncio.to_thread(out.add, index, ev)
            if piece is not None:
                yield chunk([piece])
            if ev[0] == "done":
                done += 1
        if include_usage:
            yield chunk([], out.usage())
        yield b"data: [DONE]\n\n"


class _Choices:
    """The choices of one request as their events arrive: text, log-probabilities (in the OpenAI
    completions or chat shape), echo of the prompt, finish reason and usage."""

    def __init__(self, api: API, specs: list, chat: bool, echo: bool, req: _Common):
        self.api, self.chat, self.echo = api, chat, echo
        self.indexes = [index for index, _, _ in specs]
        self.prompts = {index: ids for index, ids, _ in specs}
        self.params = {index: params for index, _, params in specs}
        self.text = {i: [] for i in self.indexes}
        self.logprobs = {i: [] for i in self.indexes}
        self.info: dict[int, dict] = {}
        self.started: set[int] = set()
        self.offset = {i: 0 for i in self.indexes}  # text_offset of the next token (completions)

    def add(self, index: int, ev: tuple):
        """Record one event; the streamed chunk's choice for it (None: nothing to send yet)."""
        lead = ""
        lead_lp: list = []
        if index not in self.started:
            self.started.add(index)
            if self.echo and ev[0] in ("text", "done"):
                lead = self.api._decode(self.prompts[index])
                if ev[0] == "done":
                    lead_lp = self._prompt_logprobs(index, ev[1])
        if ev[0] == "text":
            self.text[index].append(ev[1])
            self.logprobs[index].extend(ev[2])
            return self._piece(index, lead + ev[1], lead_lp, ev[2], None)
        self.info[index] = ev[1]
        return self._piece(index, lead, lead_lp, [], _finish(ev[1]))

    def _prompt_logprobs(self, index: int, info: dict) -> list:
        prompt = info.get("prompt_logprobs")
        if prompt is None:
            return []
        ids = self.prompts[index]
        return [(ids[0], None, ())] + [(e.token, e.logprob, e.top) for e in prompt]

    def _piece(self, index: int, text: str, lead_lp: list, entries: list, finish) -> dict | None:
        p = self.params[index]
        lp = None
        if p.logprobs is not None:
            lp = self._format(index, lead_lp + [(e.token, e.logprob, e.top) for e in entries])
        if self.chat:
            return {"index": index, "delta": {"content": text} if text or finish is None else {},
                    "logprobs": lp, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    def _format(self, index: int, rows: list) -> dict:
        """Log-probabilities of ``rows`` ((token, logprob or None, top alternatives)) in the shape of
        the endpoint; a chosen token is among its alternatives (as vLLM reports it)."""
        ids = sorted({t for r in rows for t in [r[0]] + [a for a, _ in r[2]]})
        name = dict(zip(ids, self.api._pieces(ids), strict=True))
        if self.chat:
            return {"content": [{"token": name[t], "logprob": lp, "bytes": list(name[t].encode("utf-8", "replace")),
                                 "top_logprobs": [{"token": name[a], "logprob": v,
                                                   "bytes": list(name[a].encode("utf-8", "replace"))}
                                                  for a, v in top]} for t, lp, top in rows]}
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, lp, top in rows:
            tokens.append(name[t])
            token_lps.append(lp)
            if lp is None:
                tops.append(None)
            else:
                alts = {name[a]: v for a, v in top}
                alts.setdefault(name[t], lp)
                tops.append(alts)
            offsets.append(self.offset[index])
            self.offset[index] += len(name[t])
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def final(self) -> list[dict]:
        """Every choice of a non-streamed response, in index order."""
        out = []
        for i in self.indexes:
            info = self.info[i]
            text = "".join(self.text[i])
            lead_lp = self._prompt_logprobs(i, info) if self.echo else []
            if self.echo:
                text = self.api._decode(self.prompts[i]) + text
            lp = None
            if self.params[i].logprobs is not None:
                self.offset[i] = 0
                lp = self._format(i, lead_lp + [(e.token, e.logprob, e.top) for e in self.logprobs[i]])
            choice = {"index": i, "finish_reason": _finish(info), "logprobs": lp}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out.append(choice)
        return out

    def usage(self) -> dict:
        seen = {}
        for i in self.indexes:  # a prompt counts once, however many choices it has
            seen[tuple(self.prompts[i])] = len(self.prompts[i])
        prompt = sum(seen.values())
        completion = sum(self.info[i]["completion_tokens"] for i in self.indexes if i in self.info)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _validation_error(exc: ValidationError) -> APIError:
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


class JobStream(StreamingResponse):
    """A streamed response that runs ``on_close`` however it ends (finished, client gone, error)."""

    def __init__(self, content, *, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _finish(info: dict) -> str:
    return "length" if info["finish_reason"] == "length" else "stop"
