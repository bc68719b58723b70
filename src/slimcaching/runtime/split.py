"""Split-style serving (docs/model.md §architectures; docs/runtime.md, "Split-style and hybrid
execution"): the device keeps the embedding and the head, a split host runs every layer.

Per token the device sends the new tokens' embeddings once (a ``step`` message) through its access
server, which forwards it to the split host: a server storing the model's dense part, or the cloud.
The host keeps the session's KV cache and runs the model's decoder (attention, routers, shared
experts and norms are the model's own) with each MoE block's experts module replaced: experts the
host holds run there, the others are fetched from their best holder seen from the host (another
edge server, the cloud last), exactly as ``r^n_e`` picks them. The last position's hidden state
goes back; the device applies the head and picks the next token greedily, with end-of-sequence
suppressed as ``generate(min_new_tokens=...)`` does, so the tokens equal the monolithic model's.

Fail-over: if the host does not answer (deadline, no connection, an error from the access server),
the device marks it failed and moves the session to the next host in its order (the evaluated
latency: other dense hosts, the cloud last), sending the whole token history from position 0 so
the new host rebuilds the cache; no token is lost. If the access server itself is gone, the step
goes to the cloud directly (uplink and that server's backhaul, as SlimCaching-style fail-over does).

The host's layers run in a thread of the node's process (:class:`SplitHost`), so the node's loop
keeps serving the expert requests of others meanwhile (two split hosts may need each other's
experts); it has its own sockets to the holders and hands finished replies to the loop.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from slimcaching.hf import find_moe_layers
from slimcaching.limits import limit
from slimcaching.runtime import protocol
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig
from slimcaching.runtime.dispatch import Dispatcher
from slimcaching.runtime.fallbacks import FallbackLog
from slimcaching.runtime.health import PeerHealth
from slimcaching.runtime.linkemu import Link, release_time, schedule_path, sleep_until
from slimcaching.runtime.protocol import ErrorReply, Result, SplitEnd, SplitStep
from slimcaching.runtime.routing import CLOUD, Layout
from slimcaching.runtime.tensors import to_numpy, to_torch
from slimcaching.runtime.transport import Dealers, WakePipe, context, ready_among, recv_within, send_now, send_nowait
from slimcaching.runtime.weights import run_expert


class SessionLost(RuntimeError):
    """The host has no session at that position: the device resends the history from position 0."""


# ---- the host: layers of split-style sessions in a thread of a node ------------------------------


@dataclass
class LayerReport:
    """What one MoE layer of a split step did at the host (reported back to the device)."""

    layer: int
    experts: list[int]
    route: dict
    seconds: float
    predicted_s: float
    remote_compute_s: float = 0.0
    queue_s: float = 0.0


class HostExperts:
    """The split host's side of every MoE layer: its own experts here, the others from their best
    live holder seen from the host; one socket per holder, owned by the host's thread."""

    def __init__(self, node: str, layout: Layout, experts: dict, transport, keyring, config, lock: threading.Lock):
        self.node = node
        self.layout = layout
        self.experts = experts  # (layer, expert) -> one-expert module (the node's own)
        self.transport = transport
        self.keyring = keyring
        self.config = config
        self.lock = lock
        self.dealers = Dealers(transport.ctx, transport.addresses, transport.max_message_bytes, keyring)
        self.dispatch = Dispatcher(node, layout, config)
        self.reports: list[LayerReport] | None = None
        self.expert_seconds = 0.0
        self.fallbacks: list[dict] = []

    def _sock(self, peer: str):
        return self.dealers.get(peer)

    def close(self) -> None:
        self.dealers.close()

    def run_layer(self, layer: int, x, where: dict[int, list[int]]):
        """Outputs {expert: tensor (rows, h)} of the experts in ``where`` (expert -> rows) at this
        layer, and the layer's report."""
        import torch  # optional extra (hf)

        t0 = time.time()
        lay = self.layout
        mine = {e: rows for e, rows in where.items() if (layer, e) in self.experts}
        remote = {e: rows for e, rows in where.items() if (layer, e) not in self.experts}
        report = LayerReport(layer, sorted(where), {}, 0.0,
                             max(lay.candidates(self.node, layer, e)[0][0] for e in where) if where else 0.0)
        pending = self._send(layer, x, remote, frozenset()) if remote else {}
        outputs = {}
        if mine:
            with self.lock, torch.no_grad():  # the node's loop runs these modules too
                start = time.time()
                for e, rows in mine.items():
                    outputs[e] = run_expert(self.experts[(layer, e)], x[rows])
                    report.route[e] = self.node
            if self.config.pace:
                sleep_until(start + lay.paced_exec_s(self.node, max(len(r) for r in mine.values())))
        if pending:
            got = self._collect(layer, x, remote, pending, report)
            outputs.update(got)
        report.seconds = time.time() - t0
        return outputs, report

    def _send(self, layer: int, x, remote: dict[int, list[int]], exclude: frozenset) -> dict:
        """Requests to the best live holders of ``remote``: request id -> (holder, experts, deadline)."""
        now = time.time()
        tag = "bfloat16" if str(x.dtype) == "torch.bfloat16" else None
        out = {}
        for part in self.dispatch.plan(layer, remote, exclude):
            holder, es = part.holder, part.experts
            req = self.dispatch.request(layer, part, to_numpy(x[part.rows]), tag)
            links = [self.transport.link(hp) for hp in self.dispatch.path(holder)]
            frames = protocol.stamp(req, lambda size, links=links: schedule_path(links, size, time.time()))
            sock = self._sock(holder)
            if sock is None or not send_now(sock, frames, self.config.connect_grace_ms):
                self._failed(holder, layer, es, "not connected")
                out.update(self._send(layer, x, {e: remote[e] for e in es}, exclude | {holder}))
                continue
            out[req.id] = (holder, es, self.dispatch.deadline(part, now), part.rows_per_expert())
        return out

    def _failed(self, holder: str, layer: int, experts, reason: str) -> None:
        self.dispatch.health.failed(holder)
        self.fallbacks.append({"t": time.time(), "holder": holder, "layer": layer, "experts": list(experts),
                               "reason": reason})

    def _collect(self, layer: int, x, remote: dict, pending: dict, report: LayerReport) -> dict:
        import torch  # optional extra (hf)

        outputs = {}
        width = x.shape[1]
        while pending:
            now = time.time()
            for rid, (holder, es, deadline, _) in list(pending.items()):
                if deadline <= now:  # no reply in time: the next holder
                    del pending[rid]
                    self._failed(holder, layer, es, "no reply before the deadline")
                    pending.update(self._send(layer, x, {e: remote[e] for e in es}, frozenset({holder})))
            if not pending:
                break
            socks = {self.dealers.socks[h]: h for h, *_ in pending.values() if h in self.dealers.socks}
            wait = max(0.001, min(d for _, _, d, _ in pending.values()) - time.time())
            for s in ready_among(socks, wait + 0.001):
                try:
                    frames = s.recv_multipart(copy=False)
                    received_at = time.time()
                    msg = protocol.parse([f.buffer for f in frames])
                except protocol.ProtocolError:
                    continue  # a deadline will move the experts on
                entry = pending.get(msg.id)
                if entry is None or socks[s] != entry[0]:
                    continue  # late, or not from the holder asked
                holder, es, deadline, want = entry
                del pending[msg.id]
                if isinstance(msg, Result) and msg.matches(want, width, np.dtype(to_numpy(x[:1]).dtype)):
                    if msg.deliver_at is not None:
                        sleep_until(min(release_time(msg.deliver_at, received_at), deadline))
                    for e, t in zip(msg.experts, msg.tensors):
                        tt = torch.from_numpy(np.array(t, copy=True))
                        outputs[e] = tt.view(torch.bfloat16) if x.dtype == torch.bfloat16 else tt
                        report.route[e] = holder
                    timing = msg.timing if isinstance(msg.timing, dict) else {}
                    report.remote_compute_s = max(report.remote_compute_s, _seconds(timing.get("compute_s")))
                    report.queue_s = max(report.queue_s, _seconds(timing.get("queue_s")))
                else:
                    reason = msg.reason[:200] if isinstance(msg, ErrorReply) else "malformed or mismatched reply"
                    self._failed(holder, layer, es, reason)
                    pending.update(self._send(layer, x, {e: remote[e] for e in es}, frozenset({holder})))
        return outputs


def _seconds(v, default: float = 0.0) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else default


def _make_host_experts_module():
    import torch  # optional extra (hf)

    class _SplitLayerExperts(torch.nn.Module):
        """One MoE block's experts at the split host: gate-weighted sum in ascending expert order,
        as the model's eager loop adds them."""

        def __init__(self, layer: int, host: HostExperts, num_experts: int):
            super().__init__()
            self.layer, self.host, self.num_experts = layer, host, num_experts

        def forward(self, hidden_states, *args, **kwargs):
            idx = args[0] if args else kwargs.get("top_k_index", kwargs.get("router_indices"))
            weights = args[1] if len(args) > 1 else kwargs.get("top_k_weights", kwargs.get("routing_weights"))
            final = torch.zeros_like(hidden_states)
            idx_t = idx.reshape(hidden_states.shape[0], -1)
            where = {}
            for e in sorted(set(idx_t.reshape(-1).tolist())):
                if e >= self.num_experts:
                    continue
                top_k_pos, token_idx = torch.where((idx_t == e).T)
                where[e] = (token_idx, top_k_pos)
            t1 = time.time()
            outputs, report = self.host.run_layer(self.layer, hidden_states,
                                                  {e: w[0].tolist() for e, w in where.items()})
            # only the experts' own time is theirs: routing, gathering and the weighted adds belong
            # to the dense part, as calibrate counts them (a step minus the experts), and its pad absorbs them
            self.host.expert_seconds += time.time() - t1
            for e in sorted(where):
                token_idx, top_k_pos = where[e]
                final.index_add_(0, token_idx, (outputs[e] * weights[token_idx, top_k_pos, None]).to(final.dtype))
            if self.host.reports is not None and hidden_states.shape[0] == 1:
                self.host.reports.append(report)
            return final

    return _SplitLayerExperts


@dataclass
class _Session:
    cache: object
    length: int
    last_used: float


class SplitHost:
    """The split-style sessions of one node (see the module docstring): a thread that runs the
    decoder for each ``step``, and the KV caches it keeps (``sessions`` per user and in all are
    limits: ``split_sessions_per_user``, ``split_sessions``; the least recently used is dropped)."""

    def __init__(self, name: str, layout: Layout, config, experts: dict, transport, model_dir: str, *,
                 on_error=None):
        """``experts``: the node's own (one-expert modules, run under :attr:`lock` by both the node
        and this thread); ``transport``: the node's (its context, links, addresses, keys, and the
        loop that sends the replies); ``on_error(text)``: a step failed on an exception."""
        from slimcaching.runtime.skeleton import load_partial_model  # optional extra (hf)

        self.name = name
        self.layout = layout
        self.config = config
        self.transport = transport
        self.on_error = on_error or (lambda text: None)
        self.model, _ = load_partial_model(str(model_dir), drop="experts")
        self.decoder = self.model.get_decoder()
        # transformers 5.x renamed past_key_values to cache (5.24 warns on the old name)
        self.cache_arg = "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        self.lock = threading.Lock()  # the node's executor takes it too (NodeServer.enable_split)
        self.experts = HostExperts(self.name, self.layout, experts, transport, transport.keyring, config, self.lock)
        cls = _make_host_experts_module()
        blocks = [b for b in find_moe_layers(self.model) if b[2] == "indices"]
        for li, (_, block, _) in enumerate(blocks):
            block.experts = cls(li, self.experts, self.layout.experts)
        self.sessions: collections.OrderedDict[tuple[str, str], _Session] = collections.OrderedDict()
        self.max_per_user = limit("split_sessions_per_user")
        self.max_sessions = limit("split_sessions")
        self.jobs: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.wakes = WakePipe(transport.ctx, "split")
        self.stats = {"steps": 0, "sessions_started": 0, "sessions_dropped": 0, "out_of_sync": 0}
        transport.watch(self.wakes.reader, self._deliver)
        self.thread = threading.Thread(target=self._loop, name=f"split-{self.name}", daemon=True)
        self.thread.start()

    # ---- the node's loop side ------------------------------------------------------------------
    def submit(self, ident: bytes, step: SplitStep, reply_links: list, done=None) -> None:
        """Queue ``step`` for the host's thread; ``done()`` runs in the loop when its reply is sent."""
        self.jobs.put((ident, step, reply_links, done))

    def end(self, user: str, session: str) -> None:
        self.jobs.put(("end", user, session))

    def _deliver(self) -> None:
        self.wakes.drain()
        while True:
            try:
                ident, frames, done = self.done.get_nowait()
            except queue.Empty:
                return
            if done is not None:
                done()
            self.transport.send_to_client(ident, frames)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(5)
        self.wakes.close()

    # ---- the thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        wake = self.wakes.writer()
        try:
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                if job[0] == "end":
                    self.sessions.pop((job[1], job[2]), None)
                    continue
                ident, step, reply_links, done = job
                try:
                    frames = self._run(step, reply_links)
                except SessionLost as exc:
                    self.stats["out_of_sync"] += 1
                    frames = ErrorReply(step.id, str(exc), False).frames()
                except Exception as exc:  # the step fails, the host serves on (counted, logged, answered)
                    self.on_error(f"split step failed: {type(exc).__name__}: {str(exc)[:200]}")
                    frames = ErrorReply(step.id, f"split step failed ({type(exc).__name__}: {str(exc)[:100]})",
                                        False).frames()
                self.done.put((ident, frames, done))
                wake.wake()
        finally:
            self.experts.close()
            wake.close()

    def _session(self, step: SplitStep) -> _Session:
        key = (step.user, step.session)
        if step.start == 0:
            self.sessions.pop(key, None)
            mine = [k for k in self.sessions if k[0] == step.user]
            while len(mine) >= self.max_per_user:  # the user's oldest session goes
                self.sessions.pop(mine.pop(0))
                self.stats["sessions_dropped"] += 1
            while len(self.sessions) >= self.max_sessions:
                self.sessions.popitem(last=False)
                self.stats["sessions_dropped"] += 1
            self.sessions[key] = _Session(None, 0, time.time())
            self.stats["sessions_started"] += 1
        sess = self.sessions.get(key)
        if sess is None or sess.length != step.start:
            raise SessionLost(f"step: no session {step.session!r} at position {step.start} here "
                              "(resend from position 0)")
        self.sessions.move_to_end(key)
        return sess

    def _run(self, step: SplitStep, reply_links: list) -> list:
        import torch  # optional extra (hf)

        t0 = time.time()
        lay = self.layout
        sess = self._session(step)
        x = to_torch(step.x, step.dtype_tag)
        n = x.shape[0]
        self.experts.reports = [] if n == 1 else None
        self.experts.expert_seconds = 0.0
        with torch.no_grad():
            out = self.decoder(inputs_embeds=x[None], attention_mask=torch.ones((1, sess.length + n), dtype=torch.long),
                               use_cache=True, cache_position=torch.arange(sess.length, sess.length + n),
                               **{self.cache_arg: sess.cache})
        cache = out.get("cache") if "cache" in out else out.get("past_key_values")
        sess.cache, sess.length, sess.last_used = cache, sess.length + n, time.time()
        last = out.last_hidden_state[0] if step.all_rows else out.last_hidden_state[0, -1:, :]
        end = time.time()
        dense_real = end - t0 - self.experts.expert_seconds
        pad = 0.0
        if self.config.pace:
            modelled = lay.paced_dense_s(self.name, n)
            if modelled > dense_real:
                sleep_until(end + modelled - dense_real)
                pad = time.time() - end
        self.stats["steps"] += 1
        reports = self.experts.reports or []
        timing = {"compute_s": dense_real, "pad_s": pad, "experts_s": self.experts.expert_seconds,
                  "layers": [{"layer": r.layer, "experts": r.experts, "route": {str(e): h for e, h in r.route.items()},
                              "seconds": r.seconds, "predicted_s": r.predicted_s,
                              "remote_compute_s": r.remote_compute_s, "queue_s": r.queue_s} for r in reports],
                  "released": t0, "ready": time.time()}
        res = Result(step.id, [0], [to_numpy(last)], {}, self.name, timing, self.experts.fallbacks[-20:])
        self.experts.fallbacks.clear()
        return protocol.stamp(res, lambda size: schedule_path(reply_links, size, time.time()))


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
            self._sock(node)

    def via(self, host: str) -> str:
        """The reached server a step to ``host`` goes through: the least a_{u,v} + c_{v,host} among
        the live ones."""
        now = time.time()
        live = [v for v in self.layout.vias(self.user) if self.health.alive(v, now)]
        if not live:
            return self.home
        lay = self.layout
        return min(live, key=lambda v: lay.access_s(self.user, v) + lay.relay_s.get((v, host), math.inf))

    def _sock(self, node: str):
        sock = self.dealers.get(node)
        if sock is None:
            raise KeyError(node)
        return sock

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
                from slimcaching.runtime.device import ClusterError  # start-up: device imports this module

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
        sock = self._sock(target)
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
        send_nowait(self._sock(target), SplitEnd(next(self.ids), self.user, session, host).frames())


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
    """Greedy generation of one prompt split-style: as :func:`slimcaching.runtime.device.generate`
    (end of sequence suppressed for ``max_new_tokens`` tokens, the same report; with ``decoding``
    it picks the tokens and says when to stop), with every layer at the split host. ``pace_s``: the
    device's own part of a token is padded to it (``split_device_s`` with ``--pace``)."""
    import torch  # optional extra (hf)

    from slimcaching.runtime.device import LayerRecord  # start-up: device imports this module

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
                                  {int(k): v for k, v in (r.get("route") or {}).items()}, _seconds(r.get("seconds")),
                                  _seconds(r.get("predicted_s")))
                rec.remote_compute_s, rec.queue_s = _seconds(r.get("remote_compute_s")), _seconds(r.get("queue_s"))
                layers.append(rec)
            one = len(pending) == 1
            predicted = lay.predict_split_s(client.user, info["host"], [r.experts for r in layers]) if one else None
            # where the time went: the device's embedding and head, the host's dense part (and its
            # pad) and expert layers, and the network both ways (access and relay in the modelled ratio)
            host_s = _seconds(timing.get("compute_s")) + _seconds(timing.get("experts_s"))
            wire = max(0.0, (_seconds(timing.get("released"), t0) - t0) + (t1 - _seconds(timing.get("ready"), t1)))
            via = client.via(info["host"])
            a, r = lay.access_s(client.user, via), lay.relay_s.get((via, info["host"]), 0.0)
            share = a / (a + r) if a + r > 0 else 1.0
            split_br = {"device_compute_s": own, "pace_pad_s": _seconds(timing.get("pad_s")) + pad,
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
