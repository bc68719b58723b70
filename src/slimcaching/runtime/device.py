"""The user's device: the model's dense part in transformers, experts through the cluster.

:func:`install` replaces the ``experts`` module of every MoE block with :class:`RemoteExperts`;
router, attention, norms, shared experts and head stay the model's own. Per MoE layer the device
sends the hidden states of the tokens that need non-local experts in *one* message to the home
server (SPEC section 7), runs its local experts meanwhile, and combines all outputs with the gate
weights exactly as the model's eager experts loop does (ascending expert id, ``out * weight``,
``index_add_``), so the output equals the monolithic model's.

Failures: no reply from the home server before the deadline (or no connection) marks it dead
for ``retry_after_s`` and re-sends the same request to the cloud directly (uplink + the home's
backhaul); experts are stateless, so the output is unchanged. A fatal error from the cluster
(no copy of an expert anywhere) raises :class:`ClusterError`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from slimcaching.runtime import protocol
from slimcaching.runtime.linkemu import Link, schedule_path, sleep_until
from slimcaching.runtime.routing import CLOUD, Layout

CONNECT_GRACE_MS = 100  # a peer not connected after this long counts as down


class ClusterError(RuntimeError):
    """The cluster cannot serve a request (one line, e.g. no live holder of an expert)."""


@dataclass
class LayerRecord:
    layer: int
    experts: list[int]
    route: dict  # expert -> "device" or node name
    seconds: float
    predicted_s: float
    local_s: float = 0.0
    pad_s: float = 0.0
    access_s: float = 0.0
    relay_s: float = 0.0
    remote_compute_s: float = 0.0
    queue_s: float = 0.0
    serialise_s: float = 0.0
    overhead_s: float = 0.0


@dataclass
class StepRecord:
    tokens: int
    layers: list[LayerRecord] = field(default_factory=list)
    t0: float = 0.0


class DeviceClient:
    """Talks to the home server (and to the cloud when the home fails) for one user."""

    def __init__(self, user: str, layout: Layout, addresses: dict[str, str], local_modules: dict, *,
                 emulate: bool = True, pace: bool = False, deadline_factor: float = 3.0,
                 deadline_floor_s: float = 0.25, retry_after_s: float = 2.0):
        if user not in layout.homes:
            raise ValueError(user)
        self.user = user
        self.home = layout.homes[user]
        self.layout = layout
        self.addresses = addresses
        self.local = local_modules  # (layer, expert) -> one-expert module
        self.emulate = emulate
        self.pace = pace
        self.deadline_factor = deadline_factor
        self.deadline_floor_s = deadline_floor_s
        self.retry_after_s = retry_after_s
        self.ctx = zmq.Context.instance()
        self.socks: dict[str, zmq.Socket] = {}
        self.ids = itertools.count(1)
        self.dead_until: dict[str, float] = {}
        up, down, rtt = layout.access[user]
        inf = (float("inf"), 0.0)
        self.uplink = Link(up, rtt / 2.0) if emulate else Link(*inf)
        rate, delay = layout.hop[(self.home, CLOUD)]
        self.backhaul = Link(rate, delay) if emulate else Link(*inf)
        self.step: StepRecord | None = None
        self.fallbacks: list[dict] = []
        self.late_replies = 0
        self.expert_seconds = 0.0  # time spent inside expert layers during the current forward
        for node in (self.home, CLOUD):  # connect early: the first request should not wait for TCP
            self._sock(node)

    def _sock(self, node: str) -> zmq.Socket:
        if node not in self.socks:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.RECONNECT_IVL, 20)  # ms: a restarted peer is back within a few tens of ms
            s.connect(self.addresses[node])
            self.socks[node] = s
        return self.socks[node]

    def close(self) -> None:
        for s in self.socks.values():
            s.close(0)
        self.socks.clear()

    def deadline_for(self, predicted: float) -> float:
        # the home may itself wait one relay deadline before falling back: leave room for it
        return self.deadline_factor * predicted + 3.0 * self.deadline_floor_s

    def run_layer(self, layer: int, x, remote: dict[int, list[int]], local: list[tuple[int, object]],
                  predicted_remote_s: float):
        """Outputs {expert: tensor (rows, h)} for ``remote`` (expert -> rows) and ``local``
        (expert, token rows tensor), with the record of where the time went."""
        import torch

        from slimcaching.runtime.node import _to_numpy
        from slimcaching.runtime.weights import run_expert

        t0 = time.time()
        rec = LayerRecord(layer, [], {}, 0.0, 0.0)
        outputs = {}
        sent = None
        if remote:
            ser0 = time.time()
            rows = sorted({r for rs in remote.values() for r in rs})
            pos = {r: i for i, r in enumerate(rows)}
            payload = _to_numpy(x[rows])
            assign = [[e, [pos[r] for r in remote[e]]] for e in sorted(remote)]
            tag = "bfloat16" if x.dtype == torch.bfloat16 else None
            rec.serialise_s += time.time() - ser0
            sent = self._send(layer, payload, assign, tag, t0)
        # local experts run while the request travels
        if local:
            with torch.no_grad():
                lt0 = time.time()
                for e, rows_t in local:
                    outputs[e] = run_expert(self.local[(layer, e)], x[rows_t])
                    rec.route[e] = "device"
                rec.local_s = time.time() - lt0
            if self.pace:
                tokens = max(len(r) for _, r in local)
                local_end = t0 + max(self.layout.paced_exec_s("user:" + self.user, tokens), rec.local_s)
            else:
                local_end = time.time()
        else:
            local_end = t0
        if remote:
            deadline = t0 + self.deadline_for(predicted_remote_s)
            h, tensors, recv_at = self._wait(sent, deadline, layer, payload, assign, tag, t0)
            ser0 = time.time()
            for e, t in zip(h["experts"], tensors):
                tt = torch.from_numpy(np.array(t, copy=True))
                outputs[e] = tt.view(torch.bfloat16) if tag == "bfloat16" else tt
                rec.route[e] = h["route"].get(str(e), h.get("node"))
            rec.serialise_s += time.time() - ser0
            timing = h.get("timing", {})
            rec.queue_s = float(timing.get("queue_s", 0.0)) + sum(
                float(r.get("queue_s", 0.0)) for r in timing.get("remote", {}).values())
            rec.remote_compute_s = float(timing.get("compute_s", 0.0)) + max(
                [float(r.get("compute_s", 0.0)) for r in timing.get("remote", {}).values()] or [0.0])
            released, ready = float(timing.get("released", t0)), float(timing.get("ready", t0))
            deliver = float(h.get("deliver_at") or recv_at)
            rec.access_s = max(0.0, released - t0) + max(0.0, deliver - ready)
            rec.relay_s = max(0.0, ready - released - rec.remote_compute_s - rec.queue_s)
            rec.overhead_s = max(0.0, recv_at - deliver)
        if self.pace and local_end > time.time():
            pad0 = time.time()
            sleep_until(local_end)
            rec.pad_s = time.time() - pad0
        rec.seconds = time.time() - t0
        return outputs, rec

    def _target(self) -> str:
        return self.home if self.dead_until.get(self.home, 0.0) <= time.time() else CLOUD

    def _send(self, layer, payload, assign, tag, t0, exclude: frozenset = frozenset()):
        target = self._target() if self.home not in exclude else CLOUD
        if target in exclude:
            raise ClusterError(f"no live home server or cloud for user {self.user!r} (layer {layer})")
        rid = next(self.ids)
        hdr = {"op": "run", "id": rid, "model": self.layout.model, "layer": layer, "assign": assign,
               "relay": True, "reply_user": self.user, "dtype_tag": tag,
               "reply_hops": [] if target == self.home else [[CLOUD, self.home]]}
        frames = protocol.encode(hdr, [payload])
        size = protocol.message_bytes(frames)
        links = [self.uplink] if target == self.home else [self.uplink, self.backhaul]
        deliver = schedule_path(links, size, t0)
        sock = self._sock(target)
        try:
            if not sock.poll(CONNECT_GRACE_MS, zmq.POLLOUT):
                raise zmq.Again()
            sock.send_multipart(protocol.encode(dict(hdr, deliver_at=deliver), [payload]), zmq.NOBLOCK)
        except zmq.ZMQError:
            return self._failed(target, "not connected", layer, payload, assign, tag, exclude)
        return rid, target, exclude

    def _failed(self, target, reason, layer, payload, assign, tag, exclude):
        self.dead_until[target] = time.time() + self.retry_after_s
        self.fallbacks.append({"t": time.time(), "node": target, "layer": layer, "reason": reason,
                               "to": CLOUD if target != CLOUD else None})
        return self._send(layer, payload, assign, tag, time.time(), exclude | {target})

    def _wait(self, sent, deadline, layer, payload, assign, tag, t0):
        rid, target, exclude = sent
        while True:
            now = time.time()
            sock = self._sock(target)
            left = deadline - now
            if left <= 0:
                rid, target, exclude = self._failed(target, "no reply before the deadline", layer, payload,
                                                    assign, tag, exclude)
                deadline = time.time() + self.deadline_for(self.layout.relay_s[(self.home, CLOUD)])
                continue
            if not sock.poll(max(1, int(left * 1000))):
                continue
            frames = sock.recv_multipart(copy=False)
            recv_at = time.time()
            try:
                h, tensors = protocol.decode([f.buffer for f in frames])
            except protocol.ProtocolError:
                continue
            if h["id"] != rid:
                self.late_replies += 1
                continue
            if h["op"] == "error":
                if h.get("fatal") and target == CLOUD:
                    raise ClusterError(str(h.get("reason"))[:300])
                if h.get("fatal") and "no live holder" in str(h.get("reason")):
                    raise ClusterError(str(h.get("reason"))[:300])
                rid, target, exclude = self._failed(target, str(h.get("reason"))[:200], layer, payload, assign,
                                                    tag, exclude)
                continue
            if h["op"] != "result" or sorted(h.get("experts", [])) != sorted(e for e, _ in assign):
                continue
            deliver = float(h.get("deliver_at") or 0.0)
            if deliver > time.time():
                sleep_until(deliver)
            self.dead_until.pop(target, None)
            return h, tensors, recv_at


def _make_remote_experts_class():
    import torch

    class _RemoteExperts(torch.nn.Module):
        def __init__(self, layer: int, client: DeviceClient, num_experts: int):
            super().__init__()
            self.layer = layer
            self.client = client
            self.num_experts = num_experts

        def forward(self, hidden_states, *args, **kwargs):
            idx = args[0] if args else kwargs.get("top_k_index", kwargs.get("router_indices"))
            weights = args[1] if len(args) > 1 else kwargs.get("top_k_weights", kwargs.get("routing_weights"))
            t0 = time.time()
            client = self.client
            final = torch.zeros_like(hidden_states)
            idx_t = idx.reshape(hidden_states.shape[0], -1)
            hit = sorted(set(idx_t.reshape(-1).tolist()))
            where = {}
            for e in hit:
                if e >= self.num_experts:  # expert-parallel sentinel, as the eager loop skips it
                    continue
                top_k_pos, token_idx = torch.where((idx_t == e).T)
                where[e] = (token_idx, top_k_pos)
            local = [(e, where[e][0]) for e in where if (self.layer, e) in client.local]
            remote = {e: where[e][0].tolist() for e in where if (self.layer, e) not in client.local}
            lay = client.layout
            pred = lay.access_s(client.user) + max(
                [lay.candidates(client.home, self.layer, e)[0][0] for e in remote] or [0.0])
            outputs, rec = client.run_layer(self.layer, hidden_states, remote, local, pred)
            for e in sorted(where):
                token_idx, top_k_pos = where[e]
                out = outputs[e] * weights[token_idx, top_k_pos, None]
                final.index_add_(0, token_idx, out.to(final.dtype))
            rec.experts = sorted(where)
            if hidden_states.shape[0] == 1:
                rec.predicted_s = lay.predict_layer_s(client.user, rec.experts, self.layer)
            if client.step is not None:
                client.step.layers.append(rec)
            client.expert_seconds += time.time() - t0
            return final

    return _RemoteExperts


def install(model, client: DeviceClient) -> int:
    """Replace every MoE block's experts with the remote version; returns the number replaced."""
    from slimcaching.hf import find_moe_layers

    cls = _make_remote_experts_class()
    blocks = [b for b in find_moe_layers(model) if b[2] == "indices"]
    if len(blocks) != client.layout.layers:
        raise ValueError(f"{len(blocks)} MoE blocks, scenario model has {client.layout.layers} layers")
    for li, (_, block, _) in enumerate(blocks):
        block.experts = cls(li, client, client.layout.experts)
    return len(blocks)


def load_device_model(model_dir, layout: Layout, user: str):
    """The model with its dense part (experts replaced later) and the user's local experts."""
    import torch  # noqa: F401

    from slimcaching.hf import load_model
    from slimcaching.runtime.weights import expert_source, load_experts

    model, config = load_model(str(model_dir))
    source = expert_source(model_dir)
    local = load_experts(source, layout.local[user])
    return model, config, local


def generate(model, tokenizer, prompt: str, max_new_tokens: int, client: DeviceClient | None = None,
             *, pace: bool = False, dense_s: float = 0.0, dense_exec=None, on_token=None, arrivals=None) -> dict:
    """Greedy generation of one prompt; with a client, one record per forward step.

    ``dense_exec(tokens)`` is the modelled dense time of a step; with ``pace`` the device pads
    its real dense compute (the step minus the time in expert layers) up to it. ``arrivals()``, if
    given, returns when the next step may start (a load generator); the wait is not measured.
    Returns ``{"tokens", "logits", "steps"}`` (steps: prefill first, then one per decoded token).
    """
    import torch

    enc = tokenizer(prompt, return_tensors="pt")
    steps: list[dict] = []
    state = {}

    def pre(module, args, kwargs):
        if arrivals is not None:
            sleep_until(arrivals())
        state["t0"] = time.time()
        if client is not None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            n = int(ids.shape[-1]) if ids is not None else 1
            client.step = StepRecord(n, [], state["t0"])
            client.expert_seconds = 0.0

    def post(module, args, kwargs, output):
        end = time.time()
        fwd = end - state["t0"]
        rec = {"forward_s": fwd, "t0": state["t0"]}
        if client is not None:
            step = client.step
            dense_real = fwd - client.expert_seconds
            pad = 0.0
            modelled = dense_exec(step.tokens) if dense_exec else 0.0
            if pace and modelled > dense_real:
                sleep_until(end + modelled - dense_real)
                pad = time.time() - end
            rec.update(tokens=step.tokens, measured_s=fwd + pad, dense_real_s=dense_real, dense_pad_s=pad,
                       predicted_s=(dense_s + sum(r.predicted_s for r in step.layers)) if step.tokens == 1 else None,
                       layers=step.layers)
            client.step = None
            if on_token is not None and step.tokens == 1:
                on_token()
        steps.append(rec)

    h1 = model.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = model.register_forward_hook(post, with_kwargs=True)
    try:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                 else tokenizer.eos_token_id)
    finally:
        h1.remove()
        h2.remove()
    new = out.sequences[0, enc["input_ids"].shape[-1]:].tolist()
    logits = torch.stack([lg[0] for lg in out.logits]).float().numpy()
    return {"tokens": new, "logits": logits, "steps": steps}
