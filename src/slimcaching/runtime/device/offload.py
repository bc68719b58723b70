"""The user's device: the model's dense part in transformers, experts through the cluster.

:func:`install` replaces the ``experts`` module of every MoE block with :class:`RemoteExperts`;
router, attention, norms, shared experts and head stay the model's own. Per MoE layer the device
sends the hidden states of the tokens that need non-local experts in *one* message to the home
server (docs/runtime.md), runs its local experts meanwhile, and combines all outputs with the gate
weights exactly as the model's eager experts loop does (ascending expert id, ``out * weight``,
``index_add_``), so the output equals the monolithic model's.

Failures: no reply from the home server before the deadline (or no connection) marks it dead
for ``retry_after_s`` and re-sends the same request to the cloud directly (uplink + the home's
backhaul); experts are stateless, so the output is unchanged. A fatal error from the cluster
(no copy of an expert anywhere) raises :class:`ClusterError`.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from slimcaching.inputs.hf import find_moe_layers
from slimcaching.inputs.limits import limit
from slimcaching.runtime.cluster.layout import CLOUD, Layout
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig
from slimcaching.runtime.device.fallbacks import FallbackLog
from slimcaching.runtime.model.skeleton import load_partial_model
from slimcaching.runtime.model.tensors import output_array
from slimcaching.runtime.model.weights import expert_source, load_experts, run_expert
from slimcaching.runtime.net import protocol
from slimcaching.runtime.net.dispatch import group_by_holder, rows_of
from slimcaching.runtime.net.health import PeerHealth
from slimcaching.runtime.net.linkemu import Link, release_time, schedule_path, sleep_until
from slimcaching.runtime.net.protocol import ErrorReply, Result, RunRequest, seconds_or
from slimcaching.runtime.net.security import Keyring
from slimcaching.runtime.net.transport import Dealers, context, recv_within, send_now


class ClusterError(RuntimeError):
    """The cluster cannot serve a request (one line, e.g. no live holder of an expert)."""


@dataclass
class LayerRecord:
    """Where one MoE layer's time went on the device."""

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
    """One decoded token: its layers, measured and predicted seconds."""

    tokens: int
    layers: list[LayerRecord] = field(default_factory=list)
    t0: float = 0.0


class DeviceClient:
    """Talks to the home server (and to the cloud when the home fails) for one user."""

    def __init__(self, user: str, layout: Layout, addresses: dict[str, str], local_modules: dict, *,
                 config: RuntimeConfig = DEFAULTS, keyring: Keyring | None = None):
        if user not in layout.homes:
            raise ValueError(user)
        self.keyring = keyring  # CURVE: this device's key; each node's public key is pinned
        self.max_message_bytes = layout.max_message_bytes(limit("request_rows"))
        self.user = user
        self.home = layout.homes[user]
        self.layout = layout
        self.addresses = addresses
        self.local = local_modules  # (layer, expert) -> one-expert module
        self.config = config
        self.pace = config.pace
        emulate = config.emulate
        self.ctx = context()
        self.dealers = Dealers(self.ctx, addresses, self.max_message_bytes, keyring)
        self.ids = itertools.count(1)
        self.health = PeerHealth(config.retry_after_s)
        up, down, rtt = layout.access[user]
        inf = (float("inf"), 0.0)
        self.uplink = Link(up, rtt / 2.0) if emulate else Link(*inf)
        rate, delay = layout.hop[(self.home, CLOUD)]
        self.backhaul = Link(rate, delay) if emulate else Link(*inf)
        # with reach: an uplink to each reached server, and that server's backhaul for fail-over
        self.uplinks = {self.home: self.uplink}
        self.backhauls = {self.home: self.backhaul}
        for v in layout.vias(user)[1:]:
            vu, _, vr = layout.link_of(user, v)
            self.uplinks[v] = Link(vu, vr / 2.0) if emulate else Link(*inf)
            rate, delay = layout.hop[(v, CLOUD)]
            self.backhauls[v] = Link(rate, delay) if emulate else Link(*inf)
        self.step: StepRecord | None = None
        self.observed: list | None = None  # a list: (layer, experts) of each decoded token's layers (adapt)
        self.fallbacks: list[dict] = FallbackLog()
        self.late_replies = 0
        self.expert_seconds = 0.0  # time spent inside expert layers during the current forward
        for node in (self.home, CLOUD):  # connect early: the first request should not wait for TCP
            self.dealers.require(node)

    def close(self) -> None:
        self.dealers.close()

    def deadline_for(self, predicted: float) -> float:
        # the home may itself wait one relay deadline before falling back: leave room for it
        return self.config.deadline_factor * predicted + 3.0 * self.config.deadline_floor_s

    def run_layer(self, layer: int, x, remote: dict[int, list[int]], local: list[tuple[int, object]],
                  predicted_remote_s: float):
        """Outputs {expert: tensor (rows, h)} for ``remote`` (expert -> rows) and ``local``
        (expert, token rows tensor), with the record of where the time went."""
        import torch  # optional extra (hf)

        t0 = time.time()
        rec = LayerRecord(layer, [], {}, 0.0, 0.0)
        outputs = {}
        groups = []  # one request per reached server used (the home alone without reach)
        if remote:
            ser0 = time.time()
            tag = "bfloat16" if x.dtype == torch.bfloat16 else None
            # one request per server the radio reaches and uses (the home alone without reach)
            for part in group_by_holder(remote, lambda e: self.home if len(self.uplinks) == 1
                                        else self.layout.best_via(self.user, layer, e)[1]):
                groups.append((part.holder, output_array(rows_of(x, part.rows)), part.assign))
            rec.serialise_s += time.time() - ser0
            sent = [self._send(layer, payload, assign, tag, t0, via=via) for via, payload, assign in groups]
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
            for (_, payload, assign), one in zip(groups, sent):
                res, recv_at = self._wait(one, deadline, layer, payload, assign, tag, t0)
                ser0 = time.time()
                for e, t in zip(res.experts, res.tensors):
                    tt = torch.from_numpy(t.copy())
                    outputs[e] = tt.view(torch.bfloat16) if tag == "bfloat16" else tt
                    rec.route[e] = str(res.route.get(str(e), res.node))
                rec.serialise_s += time.time() - ser0
                for f in res.fallbacks[:8]:  # relays the node moved to another holder for us
                    if isinstance(f, dict):
                        moved = f.get("experts") if isinstance(f.get("experts"), list) else []
                        to = res.route.get(str(moved[0])) if moved else None
                        self.fallbacks.heard({"node": f.get("from"), "layer": layer, "by": res.node,
                                              "reason": f.get("reason"), "to": to})
            timing = res.timing  # the last reply's (the layer waited for it)
            remote_timing = [r for r in (timing.get("remote") or {}).values() if isinstance(r, dict)] \
                if isinstance(timing.get("remote"), dict) else []
            rec.queue_s = seconds_or(timing.get("queue_s")) + sum(seconds_or(r.get("queue_s")) for r in remote_timing)
            rec.remote_compute_s = seconds_or(timing.get("compute_s")) + max(
                [seconds_or(r.get("compute_s")) for r in remote_timing] or [0.0])
            released, ready = seconds_or(timing.get("released"), t0), seconds_or(timing.get("ready"), t0)
            deliver = res.deliver_at or recv_at
            rec.access_s = max(0.0, released - t0) + max(0.0, deliver - ready)
            rec.relay_s = max(0.0, ready - released - rec.remote_compute_s - rec.queue_s)
            rec.overhead_s = max(0.0, recv_at - deliver)
        if self.pace and local_end > time.time():
            pad0 = time.time()
            sleep_until(local_end)
            rec.pad_s = time.time() - pad0
        rec.seconds = time.time() - t0
        return outputs, rec

    def _send(self, layer, payload, assign, tag, t0, exclude: frozenset = frozenset(), via: str | None = None):
        """Send one layer request to ``via`` (the home by default, or a reached server); the cloud
        directly (``via``'s uplink and backhaul) when that server is down."""
        via = self.home if via is None else via
        alive = via not in exclude and self.health.alive(via)
        target = via if alive else CLOUD
        if target in exclude:
            raise ClusterError(f"no live home server or cloud for user {self.user!r} (layer {layer})")
        req = RunRequest(next(self.ids), self.layout.model, layer, assign, payload, relay=True, reply_user=self.user,
                         reply_hops=[] if target == via else [(CLOUD, via)], dtype_tag=tag)
        links = [self.uplinks[via]] if target == via else [self.uplinks[via], self.backhauls[via]]
        frames = protocol.stamp(req, lambda size: schedule_path(links, size, time.time()))  # encoded: ready to go
        if not send_now(self.dealers.require(target), frames, self.config.connect_grace_ms):
            return self._failed(target, "not connected", layer, payload, assign, tag, exclude, via)
        return req.id, target, exclude, via

    def _failed(self, target, reason, layer, payload, assign, tag, exclude, via):
        self.health.failed(target)
        self.fallbacks.append({"t": time.time(), "node": target, "layer": layer, "reason": reason,
                               "to": CLOUD if target != CLOUD else None})
        return self._send(layer, payload, assign, tag, time.time(), exclude | {target}, via)

    def _wait(self, sent, deadline, layer, payload, assign, tag, t0):
        rid, target, exclude, via = sent
        while True:
            now = time.time()
            sock = self.dealers.require(target)
            left = deadline - now
            if left <= 0:
                rid, target, exclude, via = self._failed(target, "no reply before the deadline", layer, payload,
                                                         assign, tag, exclude, via)
                deadline = time.time() + self.deadline_for(self.layout.relay_s[(self.home, CLOUD)])
                continue
            frames = recv_within(sock, left)
            if frames is None:
                continue
            recv_at = time.time()
            try:
                msg = protocol.parse([f.buffer for f in frames])
            except protocol.ProtocolError as exc:
                # only the node this socket talks to can have sent it: that node counts as failed
                rid, target, exclude, via = self._failed(target, f"malformed reply ({str(exc)[:80]})", layer,
                                                         payload, assign, tag, exclude, via)
                continue
            if msg.id != rid:
                self.late_replies += 1
                continue
            if isinstance(msg, ErrorReply):
                if msg.fatal and target == CLOUD:
                    raise ClusterError(msg.reason[:300])
                if msg.fatal and "no live holder" in msg.reason:
                    raise ClusterError(msg.reason[:300])
                rid, target, exclude, via = self._failed(target, msg.reason[:200], layer, payload, assign, tag,
                                                         exclude, via)
                continue
            if not (isinstance(msg, Result)
                    and msg.matches({e: len(rows) for e, rows in assign}, payload.shape[1], payload.dtype)):
                # a reply that does not answer what was asked: the sender counts as failed
                rid, target, exclude, via = self._failed(target, "malformed or mismatched reply", layer, payload,
                                                         assign, tag, exclude, via)
                continue
            if msg.deliver_at is not None and msg.deliver_at > deadline + max(10.0, 10.0 * (deadline - t0)):
                # an emulated arrival this far past the deadline is no honest reply: a forged one cannot stall us
                rid, target, exclude, via = self._failed(target, "reply due far after the deadline", layer,
                                                         payload, assign, tag, exclude, via)
                deadline = time.time() + self.deadline_for(self.layout.relay_s[(self.home, CLOUD)])
                continue
            if msg.deliver_at is not None:
                sleep_until(release_time(msg.deliver_at, recv_at))
            self.health.succeeded(target)
            return msg, recv_at



def _make_remote_experts_class():
    import torch  # optional extra (hf)

    class _RemoteExperts(torch.nn.Module):
        ROW0 = torch.zeros(1, dtype=torch.long)  # the rows of a decoded token

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
            lay = client.layout
            final = torch.zeros_like(hidden_states)
            one = hidden_states.shape[0] == 1  # a decoded token: its experts read directly, no masks
            where = {}  # expert -> (token rows, top-k slots)
            if one:
                for k, e in enumerate(idx.reshape(-1).tolist()):
                    if e < self.num_experts:
                        where[e] = (self.ROW0, k)
            else:
                idx_t = idx.reshape(hidden_states.shape[0], -1)
                for e in sorted(set(idx_t.reshape(-1).tolist())):
                    if e >= self.num_experts:  # expert-parallel sentinel, as the eager loop skips it
                        continue
                    top_k_pos, token_idx = torch.where((idx_t == e).T)
                    where[e] = (token_idx, top_k_pos)
            local = [(e, where[e][0]) for e in sorted(where) if (self.layer, e) in client.local]
            remote = {e: [0] if one else where[e][0].tolist()  # one row: no tensor to list
                      for e in sorted(where) if (self.layer, e) not in client.local}
            pred = lay.predict_remote_s(client.user, tuple(remote), self.layer)
            outputs, rec = client.run_layer(self.layer, hidden_states, remote, local, pred)
            w = weights.reshape(hidden_states.shape[0], -1)
            for e in sorted(where):
                token_idx, top_k_pos = where[e]
                if one:  # for one row, index_add_ is this add (same order, same values)
                    out = outputs[e] * w.narrow(1, top_k_pos, 1)  # narrow: w[:, k:k+1] in one call
                    final.add_(out if out.dtype == final.dtype else out.to(final.dtype))
                else:
                    out = outputs[e] * weights[token_idx, top_k_pos, None]
                    final.index_add_(0, token_idx, out.to(final.dtype))
            rec.experts = sorted(where)
            if one:
                rec.predicted_s = lay.predict_layer_s(client.user, rec.experts, self.layer)
                if client.observed is not None:
                    client.observed.append((self.layer, tuple(rec.experts)))
            if client.step is not None:
                client.step.layers.append(rec)
            client.expert_seconds += time.time() - t0
            return final

    return _RemoteExperts


def install(model, client: DeviceClient) -> int:
    """Replace every MoE block's experts with the remote version; returns the number replaced."""

    cls = _make_remote_experts_class()
    blocks = [b for b in find_moe_layers(model) if b[2] == "indices"]
    if len(blocks) != client.layout.layers:
        raise ValueError(f"{len(blocks)} MoE blocks, scenario model has {client.layout.layers} layers")
    for li, (_, block, _) in enumerate(blocks):
        block.experts = cls(li, client, client.layout.experts)
    return len(blocks)


def load_device_model(model_dir, layout: Layout, user: str):
    """The model with its dense part only (no routed expert is read from the checkpoint; remote
    ones are installed later) and the user's local experts."""
    model, config = load_partial_model(str(model_dir), drop="experts")
    source = expert_source(model_dir)
    local = load_experts(source, layout.local[user])
    return model, config, local


def generate(model, tokenizer, prompt: str | list[int], max_new_tokens: int, client: DeviceClient | None = None,
             *, pace: bool = False, dense_s: float = 0.0, dense_exec=None, on_token=None, arrivals=None,
             decoding=None) -> dict:
    """Greedy generation of one prompt (text, or token ids); with a client, one record per forward step.

    ``dense_exec(tokens)`` is the modelled dense time of a step; with ``pace`` the device pads
    its real dense compute (the step minus the time in expert layers) up to it. ``arrivals()``, if
    given, returns when the next step may start (a load generator); the wait is not measured.
    Without ``decoding`` end of sequence is suppressed for ``max_new_tokens`` tokens (the
    harness's fixed-length runs); with a :class:`~slimcaching.runtime.device.sampling.Decoding` it picks
    every token and says when to stop (a served request).
    Returns ``{"tokens", "logits", "steps"}`` (steps: prefill first, then one per decoded token).
    """
    import torch  # optional extra (hf)

    if isinstance(prompt, str):
        enc = tokenizer(prompt, return_tensors="pt")
    else:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    extra = {"min_new_tokens": max_new_tokens} if decoding is None else _decoding_hooks(decoding)
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
            out = model.generate(**enc, max_new_tokens=max_new_tokens, **extra,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                 else tokenizer.eos_token_id)
    finally:
        h1.remove()
        h2.remove()
    new = out.sequences[0, enc["input_ids"].shape[-1]:].tolist()
    logits = torch.stack([lg[0] for lg in out.logits]).float().numpy()
    return {"tokens": new, "logits": logits, "steps": steps}


def _decoding_hooks(decoding) -> dict:
    """``generate`` arguments that let ``decoding`` pick each token (a processor leaving only its
    choice, so greedy search takes it) and stop (a criterion called after each token)."""
    import torch  # optional extra (hf)
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    class Choose(LogitsProcessor):
        def __call__(self, input_ids, scores):
            tok = decoding.choose(scores[0])
            out = torch.full_like(scores, -math.inf)
            out[0, tok] = 0.0
            return out

    class After(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([decoding.after(int(input_ids[0, -1]))], dtype=torch.bool)

    return {"logits_processor": LogitsProcessorList([Choose()]),
            "stopping_criteria": StoppingCriteriaList([After()])}
