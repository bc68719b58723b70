"""The OpenAI-compatible HTTP API of ``slimcaching serve`` (Starlette; the ``serve`` extra).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events
with ``"stream": true``: ``data: {chunk}`` lines, then ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus). Request and response shapes are the OpenAI
API's, as vLLM and llama.cpp's server accept them: ``max_tokens`` (chat: also
``max_completion_tokens``), ``temperature``, ``top_p``, ``stop``, ``seed``, ``n=1``,
``stream_options.include_usage``, ``usage`` counts. Parameters that change what is generated and
that we do not implement (``n > 1``, ``best_of``, ``logprobs``, ``echo``, ``suffix``, penalties,
``logit_bias``, tools) are refused naming the field rather than ignored; other unknown fields are
ignored.

Every request is served by one scenario user's device: the ``X-SlimCaching-User`` header or the
request's ``user`` field names it (default: the scenario's first user). Errors have the OpenAI
shape ``{"error": {"message", "type", "param", "code"}}``. A client that goes away cancels its
request: the device stops at the next token and a split host's session is ended.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from slimcaching.limits import limit
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


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = False


class _Common(BaseModel):
    """What both generation endpoints take."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    logprobs: bool | int | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int]
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    """One text part of a message's content."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None
    top_logprobs: int | None = None


def _unsupported(req: _Common) -> None:
    """Refuse what would change the output and is not implemented (silently ignoring it would lie)."""
    checks = [("n", (req.n or 1) != 1, "only n=1 is supported"),
              ("presence_penalty", bool(req.presence_penalty), "penalties are not supported"),
              ("frequency_penalty", bool(req.frequency_penalty), "penalties are not supported"),
              ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
              ("logprobs", req.logprobs not in (None, False, 0), "logprobs are not supported")]
    if isinstance(req, CompletionRequest):
        checks += [("echo", bool(req.echo), "echo is not supported"),
                   ("best_of", (req.best_of or 1) != 1, "only best_of=1 is supported"),
                   ("suffix", bool(req.suffix), "suffix is not supported")]
    if isinstance(req, ChatRequest):
        checks += [("tools", bool(req.tools), "tools are not supported")]
    for param, bad, why in checks:
        if bad:
            raise APIError(400, why, param)
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop sequences", "stop")


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
    """The endpoints over an :class:`~slimcaching.runtime.engine.Engine`."""

    def __init__(self, engine, tokenizer, *, model_name: str, context: int | None, vocab: int,
                 metrics=None, node_status=None, api_key: str | None = None, log=None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.context, self.vocab = context, vocab
        self.metrics, self.node_status, self.api_key = metrics, node_status, api_key
        self.log = log or (lambda msg: None)
        self.created = int(time.time())
        self.tokenize_lock = asyncio.Lock()  # one tokenizer object: calls are serialised

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
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
            self.metrics.http.labels(request.url.path if request.url.path.startswith(("/v1/", "/health", "/metrics"))
                                     else "other", str(status)).inc()

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

    async def _body(self, request: Request, schema: type[BaseModel]):
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
            raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
        raw = bytearray()
        try:
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > MAX_BODY_BYTES:
                    raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
        except ClientDisconnect:  # the client went away mid-body: nobody to answer, nothing to log
            raise APIError(400, "the client disconnected before sending its whole body") from None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise APIError(400, "the body is not valid JSON") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            e = exc.errors()[0]
            param = ".".join(str(x) for x in e["loc"]) or None
            raise APIError(400, f"{param}: {e['msg']}" if param else e["msg"], param) from None

    def _user(self, request: Request, field: str | None) -> str:
        header = request.headers.get(USER_HEADER)
        name = header if header is not None else field
        if name is None:
            return self.engine.users[0]
        if name not in self.engine.ctx.layout.homes:
            some = ", ".join(self.engine.users[:5])
            raise APIError(400, f"{name[:64]!r} is not a user of the scenario (e.g. {some})",
                           "user" if header is None else USER_HEADER, code="unknown_user")
        return name

    async def _encode(self, text: str) -> list[int]:
        if len(text) > limit("prompt_chars"):
            raise APIError(400, f"the prompt has over {limit('prompt_chars')} characters", "prompt")
        async with self.tokenize_lock:
            return await asyncio.to_thread(lambda: self.tokenizer(text)["input_ids"])

    def _params(self, req: _Common, prompt_ids: list[int], max_tokens: int | None, param: str) -> SamplingParams:
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
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=stop)

    # ---- endpoints -------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        try:
            self._authorise(request)
        except APIError as err:
            return self._error(request, err)
        self._count(request, 200)
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": self.created, "owned_by": "slimcaching",
                                                         "max_model_len": self.context}]})

    async def health(self, request: Request) -> Response:
        nodes = await asyncio.to_thread(self.node_status) if self.node_status else {}
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
            user = self._user(request, req.user)
            if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
                if any(not 0 <= t < self.vocab for t in req.prompt):
                    raise APIError(400, f"token ids must be in [0, {self.vocab})", "prompt")
                ids = list(req.prompt)
            elif isinstance(req.prompt, list):
                if len(req.prompt) != 1:
                    raise APIError(400, "exactly one prompt per request", "prompt")
                ids = await self._encode(req.prompt[0])
            else:
                ids = await self._encode(req.prompt)
            params = self._params(req, ids, req.max_tokens, "max_tokens")
        except APIError as err:
            return self._error(request, err)
        return await self._run(request, req, user, ids, params, chat=False)

    async def chat(self, request: Request) -> Response:
        try:
            self._authorise(request)
            req = await self._body(request, ChatRequest)
            self._check_model(req)
            _unsupported(req)
            user = self._user(request, req.user)
            async with self.tokenize_lock:
                text = await asyncio.to_thread(chat_prompt, self.tokenizer, req.messages)
            ids = await self._encode(text)
            which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            params = self._params(req, ids, req.max_completion_tokens or req.max_tokens, which)
        except APIError as err:
            return self._error(request, err)
        return await self._run(request, req, user, ids, params, chat=True)

    def _check_model(self, req: _Common) -> None:
        if req.model != self.model_name:
            raise APIError(404, f"the model {req.model[:100]!r} does not exist (this server serves "
                           f"{self.model_name!r})", "model", code="model_not_found")

    # ---- running a request -----------------------------------------------------------------------
    async def _run(self, request: Request, req: _Common, user: str, ids: list[int], params: SamplingParams,
                   chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:  # from the device's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is gone (shutting down)
                pass

        job = Job(user, ids, params, emit)
        try:
            self.engine.submit(job)
        except Busy as exc:
            return self._error(request, APIError(429, str(exc), code="rate_limit_exceeded",
                                                 kind="rate_limit_error"))
        if self.metrics is not None:
            self.metrics.in_progress.inc()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            self._count(request, 200)
            return JobStream(self._sse(events, rid, created, chat, include_usage),
                             on_close=lambda: self._finished(job), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
        try:
            text, info = [], None
            while info is None:
                try:
                    ev = await asyncio.wait_for(events.get(), 0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                if ev[0] == "text":
                    text.append(ev[1])
                elif ev[0] == "error":
                    return self._error(request, APIError(ev[1], ev[2], kind="server_error"
                                                         if ev[1] >= 500 else "invalid_request_error"))
                else:
                    info = ev[1]
        finally:
            self._finished(job)
        self._count(request, 200)
        usage = _usage(info)
        choice = {"index": 0, "finish_reason": _finish(info), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                                 "choices": [choice], "usage": usage})
        choice["text"] = "".join(text)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": [choice], "usage": usage})

    def _finished(self, job: Job) -> None:
        job.cancel.set()  # a no-op when the job ended; stops it at the next token otherwise
        if not job.released:
            job.released = True
            if self.metrics is not None:
                self.metrics.in_progress.dec()

    async def _sse(self, events: asyncio.Queue, rid: str, created: int, chat: bool, include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, usage=None) -> bytes:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n".encode()

        def delta(text: str | None, finish=None, role: bool = False) -> dict:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
                return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        if chat:
            yield chunk([delta(None, role=True)])
        while True:
            ev = await events.get()
            if ev[0] == "text":
                yield chunk([delta(ev[1])])
            elif ev[0] == "error":
                err = APIError(ev[1], ev[2], kind="server_error" if ev[1] >= 500 else "invalid_request_error")
                yield f"data: {json.dumps(err.body())}\n\n".encode()
                break
            else:
                info = ev[1]
                yield chunk([delta(None if chat else "", finish=_finish(info))])
                if include_usage:
                    yield chunk([], _usage(info))
                break
        yield b"data: [DONE]\n\n"


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


def _usage(info: dict) -> dict:
    return {"prompt_tokens": info["prompt_tokens"], "completion_tokens": info["completion_tokens"],
            "total_tokens": info["prompt_tokens"] + info["completion_tokens"]}


def _finish(info: dict) -> str:
    return "length" if info["finish_reason"] == "length" else "stop"
