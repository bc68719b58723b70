"""The OpenAI-compatible API's responses: choices assembled from a device's events (text,
log-probabilities, echo, finish reasons, usage) and a streamed response that always cleans up."""

from __future__ import annotations

from starlette.responses import StreamingResponse

from slimcaching.runtime.serving.http.schemas import RequestCommon


class Choices:
    """The choices of one request as their events arrive: text, log-probabilities (in the OpenAI
    completions or chat shape), echo of the prompt, finish reason and usage."""

    def __init__(self, api, specs: list, chat: bool, echo: bool, req: RequestCommon):
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
        return self._piece(index, lead, lead_lp, [], finish_reason(ev[1]))

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
            choice = {"index": i, "finish_reason": finish_reason(info), "logprobs": lp}
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


def finish_reason(info: dict) -> str:
    """The OpenAI finish reason of a finished choice: ``length`` or ``stop``."""
    return "length" if info["finish_reason"] == "length" else "stop"
