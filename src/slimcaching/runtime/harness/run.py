"""``slimcaching cluster run`` and ``slimcaching generate``: devices generating against a cluster,
every decoded token measured and compared with the latency model, the output compared with the
monolithic model.

Per decoded token the JSON has the measured seconds (the forward step, dense part padded to the
model with ``--pace``), the predicted seconds (docs/model.md §latency for the sets that token actually
used: ``exec_u(dense) + sum_l T_l(S_l)``) and the route of every layer, plus a breakdown of the
measured time: device compute, pacing, access links, relays, remote compute, queueing at nodes,
serialisation, and what is left (software overhead).
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.inputs.hf import load_model
from slimcaching.inputs.limits import limit
from slimcaching.runtime.cluster.context import load_context
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig
from slimcaching.runtime.device.fallbacks import describe_fallback
from slimcaching.runtime.device.modes import Device
from slimcaching.runtime.harness.report import load_comparison, run_report


@dataclass
class RunOptions:
    """Everything one ``cluster run`` needs."""

    scenario: str
    placement: str
    model_dir: str
    model_name: str | None = None
    prompts: list[str] = field(default_factory=list)
    users: list[str] = field(default_factory=list)
    max_new_tokens: int = 16
    emulate: bool = True
    pace: bool = False
    reference: bool = True
    kills: list[tuple[str, int]] = field(default_factory=list)
    restarts: list[tuple[str, int]] = field(default_factory=list)
    deadline_factor: float = DEFAULTS.deadline_factor
    deadline_floor_s: float = DEFAULTS.deadline_floor_s
    retry_after_s: float = DEFAULTS.retry_after_s
    start_timeout_s: float = DEFAULTS.start_timeout_s
    launcher: str = "local"
    ray_address: str | None = None
    rate: float | None = None  # tokens/s per user (Poisson arrivals); None: back to back
    seed: int = 0
    max_batch_rows: int = DEFAULTS.max_batch_rows  # batching across requests at the nodes (1: none)
    batch_wait_s: float = DEFAULTS.batch_wait_s
    ray_placement: dict | None = None  # --launcher ray: node -> {host} or {resources} (launch.read_ray_placement)
    adapt: object = None  # an adaptive.ControllerConfig: re-place experts live as routing drifts (one user)

    def runtime_config(self) -> RuntimeConfig:
        """The settings every node and device of this run shares."""
        return RuntimeConfig(emulate=self.emulate, pace=self.pace, deadline_factor=self.deadline_factor,
                             deadline_floor_s=self.deadline_floor_s, retry_after_s=self.retry_after_s,
                             start_timeout_s=self.start_timeout_s, max_batch_rows=self.max_batch_rows,
                             batch_wait_s=self.batch_wait_s)


def parse_events(items: list[str] | None, flag: str, nodes: list[str]) -> list[tuple[str, int]]:
    """``NODE@TOKEN`` items (``--kill``/``--restart``) as (node, token) pairs."""
    out = []
    for item in items or []:
        node, sep, tok = item.partition("@")
        if not sep or not (tok.isascii() and tok.isdigit()) or len(tok) > 12:
            raise ScenarioError(flag, "expected NODE@TOKEN", item)
        if node not in nodes:
            raise ScenarioError(flag, f"unknown node (nodes: {', '.join(nodes)})", node)
        out.append((node, int(tok)))
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size: ``VmHWM`` of /proc/self/status on Linux, which starts
    afresh at exec (``getrusage``'s ``ru_maxrss`` survives exec, so a device process started from a
    large launcher would report the launcher's size); ``getrusage`` elsewhere."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # pragma: no cover


def check_prompt_lengths(model_dir, prompts: list[str], max_new_tokens: int) -> None:
    """Every prompt, with ``max_new_tokens`` more, fits the model's context and one request's rows
    (``request_rows``): checked before any node starts or any memory is spent on a long prompt."""
    from transformers import AutoConfig, AutoTokenizer  # optional extra (hf)

    cfg = AutoConfig.from_pretrained(str(model_dir))
    cfg = getattr(cfg, "text_config", None) or cfg
    context = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
    if context is not None and max_new_tokens >= context:
        raise ScenarioError("max_new_tokens", f"must be below the model's context of {context} tokens", max_new_tokens)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = limit("request_rows")
    for i, text in enumerate(prompts):
        n = len(tok(text)["input_ids"])
        if context is not None and n + max_new_tokens > context:
            raise ScenarioError(f"prompts[{i}]", f"{n} tokens + {max_new_tokens} new ones exceed the model's "
                                f"context of {context}")
        if n > rows:
            raise ScenarioError(f"prompts[{i}]", f"{n} tokens exceed the request_rows limit of {rows} "
                                "(raise SLIMCACHING_LIMIT_REQUEST_ROWS if this is meant)")


def device_session(ctx, user: str, prompts: list[str], addresses: dict[str, str], opts: RunOptions,
                   counter=None, between_tokens=None, keyring=None, on_fallback=None, on_device=None) -> dict:
    """One user's device: load the dense part and local experts, generate every prompt (with a
    :class:`~slimcaching.runtime.net.security.Keyring`: over CURVE, the nodes' keys pinned;
    ``on_fallback(entry)`` hears of each fallback as it happens)."""
    from slimcaching.runtime.node.server import rss_bytes  # optional extra (runtime: pyzmq)

    lay = ctx.layout
    device = Device(ctx, user, addresses, opts, keyring, on_fallback=on_fallback)
    if on_device is not None:
        on_device(device)

    def tick():
        if counter is not None:  # (shared array, this device's slot): no lock needed
            counter[0][counter[1]] += 1
        if between_tokens is not None:
            between_tokens()

    arrivals = None
    if opts.rate:
        rng = np.random.default_rng([opts.seed, sorted(lay.homes).index(user)])
        clock = {"next": time.time()}

        def arrivals() -> float:
            # open-loop Poisson arrivals; a token whose arrival has passed starts at once
            at = clock["next"]
            clock["next"] = max(at, time.time()) + rng.exponential(1.0 / opts.rate)
            return at

    results = []
    try:
        for pi, prompt in enumerate(prompts):
            r = device.generate(prompt, opts.max_new_tokens, on_token=tick, arrivals=arrivals,
                                session_prefix=f"p{pi}")
            results.append({"user": user, "prompt": pi, "tokens": r["tokens"], "logits": r["logits"],
                            "steps": r["steps"]})
    finally:
        device.close()
    return {"user": user, "results": results, "fallbacks": device.client.fallbacks,
            "late_replies": device.client.late_replies, "rss_bytes": rss_bytes(), "peak_rss_bytes": peak_rss_bytes(),
            "local_experts": len(device.local), "architecture": lay.way(user)}


_COUNTER = None


class TokenCounter:
    """Decoded tokens of all devices: one lock-free slot per device in shared memory."""

    def __init__(self, devices: int):
        self.slots = mp.get_context("spawn").RawArray("q", devices)

    @property
    def value(self) -> int:
        return int(sum(self.slots))


def _init_worker(counter) -> None:
    global _COUNTER
    _COUNTER = counter


def _worker(args) -> dict:
    scenario, placement, model_dir, model_name, user, prompts, addresses, opts, slot, keyring = args
    counter = (_COUNTER, slot)
    from slimcaching.runtime.net.security import Keyring  # optional extra (runtime: pyzmq)

    try:
        ctx = load_context(scenario, placement, model_dir, model_name)
        return device_session(ctx, user, prompts, addresses, opts, counter, keyring=Keyring.from_dict(keyring))
    except Exception as exc:  # returned to the launcher as one line
        return {"user": user, "error": f"{type(exc).__name__}: {exc}"}


def run_cluster(opts: RunOptions, progress=None) -> dict:
    """Start the nodes, run the devices (several users concurrently), compare, stop everything."""
    say = progress or (lambda msg: None)
    ctx = load_context(opts.scenario, opts.placement, opts.model_dir, opts.model_name)
    if ctx.other_scenario is not None:
        say(f"note: {opts.placement}: {ctx.other_scenario}")
    lay = ctx.layout
    users = opts.users or [ctx.scenario.users[0].name]
    for u in users:
        if u not in lay.homes:
            names = [x.name for x in ctx.scenario.users]
            raise ScenarioError("users", f"unknown user (e.g. {', '.join(names[:5])})", u)
    if not opts.prompts:
        raise ScenarioError("prompts", "no prompts")
    check_prompt_lengths(ctx.model_dir, opts.prompts, opts.max_new_tokens)
    kills = list(opts.kills)
    if any(n == "cloud" for n, _ in kills):
        say("note: killing the cloud leaves experts that no edge server holds without any copy")
    reference = None
    if opts.reference:
        say("reference: monolithic model")
        reference = _reference(ctx, opts)
    if opts.adapt is not None and len(users) != 1:
        raise ScenarioError("adapt", "re-places experts for one user's device (give --users with one name)")
    # the nodes' keys and logs: removed on every way out (a kill -9 too: the nodes' reaper removes it)
    with tempfile.TemporaryDirectory(prefix="slimcaching-cluster-") as workdir:
        nodes, sessions, events, adapt_report, wall = _run_nodes(ctx, opts, users, kills, Path(workdir), say)
    report = run_report(ctx, opts, users, sessions, reference, nodes, events, wall)
    if opts.rate:
        report["load"] = load_comparison(ctx, opts, users, sessions, report)
    if adapt_report is not None:
        from slimcaching.runtime.harness.adapt import stall_report  # optional extra (runtime: msgpack)

        adapt_report.update(stall_report(report["per_token"], adapt_report["events"]))
        report["adapt"] = adapt_report
    return report


def _run_nodes(ctx, opts: RunOptions, users: list[str], kills, workdir: Path, say):
    """The run itself, with the nodes up in ``workdir``: each node's status, the sessions, the
    kill/restart events, the adaptation report and the wall seconds."""
    from slimcaching.runtime.device.offload import ClusterError  # optional extra (runtime: pyzmq)
    from slimcaching.runtime.harness.launch import Chaos, LocalCluster  # optional extra (runtime: pyzmq)

    lay = ctx.layout
    adapt_report = None
    counter = TokenCounter(len(users))
    t_start = time.time()
    say(f"starting {len(lay.nodes)} nodes ({', '.join(lay.nodes)})")
    with LocalCluster(lay.nodes, opts.scenario, opts.placement, str(ctx.model_dir), lay.model, workdir,
                      config=opts.runtime_config(), launcher=opts.launcher, ray_address=opts.ray_address,
                      users=users, progress=say, ray_placement=opts.ray_placement,
                      reap=opts.launcher == "local") as cluster:
        start_rss = {n: p.rss_at_start for n, p in cluster.nodes.items()}
        chaos = Chaos(cluster, counter, kills, opts.restarts)
        if len(users) > 1:
            chaos.start()
        try:
            say(f"generating for {', '.join(users)}")
            if len(users) == 1:
                controller = {}

                def with_device(device) -> None:
                    if opts.adapt is not None:
                        from slimcaching.runtime.harness.adapt import RuntimeController  # optional extra (runtime)

                        controller["c"] = RuntimeController(ctx, cluster, device.client, opts.adapt, say)

                def between() -> None:
                    chaos.due()
                    if "c" in controller:
                        controller["c"].on_token()

                try:
                    sessions = [device_session(ctx, users[0], opts.prompts, cluster.addresses, opts,
                                               (counter.slots, 0), between_tokens=between,
                                               keyring=cluster.keyring(users[0]),
                                               on_fallback=lambda f: say(describe_fallback(f)), on_device=with_device)]
                except ClusterError as exc:
                    raise ScenarioError("cluster", str(exc)) from None
                if "c" in controller:
                    adapt_report = controller["c"].finish()
            else:
                pool_ctx = mp.get_context("spawn")
                with pool_ctx.Pool(len(users), initializer=_init_worker, initargs=(counter.slots,)) as pool:
                    sessions = pool.map(_worker, [(opts.scenario, opts.placement, str(ctx.model_dir), lay.model,
                                                   u, opts.prompts, cluster.addresses, opts, i,
                                                   cluster.keyring(u).to_dict())
                                                  for i, u in enumerate(users)])
        finally:
            chaos.stop_flag.set()
            if chaos.is_alive():
                chaos.join(5)
        if chaos.error is not None:
            raise ScenarioError("kill/restart", f"could not act on a node ({chaos.error})")
        for s in sessions:
            if "error" in s:
                raise ScenarioError(f"device {s['user']}", s["error"])
        nodes = cluster.status()
        for n, st in nodes.items():
            st["rss_at_start_bytes"] = start_rss[n]
            st["experts_held"] = st["held"] if isinstance(st.get("held"), int) else len(lay.held[n])  # now
            if getattr(cluster.nodes[n], "ray_node", None):
                st["ray_node"] = cluster.nodes[n].ray_node  # where Ray placed it
        events = cluster.events
    return nodes, sessions, events, adapt_report, time.time() - t_start


def _reference(ctx, opts: RunOptions) -> list[dict]:
    from transformers import AutoTokenizer  # optional extra (hf)

    from slimcaching.runtime.device.offload import generate  # optional extra (runtime: pyzmq)

    model, _ = load_model(str(ctx.model_dir))
    tok = AutoTokenizer.from_pretrained(str(ctx.model_dir))
    out = []
    for pi, prompt in enumerate(opts.prompts):
        r = generate(model, tok, prompt, opts.max_new_tokens)
        out.append({"prompt": pi, "tokens": r["tokens"], "logits": r["logits"],
                    "step_s": [s["forward_s"] for s in r["steps"]]})
    del model
    return out


