"""Split-style serving, the device's half: the embedding and the head stay on the device, every
layer runs at a split host (:mod:`slimcaching.runtime.node.split_host`, where the protocol is
described); ``step`` messages go through the access server, with fail-over along the user's hosts."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from slimcaching.inputs.limits import limit
from slimcaching.runtime.cluster.layout import CLOUD, Layout
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig
from slimcaching.runtime.device.fallbacks import FallbackLog
from slimcaching.runtime.model.tensors import to_numpy, to_torch
from slimcaching.runtime.net import protocol
from slimcaching.runtime.net.health import PeerHealth
from slimcaching.runtime.net.linkemu import Link, release_time, schedule_path, sleep_until
from slimcaching.runtime.net.protocol import ErrorReply, Result, SplitEnd, SplitStep, seconds_or
from slimcaching.runtime.net.transport import (
    Dealers,
    context,
    recv_within,
    send_now,
    send_nowait,
)

# ---- the device: embeddings and head, steps through the access server ------------------------------


class SplitClient:
    """One user's split-style device side: sends ``step`` messages through the access server to
    the current host, fails over along the user's order of hosts (see the module docstring)."""

    def __init__(self, user: str, layout: Layout, addresses: dict[str, str], *, config: RuntimeConfig = DEFAULTS,
                 keyring=None):
        self.user = user
        self.layout = layout
        self.home = layout.homes[user]
        self.hosts = [w for _, w in layout.ways[user] if w != "slimcaching"]
        self.addresses = addresses
        self.keyring = keyring
        self.config = config
        emulate = config.emulate
        self.ctx = context()
        self.ids = itertools.count(1)
        self.health = PeerHealth(config.retry_after_s)
        self.fallbacks: list[dict] = FallbackLog()
        self.late_replies = 0
        inf = (float("inf"), 0.0)
        self.uplinks, self.backhauls = {}, {}  # per server the radio reaches (the home first)
        for v in layout.vias(user):
            up, _, rtt = layout.link_of(user, v)
            self.uplinks[v] = Link(up, rtt / 2.0) if emulate else Link(*inf)
            rate, delay = layout.hop[(v, CLOUD)]
            self.backhauls[v] = Link(rate, delay) if emulate else Link(*inf)
        self.max_message_bytes = layout.max_message_bytes(limit("request_rows"))
        self.dealers = Dealers(self.ctx, addresses, self.max_message_bytes, keyring)
        for node in (self.home, CLOUD):
            self.dealers.require(node)

    def via(self, host: str) -> str:
        """The reached server a step to ``host`` goes through: the least a_{u,v} + c_{v,host} among
        the live ones."""
        now = time.time()
        live = [v for v in self.layout.vias(self.user) if self.health.alive(v, now)]
        if not live:
            return self.home
        lay = self.layout
        return min(live, key=lambda v: lay.access_s(self.user, v) + lay.relay_s.get((v, host), math.inf))

    def close(self) -> None:
        self.dealers.close()

    def host(self) -> str:
        alive = self.health.first_alive(self.hosts)
        return self.hosts[-1] if alive is None else alive

    def _deadline(self, host: str, tokens: int) -> float:
        lay = self.layout
        worst = max((c[0][0] for layer in range(lay.layers) for e in range(lay.experts)
                     if (c := lay.candidates(host, layer, e))), default=0.0)
        bound = (lay.best_via_to(self.user, host)[0] + lay.paced_dense_s(host, tokens)
                 + lay.layers * (worst + lay.paced_exec_s(host, tokens)))
        return self.config.deadline_factor * bound + 3.0 * self.config.deadline_floor_s

    def step(self, session: str, start: int, x: np.ndarray, tag: str | None, history,
             all_rows: bool = False) -> tuple[Result, dict]:
        """Run one step; returns the host's result and what happened (host, rebuilt from 0, the
        fallbacks). ``history()`` gives every token's embeddings so far, for a rebuild;
        ``all_rows``: every row's hidden state back, not only the last one's."""
        t0 = time.time()
        info = {"host": None, "start": start, "rebuilt": False}
        tried: set[tuple[str, str]] = set()
        while True:
            host = self.host()
            via = self.via(host)
            direct = not self.health.alive(via)  # every access server is down
            if direct and host != CLOUD:
                host = CLOUD
            target = CLOUD if direct else via
            if (target, host) in tried:  # every way has failed for this step
                from slimcaching.runtime.device.offload import (
                    ClusterError,  # start-up: device imports this module
                )

                raise ClusterError(f"no split host answers for user {self.user!r} "
                                   f"({self.fallbacks[-1]['reason'] if self.fallbacks else 'no reply'})")
            tried.add((target, host))
            req = SplitStep(next(self.ids), self.layout.model, self.user, session, start, host, x,
                            relay=host != target, reply_user=self.user,
                            reply_hops=[(CLOUD, via)] if direct else [], dtype_tag=tag, all_rows=all_rows)
            links = [self.uplinks[via], self.backhauls[via]] if direct else [self.uplinks[via]]
            req.deliver_at = schedule_path(links, protocol.message_bytes(req.frames()), time.time())
            deadline = time.time() + self._deadline(host, x.shape[0])
            got = self._exchange(target, req, deadline)
            if isinstance(got, Result):
                info["host"] = host
                if info["rebuilt"]:
                    self.fallbacks[-1]["recovery_s"] = time.time() - t0
                return got, info
            failed = target if got in ("no reply", "not connected") else host
            self.health.failed(failed)
            self.fallbacks.append({"t": time.time(), "node": failed, "reason": got, "to": self.host(),
                                   "session": session})
            if start > 0:  # the session goes to another host: it rebuilds the cache from position 0
                x, start, info["rebuilt"] = history(), 0, True
                info["start"] = 0

    def _exchange(self, target: str, req: SplitStep, deadline: float):
        sock = self.dealers.require(target)
        if not send_now(sock, req.frames(), self.config.connect_grace_ms):
            return "not connected"
        while True:
            left = deadline - time.time()
            if left <= 0:
                return "no reply"
            frames = recv_within(sock, left)
            if frames is None:
                continue
            try:
                received_at = time.time()
                msg = protocol.parse([f.buffer for f in frames])
            except protocol.ProtocolError as exc:
                return f"malformed reply ({str(exc)[:80]})"
            if msg.id != req.id:
                self.late_replies += 1
                continue
            if isinstance(msg, ErrorReply):
                return msg.reason[:200]
            rows = req.x.shape[0] if req.all_rows else 1
            if not (isinstance(msg, Result) and len(msg.tensors) == 1 and msg.tensors[0].shape == (rows, req.x.shape[1])
                    and msg.tensors[0].dtype == req.x.dtype):
                return "malformed or mismatched reply"
            if msg.deliver_at is not None and msg.deliver_at > deadline + 10.0:
                return "reply due far after the deadline"
            if msg.deliver_at is not None:
                sleep_until(release_time(msg.deliver_at, received_at))
            self.health.succeeded(target)
            return msg

    def end(self, session: str, host: str) -> None:
        """Tell the host the session is over (best effort: its cache is also dropped when old)."""
        target = self.home if self.health.alive(self.home) else CLOUD
        send_nowait(self.dealers.require(target), SplitEnd(next(self.ids), self.user, session, host).frames())


def model_eos_ids(model) -> list[int]:
    """The model's end-of-sequence token ids (its generation config's, as a list)."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def pick_token(head, hidden: np.ndarray, tag: str | None, eos: list[int], decoding=None):
    """The device's part after the split host answers: the head on the returned hidden state and
    the next token (greedy with end of sequence suppressed, or ``decoding``'s). Returns (token,
    logits). ``calibrate`` times it as the device's ``split_device_s``."""
    logits = head(to_torch(hidden, tag))[0].float()
    if decoding is not None:
        return decoding.choose(logits), logits
    scores = logits.clone()
    scores[eos] = -math.inf  # generate(min_new_tokens=...) keeps end of sequence out
    return int(scores.argmax()), logits


def generate_split(model, tokenizer, prompt: str | list[int], max_new_tokens: int, client: SplitClient, *,
                   on_token=None, arrivals=None, session_prefix: str = "s", decoding=None, pace_s: float = 0.0) -> dict:
    """Greedy generation of one prompt split-style: as :func:`slimcaching.runtime.device.offload.generate`
    (end of sequence suppressed for ``max_new_tokens`` tokens, the same report; with ``decoding``
    it picks the tokens and says when to stop), with every layer at the split host. ``pace_s``: the
    device's own part of a token is padded to it (``split_device_s`` with ``--pace``)."""
    import torch  # optional extra (hf)

    from slimcaching.runtime.device.offload import LayerRecord  # start-up: device imports this module

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    eos = model_eos_ids(model)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"][0].tolist() if isinstance(prompt, str) else list(prompt)
    session = f"{session_prefix}.{time.time_ns()}"
    lay = client.layout
    new: list[int] = []
    logits_out, steps = [], []
    pending, start = list(ids), 0
    host = client.host()
    with torch.no_grad():
        while len(new) < max_new_tokens:
            if arrivals is not None:
                sleep_until(arrivals())
            t0 = time.time()
            x = embed(torch.tensor([pending]))[0]
            tag = "bfloat16" if x.dtype == torch.bfloat16 else None
            dense0 = time.time() - t0

            def history():
                return to_numpy(embed(torch.tensor([ids + new]))[0])

            res, info = client.step(session, start, to_numpy(x), tag, history)
            if info["rebuilt"]:
                start = 0
                pending = ids + new
            t1 = time.time()
            tok, logits = pick_token(head, res.tensors[0], tag, eos, decoding)
            end = time.time()
            own = dense0 + (end - t1)
            pad = max(0.0, pace_s - own)
            if pad > 0:
                sleep_until(end + pad)
                end = time.time()
            timing = res.timing if isinstance(res.timing, dict) else {}
            layers = []
            for r in timing.get("layers") or []:
                if not isinstance(r, dict):
                    continue
                rec = LayerRecord(int(r.get("layer", 0)), list(r.get("experts") or []),
                                  {int(k): v for k, v in (r.get("route") or {}).items()}, seconds_or(r.get("seconds")),
                                  seconds_or(r.get("predicted_s")))
                rec.remote_compute_s, rec.queue_s = seconds_or(r.get("remote_compute_s")), seconds_or(r.get("queue_s"))
                layers.append(rec)
            one = len(pending) == 1
            predicted = lay.predict_split_s(client.user, info["host"], [r.experts for r in layers]) if one else None
            # where the time went: the device's embedding and head, the host's dense part (and its
            # pad) and expert layers, and the network both ways (access and relay in the modelled ratio)
            host_s = seconds_or(timing.get("compute_s")) + seconds_or(timing.get("experts_s"))
            wire = max(0.0, (seconds_or(timing.get("released"), t0) - t0) + (t1 - seconds_or(timing.get("ready"), t1)))
            via = client.via(info["host"])
            a, r = lay.access_s(client.user, via), lay.relay_s.get((via, info["host"]), 0.0)
            share = a / (a + r) if a + r > 0 else 1.0
            split_br = {"device_compute_s": own, "pace_pad_s": seconds_or(timing.get("pad_s")) + pad,
                        "remote_compute_s": host_s, "queue_s": sum(rep.queue_s for rep in layers),
                        "access_s": wire * share, "relay_s": wire * (1 - share)}
            steps.append({"forward_s": end - t0, "t0": t0, "tokens": len(pending), "measured_s": end - t0,
                          "dense_real_s": own, "dense_pad_s": pad, "predicted_s": predicted,
                          "layers": layers, "host": info["host"], "rebuilt": info["rebuilt"], "split": split_br})
            host = info["host"]
            start += len(pending)
            pending = [tok]
            new.append(tok)
            logits_out.append(logits.numpy())
            if on_token is not None and len(new) > 1:
                on_token()
            if decoding is not None and decoding.after(tok):
                break
    client.end(session, host)
    return {"tokens": new, "logits": np.stack(logits_out), "steps": steps}


def score_split(model, ids: list[int], client: SplitClient, session_prefix: str = "score"):
    """The logits of every position of ``ids`` (a prompt scored for its log-probabilities, echo):
    one step with every row's hidden state back, the head on each; the session is ended at once."""
    import torch  # optional extra (hf)

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    session = f"{session_prefix}.{time.time_ns()}"
    with torch.no_grad():
        x = embed(torch.tensor([list(ids)]))[0]
        tag = "bfloat16" if x.dtype == torch.bfloat16 else None
        res, info = client.step(session, 0, to_numpy(x), tag, lambda: to_numpy(x), all_rows=True)
        logits = head(to_torch(res.tensors[0], tag)).float()
    client.end(session, info["host"])
    return logits
