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
it, else the assigner picks one (:mod:`slimcaching.runtime.serving.assign`); the response says which in
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

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from slimcaching.inputs.limits import limit
from slimcaching.runtime.device.sampling import SamplingParams
from slimcaching.runtime.serving.assign import Assigner
from slimcaching.runtime.serving.engine import Busy, Job
from slimcaching.runtime.serving.http.responses import Choices, JobStream
from slimcaching.runtime.serving.http.schemas import (
    MAX_BODY_BYTES,
    MAX_CHOICES,
    USER_HEADER,
    APIError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    RequestCommon,
    chat_prompt,
    lone_surrogate,
    refuse_unsupported,
    sampling_params,
    validation_error,
)


class Shared:
    """An async call with at most one run in flight, whose result every caller that arrives
    while it runs shares (a flood of unauthenticated scrapes costs one rendering at a time)."""

    def __init__(self, make):
        self.make, self.running = make, None

    async def __call__(self):
        if self.running is None:
            async def run():
                try:
                    return await self.make()
                finally:
                    self.running = None

            self.running = asyncio.ensure_future(run())
        return await asyncio.shield(self.running)


class API:
    """The endpoints over an :class:`~slimcaching.runtime.serving.engine.Engine`; ``assigner`` picks the
    user of a request that names none (:mod:`slimcaching.runtime.serving.assign`)."""

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
        # one rendering for every scrape that comes while it runs: a flood costs one at a time
        self._metrics_snapshot = Shared(self._render_metrics)

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
        bad = lone_surrogate(data)
        if bad is not None:
            raise APIError(400, f"{bad}: a string holds a lone surrogate (not valid Unicode text)",
                           bad.split(".")[0])
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None

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

    def _sampling(self, req: RequestCommon, prompt_ids: list[int], max_tokens: int | None, param: str,
                  logprobs: int | None, seed: int | None) -> SamplingParams:
        return sampling_params(req, prompt_ids, max_tokens, param, logprobs, seed, context=self.context,
                               vocab=self.vocab)

    async def _encode(self, text: str) -> list[int]:
        if len(text) > limit("prompt_chars"):
            raise APIError(400, f"the prompt has over {limit('prompt_chars')} characters", "prompt")
        return await asyncio.to_thread(self._tokenize, text)

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

    def cached_node_states(self) -> dict:
        """The nodes' states as last read for ``/health`` or ``/metrics`` (no call to the nodes)."""
        return dict(self._health[1]) if self._health is not None else {}

    async def _render_metrics(self) -> tuple[bytes, str]:
        await self._node_states()  # the nodes' part: as /health read them, at most every health_every_s
        return await asyncio.to_thread(self.metrics.render)

    async def metrics_endpoint(self, request: Request) -> Response:
        if self.metrics is None:
            return self._error(request, APIError(404, "metrics are off", code="not_found"))
        body, ctype = await self._metrics_snapshot()
        self._count(request, 200)
        return Response(body, media_type=ctype)

    async def completions(self, request: Request) -> Response:
        try:
            self._authorise(request)
            req = await self._body(request, CompletionRequest)
            self._check_model(req)
            refuse_unsupported(req)
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
                    params = self._sampling(req, ids, req.max_tokens, "max_tokens", lp, seed)
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
            refuse_unsupported(req)
            named = self._named_user(request, req.user)
            text = await asyncio.to_thread(self._chat_text, req.messages)
            ids = await self._encode(text)
            which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            lp = (req.top_logprobs or 0) if req.logprobs else None
            specs = [(j, ids, self._sampling(req, ids, req.max_completion_tokens or req.max_tokens, which, lp,
                                           None if req.seed is None else (req.seed + j) % 2**63))
                     for j in range(req.n or 1)]
        except APIError as err:
            return self._error(request, err)
        return await self._run(request, req, named, specs, chat=True, echo=False)

    def _chat_text(self, messages: list[ChatMessage]) -> str:
        with self.tokenize_lock:
            return chat_prompt(self.tokenizer, messages)

    def _check_model(self, req: RequestCommon) -> None:
        if req.model != self.model_name:
            raise APIError(404, f"the model {req.model[:100]!r} does not exist (this server serves "
                           f"{self.model_name!r})", "model", code="model_not_found")

    # ---- running a request -----------------------------------------------------------------------
    async def _run(self, request: Request, req: RequestCommon, named: str | None, specs: list, chat: bool,
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
        out = Choices(self, specs, chat, echo, req)
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

    async def _sse(self, events: asyncio.Queue, out: Choices, rid: str, created: int, include_usage: bool):
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
