"""The serving host's devices in a pool of worker processes (``slimcaching serve --device-workers N``).

A device is mostly Python (the transformers model's forward, the hooks, the client's sockets), so
the devices of one process share one interpreter lock: with distinct users, throughput stopped
growing past ~8 clients on a 2-core machine. :class:`DevicePool` runs an
:class:`~slimcaching.runtime.serving.engine.Engine` in each of N worker processes (spawned, not forked:
the parent holds threads and sockets) and pins every user to one worker (the scenario's users in
turn), so a user's requests still run one at a time on one device and devices of different
workers run in parallel.

It offers the engine's interface to the HTTP side (``submit``, ``load``, ``counts``,
``loaded_devices``, ``preload``, ``abort``, ``close``): a job goes to its user's worker as plain
values over a multiprocessing queue, and the worker's events (text, done, error) come back on one
queue that a thread of this process hands to each job's ``emit``. The queues connect this
process's own children only (nothing from the network is unpickled). Cancelling a job sends a
cancel to its worker. The pool counts requests per user itself (a device runs one at a time, so
one of a user's requests is running and the rest wait), refuses past ``max_queue`` at once, and
records the metrics of finished requests here. A worker that dies fails its open requests with a
503 and is started again on its next request; a worker whose parent is gone exits within 0.5 s.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import queue
import threading
import time

from slimcaching.runtime.cluster.context import load_context
from slimcaching.runtime.config import RuntimeConfig, as_config
from slimcaching.runtime.net.security import Keyring, load_keyring
from slimcaching.runtime.serving.engine import Busy, Engine, Job
from slimcaching.runtime.serving.metrics import NullMetrics

POLL_S = 0.5


class _Cancel(threading.Event):
    """A job's cancel flag that also tells the job's worker."""

    def __init__(self, send):
        super().__init__()
        self._send = send

    def set(self) -> None:
        if not self.is_set():
            super().set()
            self._send()


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies (a backstop to the parent check)."""
    try:
        import ctypes  # start-up of a worker: Linux prctl only

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
    except (OSError, AttributeError):
        pass


def _worker(spec: dict, jobs: multiprocessing.Queue, events: multiprocessing.Queue) -> None:
    """One worker process: an engine for the users pinned here, driven by ``jobs``."""
    _die_with_parent()
    parent = spec["parent"]
    ctx = load_context(spec["scenario"], spec["placement"], spec["model_dir"], spec["model_name"])
    rings = spec.get("rings") or {}

    def keyring_of(user: str):
        if user in rings:
            return Keyring.from_dict(rings[user])
        return load_keyring(spec["keys_dir"], user) if spec.get("keys_dir") else None

    engine = Engine(ctx, spec["addresses"], RuntimeConfig.from_dict(spec["config"]), keyring_of=keyring_of,
                    log=lambda msg: events.put(("log", msg)))
    live: dict[int, Job] = {}
    events.put(("ready", spec["index"], os.getpid()))
    try:
        while True:
            try:
                msg = jobs.get(timeout=POLL_S)
            except queue.Empty:
                if os.getppid() != parent:
                    return
                continue
            op = msg[0]
            if op == "submit":
                _, jid, user, ids, params, echo = msg

                def emit(ev, jid=jid) -> None:
                    if ev[0] in ("done", "error"):
                        live.pop(jid, None)
                    events.put(("ev", jid, ev))

                job = Job(user, ids, params, emit, echo_logprobs=echo)
                live[jid] = job
                try:
                    engine.submit(job)
                except Busy as exc:
                    emit(("error", 429, str(exc)))
            elif op == "cancel":
                job = live.get(msg[1])
                if job is not None:
                    job.cancel.set()
            elif op == "preload":
                events.put(("preloaded", msg[1], engine.preload(msg[1])))
            elif op == "abort":
                engine.abort(msg[1])
            elif op == "close":
                return
    finally:
        engine.close(timeout=2.0)
        events.put(("closed", spec["index"]))
        events.close()
        events.join_thread()  # what was put is delivered
        # nothing left to tear down: skip the interpreter's teardown (a second with torch loaded)
        os._exit(0)


class DevicePool:
    """The engine's interface over ``workers`` processes (see the module's docstring).

    ``sources``: (scenario, placement, model directory, model name) paths the workers load the
    context from; ``rings``: user -> keyring (``to_dict``) for a cluster this process started, or
    ``keys_dir`` for one it joined.
    """

    def __init__(self, ctx, addresses: dict[str, str], config, sources: tuple, *, workers: int,
                 rings: dict | None = None, keys_dir: str | None = None, metrics=None, log=None,
                 start_timeout_s: float = 300.0):
        config = as_config(config)
        self.ctx, self.config = ctx, config
        self.metrics = metrics or NullMetrics()
        self.log = log or (lambda msg: None)
        self.max_queue = config.max_queue
        self.users = [u.name for u in ctx.scenario.users]
        served = [u for u in self.users if u in ctx.layout.homes]
        self.n = max(1, int(workers))
        self.worker_of = {u: i % self.n for i, u in enumerate(served)}
        self.mp = multiprocessing.get_context("spawn")
        self.events = self.mp.Queue()
        scenario, placement, model_dir, model_name = sources
        self.spec = {"scenario": str(scenario), "placement": str(placement), "model_dir": str(model_dir),
                     "model_name": model_name, "addresses": dict(addresses), "config": config.to_dict(),
                     "rings": rings or {}, "keys_dir": keys_dir, "parent": os.getpid()}
        self.queues: list = [None] * self.n
        self.procs: list = [None] * self.n
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.jobs: dict[int, tuple[Job, int]] = {}  # job id -> (job, worker)
        self.pending: dict[str, int] = {}  # user -> requests waiting or running
        self.seen: set[str] = set()
        self.preloads: dict[str, queue.Queue] = {}
        self.ready = threading.Event()
        self.closed = False
        self._ready_count = 0
        for i in range(self.n):
            self._spawn(i)
        self.reader = threading.Thread(target=self._read, name="device-pool", daemon=True)
        self.reader.start()
        deadline = time.time() + start_timeout_s
        while self._ready_count < self.n and time.time() < deadline:
            if any(not p.is_alive() for p in self.procs):
                break
            time.sleep(0.05)
        if self._ready_count < self.n:
            self.close()
            raise RuntimeError("a device worker did not start (see the log above)")

    # ---- workers ---------------------------------------------------------------------------------
    def _spawn(self, i: int) -> None:
        q = self.mp.Queue()
        p = self.mp.Process(target=_worker, args=(dict(self.spec, index=i), q, self.events),
                            name=f"device-worker-{i}", daemon=True)
        p.start()
        self.queues[i], self.procs[i] = q, p

    def _read(self) -> None:
        while True:
            events = self.events
            if events is None:  # closed and released
                return
            try:
                msg = events.get(timeout=POLL_S)
            except queue.Empty:
                self._check_workers()
                if self.closed and not any(p.is_alive() for p in self.procs):
                    return
                continue
            except (EOFError, OSError, ValueError):  # ValueError: the queue was closed meanwhile
                return
            del events
            op = msg[0]
            if op == "ev":
                self._event(msg[1], msg[2])
            elif op == "ready":
                self._ready_count += 1
            elif op == "preloaded":
                box = self.preloads.pop(msg[1], None)
                if box is not None:
                    box.put(msg[2])
            elif op == "log":
                self.log(msg[1])

    def _event(self, jid: int, ev: tuple) -> None:
        with self.lock:
            entry = self.jobs.get(jid)
            if entry is None:
                return
            job, _ = entry
            if ev[0] in ("done", "error"):
                del self.jobs[jid]
                self.pending[job.user] = max(0, self.pending.get(job.user, 0) - 1)
        if ev[0] == "done":
            self.metrics.request_done(job.user, ev[1])
        elif ev[0] == "error" and ev[1] == 503 and str(ev[2]).startswith("cluster:"):
            self.metrics.request_failed(job.user)
        job.emit(ev)

    def _check_workers(self) -> None:
        if self.closed:
            return
        for i, p in enumerate(self.procs):
            if p is not None and not p.is_alive():
                with self.lock:
                    lost = [jid for jid, (_, w) in self.jobs.items() if w == i]
                for jid in lost:
                    self._event(jid, ("error", 503, f"device worker {i} exited (code {p.exitcode})"))
                self.log(f"device worker {i} exited (code {p.exitcode}); starting it again")
                self._spawn(i)

    # ---- the engine's interface --------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self.lock:
            if self.closed:
                raise Busy("the server is shutting down")
            if self.pending.get(job.user, 0) > self.max_queue:  # one running, max_queue waiting
                raise Busy(f"{self.max_queue} requests of user {job.user!r} are waiting already")
            w = self.worker_of[job.user]
            job.id = jid = next(self.ids)
            self.jobs[jid] = (job, w)
            self.pending[job.user] = self.pending.get(job.user, 0) + 1
            self.seen.add(job.user)
            q = self.queues[w]
        job.cancel = _Cancel(lambda: q.put(("cancel", jid)))
        q.put(("submit", jid, job.user, list(job.prompt_ids), job.params, job.echo_logprobs))

    def preload(self, user: str, timeout: float = 300.0) -> str | None:
        box: queue.Queue = queue.Queue()
        self.preloads[user] = box
        self.queues[self.worker_of[user]].put(("preload", user))
        self.seen.add(user)
        try:
            return box.get(timeout=timeout)
        except queue.Empty:
            return f"device {user} did not load within {timeout:g} s"

    def load(self) -> dict[str, int]:
        with self.lock:
            return {u: self.pending.get(u, 0) for u in self.seen}

    def counts(self) -> tuple[int, int]:
        with self.lock:
            running = sum(1 for v in self.pending.values() if v > 0)
            return running, sum(self.pending.values()) - running

    def loaded_devices(self) -> int:
        return len(self.seen)

    def abort(self, reason: str) -> None:
        with self.lock:
            self.closed = True
            jobs = list(self.jobs.items())
            self.jobs.clear()
            self.pending.clear()
        for q in self.queues:
            q.put(("abort", reason))
        for _, (job, _) in jobs:
            job.emit(("error", 503, reason))

    def close(self, timeout: float = 10.0) -> None:
        with self.lock:
            self.closed = True
        for q, p in zip(self.queues, self.procs, strict=True):
            if q is not None and p is not None and p.is_alive():
                q.put(("close",))
        deadline = time.time() + timeout
        for p in self.procs:
            if p is not None:
                p.join(max(0.0, deadline - time.time()))
                if p.is_alive():
                    p.kill()
                    p.join(2)
        reader = getattr(self, "reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(POLL_S * 5)  # it stops once the workers are gone
        self._release_queues()

    def _release_queues(self) -> None:
        """Each queue holds three named semaphores, unlinked when the queue is collected or at the
        interpreter's exit. ``serve`` ends without that exit (it is slow with torch loaded), so
        they are released here; otherwise the resource tracker warns of leaked semaphores."""
        if self.events is None:
            return
        queues = [q for q in (*self.queues, self.events) if q is not None]
        self.queues, self.events = [None] * self.n, None  # (a started Process drops its arguments)
        for q in queues:
            q.close()
            q.join_thread()
        queues = q = None  # the last references: the semaphores go with the collection
        gc.collect()
