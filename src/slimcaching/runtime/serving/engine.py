"""The serving engine behind ``slimcaching serve``: one device per scenario user, each a thread
that owns its model part and its client to the cluster, taking that user's requests in order.

A request is a :class:`Job`: prompt token ids, :class:`~slimcaching.runtime.device.sampling.SamplingParams`,
and a callback that receives its events from the device's thread (``("text", delta)``, then
``("done", info)`` or ``("error", status, message)``). A device generates one request at a time,
as a phone would; different users' devices generate at once and meet at the nodes. Devices are
loaded on a user's first request and the least recently used idle one is closed when
``max_devices`` are loaded. Each device queues at most ``max_queue`` requests; more are refused
(:class:`Busy`) rather than held without bound.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from slimcaching.runtime.config import as_config
from slimcaching.runtime.device.modes import Device
from slimcaching.runtime.device.sampling import Decoding, SamplingParams, eos_ids, token_logprobs
from slimcaching.runtime.serving.metrics import NullMetrics


class Busy(RuntimeError):
    """The request cannot be queued now (too many waiting, or every device slot busy)."""


@dataclass
class Job:
    """One request for one user's device."""

    user: str
    prompt_ids: list[int]
    params: SamplingParams
    emit: object  # emit(event): called from the device's thread
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.time)
    id: int = 0
    released: bool = False  # the HTTP side is done with it (its in-progress count returned)
    echo_logprobs: int | None = None  # with echo: the prompt's log-probabilities (this many alternatives)


class DeviceWorker(threading.Thread):
    """One user's device as a thread: loads on start, then serves its queue until closed."""

    def __init__(self, engine: Engine, user: str):
        super().__init__(name=f"device-{user}", daemon=True)
        self.engine, self.user = engine, user
        self.jobs: queue.Queue = queue.Queue()
        self.busy = False
        self.current: Job | None = None
        self.loaded = threading.Event()
        self.load_error: str | None = None
        self.device = None

    def run(self) -> None:
        eng = self.engine
        try:
            self.device = Device(eng.ctx, self.user, eng.addresses, eng.config, eng.keyring_of(self.user))
            self.eos = eos_ids(self.device.model, self.device.tokenizer)
        except Exception as exc:  # the jobs waiting get the reason; the next request tries again
            self.load_error = f"device {self.user} could not start ({type(exc).__name__}: {str(exc)[:200]})"
            eng.log(self.load_error)
            eng.forget(self)
        finally:
            self.loaded.set()
        try:
            while True:
                try:
                    job = self.jobs.get(timeout=0.1) if self.load_error else self.jobs.get()
                except queue.Empty:
                    return  # forgotten after a failed load: nothing is waiting any more
                if job is None:
                    return
                self.busy, self.current = True, job
                try:
                    self._serve(job)
                finally:
                    self.busy, self.current = False, None
        finally:
            if self.device is not None:
                self.device.close()

    def _serve(self, job: Job) -> None:
        eng = self.engine
        if self.load_error is not None:
            job.emit(("error", 503, self.load_error))
            return
        if job.cancel.is_set():  # its client left while it waited
            info = {"finish_reason": "cancelled", "prompt_tokens": len(job.prompt_ids), "completion_tokens": 0,
                    "queued_s": time.time() - job.submitted_at, "first_token_s": 0.0, "generate_s": 0.0,
                    "token_measured_s": [], "token_predicted_s": [], "prompt_logprobs": None}
            eng.metrics.request_done(self.user, info)
            job.emit(("done", info))
            return
        from slimcaching.runtime.device.offload import ClusterError  # optional extra (runtime: pyzmq)

        started = time.time()
        first: dict = {}

        def emit_text(delta: str, logprobs: list) -> None:
            first.setdefault("at", time.time())
            job.emit(("text", delta, logprobs))

        dec = Decoding(job.params, self.device.tokenizer, self.eos, emit=emit_text, cancel=job.cancel,
                       prompt_ids=list(job.prompt_ids))
        try:
            prompt_lp = None
            if job.echo_logprobs is not None:  # the prompt through the cluster once more, every position kept
                prompt_lp = token_logprobs(self.device.score(job.prompt_ids)[:-1], job.prompt_ids[1:],
                                           job.echo_logprobs)
            r = self.device.generate(job.prompt_ids, job.params.max_tokens, session_prefix=f"r{job.id}",
                                     decoding=dec)
        except ClusterError as exc:
            eng.metrics.request_failed(self.user)
            job.emit(("error", 503, f"cluster: {str(exc)[:300]}"))
            return
        except Exception as exc:  # a bug: this request fails, the device serves on
            eng.metrics.request_failed(self.user)
            eng.log(f"device {self.user}: internal error: {type(exc).__name__}: {str(exc)[:200]}")
            job.emit(("error", 500, f"internal error ({type(exc).__name__})"))
            return
        steps = [s for s in r["steps"] if s.get("tokens") == 1 and s.get("measured_s") is not None]
        info = {"finish_reason": dec.finish_reason or "length", "prompt_tokens": len(job.prompt_ids),
                "completion_tokens": len(r["tokens"]), "queued_s": started - job.submitted_at,
                "first_token_s": (first.get("at", time.time()) - job.submitted_at),
                "generate_s": time.time() - started,
                "token_measured_s": [s["measured_s"] for s in steps],
                "token_predicted_s": [s["predicted_s"] for s in steps], "prompt_logprobs": prompt_lp}
        eng.metrics.request_done(self.user, info)
        job.emit(("done", info))


class Engine:
    """Devices for the scenario's users against running nodes (``addresses``)."""

    def __init__(self, ctx, addresses: dict[str, str], config, *, keyring_of=None, metrics=None, log=None,
                 max_devices: int | None = None, max_queue: int | None = None):
        config = as_config(config)  # a RuntimeConfig, or options that carry one
        self.ctx, self.addresses, self.config = ctx, addresses, config
        self.keyring_of = keyring_of or (lambda user: None)
        self.metrics = metrics or NullMetrics()
        self.log = log or (lambda msg: None)
        self.max_devices = config.max_devices if max_devices is None else max_devices
        self.max_queue = config.max_queue if max_queue is None else max_queue
        self.workers: OrderedDict[str, DeviceWorker] = OrderedDict()
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.users = [u.name for u in ctx.scenario.users]
        self.closed = False

    def submit(self, job: Job) -> None:
        """Queue ``job`` on its user's device (loading the device if needed); :class:`Busy` when
        that device has ``max_queue`` requests waiting or every device slot is busy."""
        with self.lock:
            if self.closed:
                raise Busy("the server is shutting down")
            w = self.workers.get(job.user)
            if w is None:
                if len(self.workers) >= self.max_devices:
                    idle = [u for u, x in self.workers.items() if not x.busy and x.jobs.empty()]
                    if not idle:
                        raise Busy(f"all {self.max_devices} device slots are busy")
                    self.workers.pop(idle[0]).jobs.put(None)  # the least recently used idle device
                w = DeviceWorker(self, job.user)
                self.workers[job.user] = w
                w.start()
            self.workers.move_to_end(job.user)
            if w.jobs.qsize() >= self.max_queue:
                raise Busy(f"{self.max_queue} requests of user {job.user!r} are waiting already")
            job.id = next(self.ids)
            w.jobs.put(job)

    def preload(self, user: str, timeout: float = 300.0) -> str | None:
        """Load ``user``'s device now (the first request should not wait for it); None, or why it failed."""
        with self.lock:
            w = self.workers.get(user)
            if w is None:
                w = self.workers[user] = DeviceWorker(self, user)
                w.start()
        w.loaded.wait(timeout)
        return w.load_error

    def forget(self, worker: DeviceWorker) -> None:
        """Drop a device that failed to load, so that the user's next request starts a new one."""
        with self.lock:
            if self.workers.get(worker.user) is worker:
                del self.workers[worker.user]

    def loaded_devices(self) -> int:
        return len(self.workers)

    def load(self) -> dict[str, int]:
        """Requests waiting or running per user whose device is loaded (an unloaded user has none)."""
        with self.lock:
            return {u: w.jobs.qsize() + (1 if w.busy else 0) for u, w in self.workers.items()}

    def counts(self) -> tuple[int, int]:
        """(requests running, requests waiting) over every device."""
        with self.lock:
            workers = list(self.workers.values())
        running = sum(1 for w in workers if w.busy)
        return running, sum(max(0, w.jobs.qsize()) for w in workers)

    def abort(self, reason: str) -> None:
        """Refuse new requests and answer every queued or running one with a 503 ``reason`` now
        (a running one also stops at its next token); the devices stay until :meth:`close`."""
        with self.lock:
            self.closed = True
            workers = list(self.workers.values())
        for w in workers:
            while True:
                try:
                    job = w.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    w.jobs.put(None)
                    break
                job.emit(("error", 503, reason))
            job = w.current
            if job is not None:
                job.cancel.set()
                job.emit(("error", 503, reason))

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what is queued or running, stop every device (its sockets closed)."""
        with self.lock:
            self.closed = True
            workers = list(self.workers.values())
            self.workers.clear()
        for w in workers:
            while True:
                try:
                    job = w.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.emit(("error", 503, "the server is shutting down"))
            if w.current is not None:
                w.current.cancel.set()
            w.jobs.put(None)
        deadline = time.time() + timeout
        for w in workers:
            w.join(max(0.0, deadline - time.time()))
