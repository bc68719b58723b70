"""Who may talk to a node: CURVE key pairs, the keyring each process holds, and the rules per op.

ZeroMQ's CURVE mechanism (CurveZMQ: Curve25519 key exchange, every frame encrypted and
authenticated) secures every connection when a cluster has keys. Each participant -- an edge
server, the cloud, a user's device, the operator (``admin``) -- has a key pair: ``NAME.key`` holds
the public key, ``NAME.key_secret`` (mode 0600) the secret one, in ZeroMQ's certificate format
(``slimcaching keys DIR --names ...`` writes them). A node is a CURVE server: its ZAP handler
(:class:`Gatekeeper`) admits only public keys of the keyring and tags every message with the
sender's name, and :func:`allowed` says which ops each kind of sender may use. Every client pins
the public key of the node it connects to, so a process that takes over a node's port cannot pass
for it. docs/runtime.md ("Security") has the threat model.

Without keys (a loopback-only test cluster) there is no authentication: a node then refuses to
listen on anything but loopback unless told ``insecure``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from slimcaching.errors import ScenarioError

ADMIN = "admin"
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
ZAP_DOMAIN = b"slimcaching"
_KEY_LINE = re.compile(rb'^\s*(public|secret)-key\s*=\s*"([0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40})"\s*$')


@dataclass
class Keyring:
    """The keys one process holds: its own pair and the public keys of everyone it may talk to."""

    name: str
    secret: bytes  # z85, 40 bytes
    public_keys: dict[str, bytes] = field(default_factory=dict)  # name -> z85 public key

    @property
    def public(self) -> bytes:
        return self.public_keys[self.name]

    def key_of(self, name: str) -> bytes:
        """The public key of ``name`` (a node this process connects to)."""
        try:
            return self.public_keys[name]
        except KeyError:
            raise ScenarioError("keys", f"no public key for {name!r} ({name}.key)") from None

    def name_of(self, public_key: bytes) -> str | None:
        """Whose key this is (``public_key`` raw, 32 bytes, as ZAP gives it), or None."""
        z = z85.encode(public_key) if len(public_key) == 32 else public_key
        for n, k in self.public_keys.items():
            if k == z:
                return n
        return None

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server with this process's key (clients are checked by ZAP)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def client(self, sock: zmq.Socket, server: str) -> None:
        """Make ``sock`` a CURVE client that only talks to ``server``'s key."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.key_of(server)

    def to_dict(self) -> dict:
        """Plain strings, to hand a keyring to a Ray actor (never sent on the data path)."""
        return {"name": self.name, "secret": self.secret.decode(),
                "public_keys": {n: k.decode() for n, k in self.public_keys.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> Keyring:
        return cls(data["name"], data["secret"].encode(), {n: k.encode() for n, k in data["public_keys"].items()})


def check_name(name: str, what: str = "name") -> str:
    """``name`` if it can name a key file (1-64 letters, digits, ``.``, ``_``, ``-``)."""
    if not isinstance(name, str) or not NAME.match(name):
        raise ScenarioError(what, "expected 1-64 letters, digits, '.', '_' or '-'", name)
    return name


def _write_key_file(path: Path, banner: str, public: bytes, secret: bytes | None) -> None:
    # created with its final mode: a secret key is never readable by others, not even briefly
    mode = 0o600 if secret is not None else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"#   ****  Generated on {datetime.datetime.now():%Y-%m-%d %H:%M:%S} by slimcaching  ****\n"
                 f"#   {banner}\n\nmetadata\ncurve\n    public-key = \"{public.decode()}\"\n")
        if secret is not None:
            fh.write(f"    secret-key = \"{secret.decode()}\"\n")


def generate_keys(directory: str | Path, names: list[str]) -> list[Path]:
    """A key pair per name in ``directory`` (created with mode 0700 if missing); refuses to
    overwrite existing keys. Returns the files written."""
    d = Path(directory)
    names = [check_name(n, "--names") for n in names]
    if not names:
        raise ScenarioError("--names", "give at least one name")
    if len(set(names)) != len(names):
        raise ScenarioError("--names", "names repeat", ",".join(names))
    if d.exists() and not d.is_dir():
        raise ScenarioError("directory", "exists and is not a directory", str(d))
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    for n in names:
        for suffix in (".key", ".key_secret"):
            if (d / f"{n}{suffix}").exists():
                raise ScenarioError("directory", f"{n}{suffix} exists already (keys are never overwritten)",
                                    str(d / f"{n}{suffix}"))
    written = []
    for n in names:
        public, secret = zmq.curve_keypair()
        _write_key_file(d / f"{n}.key", "ZeroMQ CURVE Public Certificate", public, None)
        _write_key_file(d / f"{n}.key_secret", "ZeroMQ CURVE **Secret** Certificate (keep it to yourself)",
                        public, secret)
        written += [d / f"{n}.key", d / f"{n}.key_secret"]
    return written


def _read_key_file(path: Path, want_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        st = os.stat(path)
    except OSError:
        raise ScenarioError("keys", "key file not found", str(path)) from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
        raise ScenarioError("keys", "not a key file (a regular file of at most 4 KiB)", str(path))
    if want_secret and st.st_mode & 0o077:
        raise ScenarioError("keys", f"secret key is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                            "chmod 600 it", str(path))
    found: dict[bytes, bytes] = {}
    for line in path.read_bytes().splitlines():
        m = _KEY_LINE.match(line)
        if m:
            found[m.group(1)] = m.group(2)
    if b"public" not in found or (want_secret and b"secret" not in found):
        raise ScenarioError("keys", "no CURVE key in the file", str(path))
    return found[b"public"], found.get(b"secret")


def load_keyring(directory: str | Path, name: str) -> Keyring:
    """``name``'s secret key and every public key (``*.key``) of ``directory``."""
    d = Path(directory)
    if not d.is_dir():
        raise ScenarioError("keys", "key directory not found", str(d))
    public, secret = _read_key_file(d / f"{check_name(name)}.key_secret", True)
    keys = {}
    for p in sorted(d.glob("*.key")):
        if NAME.match(p.stem):
            keys[p.stem] = _read_key_file(p, False)[0]
    if keys.get(name, public) != public:
        raise ScenarioError("keys", f"{name}.key and {name}.key_secret do not belong together", str(d))
    keys[name] = public
    return Keyring(name, secret, keys)


def ephemeral_keyrings(names: list[str]) -> dict[str, Keyring]:
    """Fresh key pairs for one run (the local launcher's), one keyring per name."""
    pairs = {n: zmq.curve_keypair() for n in names}
    public = {n: p for n, (p, _) in pairs.items()}
    return {n: Keyring(n, s, dict(public)) for n, (_, s) in pairs.items()}


def write_keyring_dir(directory: Path, rings: dict[str, Keyring], public: dict[str, bytes] | None = None) -> None:
    """The pairs of ``rings`` and the ``public`` keys into ``directory`` (mode 0700), as
    ``slimcaching keys`` writes them (what :func:`load_keyring` reads)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for n, key in (public or {}).items():
        if n not in rings:
            _write_key_file(directory / f"{n}.key", "ZeroMQ CURVE Public Certificate", key, None)
    for n, ring in rings.items():
        _write_key_file(directory / f"{n}.key", "ZeroMQ CURVE Public Certificate", ring.public, None)
        _write_key_file(directory / f"{n}.key_secret", "ZeroMQ CURVE **Secret** Certificate", ring.public,
                        ring.secret)


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


# ---- who may do what --------------------------------------------------------------------------

def allowed(op: str, sender: str | None, *, nodes, users, accepts_configure: bool) -> str | None:
    """Why ``sender`` may not send ``op`` to a node (None if it may).

    ``sender`` is the authenticated name (None on an unauthenticated, loopback-only cluster, where
    every op but a refused ``configure`` is allowed). ``run``, ``step`` and ``end``: devices and nodes
    (what each may ask is checked with the message); ``ping``: anyone
    the keyring knows; ``configure``: the operator, and only on a node that takes its peers from
    the launcher; ``shutdown`` and ``relayout``: the operator."""
    if op == "configure" and not accepts_configure:
        return "configure: this node takes its peers from its cluster file"
    if sender is None:
        return None
    if op in ("run", "step", "end"):
        return None if sender in nodes or sender in users else f"{op}: {sender!r} is neither a device nor a node"
    if op == "ping":
        return None
    if op in ("configure", "shutdown", "relayout"):
        return None if sender == ADMIN else f"{op}: only {ADMIN!r} may"
    return f"{op}: not a request"


class Gatekeeper:
    """The ZAP handler of one node's context: admits keys of the keyring (CURVE) or, on an
    unauthenticated cluster, any peer (NULL), up to ``max_connections`` connections at once.

    It runs in the node's own loop (its REP socket polled with the others), so no thread is
    needed. The cluster's own nodes and ``admin`` (``exempt``) are admitted even at the cap, so a
    flood of devices cannot cut a node off its peers or its operator. Connections counted are the
    admitted ones still open: every connection ends with a ``DISCONNECTED`` event, and one that
    never completed its handshake had a ``HANDSHAKE_FAILED`` event first, so open admitted =
    admitted - disconnected + failed (libzmq 4.3's events)."""

    _FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
               | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def __init__(self, ctx: zmq.Context, keyring: Keyring | None, max_connections: int, log,
                 exempt: frozenset = frozenset()):
        self.keyring = keyring
        self.max_connections = max_connections
        self.exempt = exempt  # names always admitted (the cluster's nodes and its operator)
        self.log = log
        self.sock = ctx.socket(zmq.REP)
        self.sock.linger = 0
        self.sock.bind("inproc://zeromq.zap.01")
        self.monitor: zmq.Socket | None = None
        self.admitted = self.disconnected = self.failed = 0
        self.refused = {"unknown_key": 0, "too_many_connections": 0, "mechanism": 0}

    @property
    def connections(self) -> int:
        """Admitted connections still open."""
        return max(0, self.admitted - self.disconnected + self.failed)

    def watch(self, router: zmq.Socket) -> zmq.Socket:
        self.monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED | self._FAILED)
        return self.monitor

    def on_monitor(self) -> None:
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.disconnected += 1
            elif event & self._FAILED:
                self.failed += 1

    def on_request(self) -> None:
        if self.monitor is not None:
            self.on_monitor()  # count the connection being authenticated first
        while True:
            try:
                msg = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.sock.send_multipart(self._answer(msg))

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = msg[:6]

        def deny(why: str, counter: str) -> list[bytes]:
            self.refused[counter] += 1
            self.log(f"refused a connection from {address.decode(errors='replace')[:60]}: {why}")
            return [version, request_id, b"400", why.encode(), b"", b""]

        if self.keyring is None:
            if mechanism != b"NULL":
                return deny("unexpected security mechanism", "mechanism")
            who = ""
        else:
            if mechanism != b"CURVE" or len(msg) < 7:
                return deny("CURVE required", "mechanism")
            who = self.keyring.name_of(msg[6])
            if who is None:
                return deny("unknown key", "unknown_key")
        if self.connections >= self.max_connections and who not in self.exempt:
            return deny(f"{self.max_connections} connections open already", "too_many_connections")
        self.admitted += 1
        return [version, request_id, b"200", b"OK", who.encode(), b""]

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(0)
        self.sock.close(0)
