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
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from slimcaching.inputs.hf import find_moe_layers
from slimcaching.inputs.limits import limit
from slimcaching.runtime.cluster.layout import Layout
from slimcaching.runtime.model.tensors import to_numpy, to_torch
from slimcaching.runtime.model.weights import run_expert
from slimcaching.runtime.net import protocol
from slimcaching.runtime.net.dispatch import Dispatcher
from slimcaching.runtime.net.linkemu import release_time, schedule_path, sleep_until
from slimcaching.runtime.net.protocol import ErrorReply, Result, SplitStep, seconds_or
from slimcaching.runtime.net.transport import (
    Dealers,
    WakePipe,
    ready_among,
    send_now,
)


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
                    report.remote_compute_s = max(report.remote_compute_s, seconds_or(timing.get("compute_s")))
                    report.queue_s = max(report.queue_s, seconds_or(timing.get("queue_s")))
                else:
                    reason = msg.reason[:200] if isinstance(msg, ErrorReply) else "malformed or mismatched reply"
                    self._failed(holder, layer, es, reason)
                    pending.update(self._send(layer, x, {e: remote[e] for e in es}, frozenset({holder})))
        return outputs



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
        from slimcaching.runtime.model.skeleton import load_partial_model  # optional extra (hf)

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
