"""The cluster's keys and its operator: ``keys``, ``cluster status``, ``cluster stop``.

The runtime modules need the optional ``runtime`` extra (pyzmq) and are imported inside the
commands, so ``--help`` works without it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from slimcaching.cli.common import console, out, table
from slimcaching.cli.runtime import cluster_app
from slimcaching.errors import ScenarioError

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli

ClusterOpt = Annotated[Path, typer.Option("--cluster", help="Cluster file (nodes, keys).")]


def _require_zmq() -> None:
    try:
        import zmq  # noqa: F401 - optional extra (runtime: pyzmq)
    except ImportError:
        raise ScenarioError("runtime", "needs the runtime extra: pip install 'slimcaching[runtime]'") from None


@app.command("keys")
def keys_cmd(
    directory: Annotated[Path, typer.Argument(help="Directory for the key files (created, mode 0700).")],
    names: Annotated[str, typer.Option("--names", help="Comma-separated names: nodes, users and 'admin'.")],
) -> None:
    """Write a CURVE key pair per name: NAME.key (public) and NAME.key_secret (private, mode 0600)."""
    _require_zmq()
    from slimcaching.runtime.net.security import generate_keys  # optional extra (runtime: pyzmq)

    written = generate_keys(directory, [n.strip() for n in names.split(",") if n.strip()])
    console.print(f"wrote {len(written) // 2} key pairs to {directory} (give each host its NAME.key_secret "
                  "and every *.key)", highlight=False, soft_wrap=True)


def _nodes(cluster: Path, node: str | None):
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.runtime.cluster.context import cluster_file_data, read_cluster_file
    _require_zmq()
    from slimcaching.runtime.net.security import ADMIN, load_keyring  # optional extra (runtime: pyzmq)

    data = cluster_file_data(cluster)
    entries = data.get("nodes")
    names = list(entries) if isinstance(entries, dict) else []
    addrs = read_cluster_file(cluster, names)
    if node is not None and node not in addrs:
        raise ScenarioError("--node", f"not in the cluster file ({', '.join(addrs)})", node)
    keyring = load_keyring(data["keys"], ADMIN) if isinstance(data.get("keys"), str) else None
    return {n: a for n, a in addrs.items() if node in (None, n)}, keyring


def _each(ask, addrs: dict, names) -> dict:
    """``ask(name, address)`` for every named node at once, in the file's order: a node that does
    not answer costs its timeout once, not once per node after it."""
    from concurrent.futures import ThreadPoolExecutor  # start-up: only the operator's commands

    names = list(names)
    if not names:
        return {}
    with ThreadPoolExecutor(min(32, len(names))) as pool:
        return dict(zip(names, pool.map(lambda n: ask(n, addrs[n]), names)))


@cluster_app.command("status")
def status_cmd(
    cluster: ClusterOpt,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.05, max=60, help="Seconds to wait per node.")] = 2.0,
    wait: Annotated[float, typer.Option("--wait", min=0, max=3600, help="Ask again until every node answers or "
                                        "this many seconds have passed (for scripts that start nodes); "
                                        "exit 2 if some never answered.")] = 0.0,
) -> None:
    """Ping every node of a cluster file (as 'admin' when the file has keys): alive, experts, RSS."""
    from slimcaching.runtime.harness import admin  # optional extra (runtime: pyzmq)

    addrs, keyring = _nodes(cluster, None)
    deadline = time.monotonic() + wait
    def ping(n, a):
        return admin.status(a, keyring=keyring, node=n, timeout=timeout)

    rows = _each(ping, addrs, addrs)
    while wait and not all(rows.values()) and time.monotonic() < deadline:
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        rows.update(_each(ping, addrs, [n for n, st in rows.items() if not st]))
    if as_json:
        sys.stdout.write(json.dumps({n: ({"alive": True, "held": len(st.get("held", [])),
                                          "rss_bytes": st.get("rss_bytes"), "stats": st.get("stats")}
                                         if st else {"alive": False}) for n, st in rows.items()},
                                    allow_nan=False, default=str) + "\n")
        return
    t = table("node", "address", "state", "experts", "RSS")
    for n, st in rows.items():
        t.add_row(n, addrs[n], "up" if st else "no answer", str(len(st.get("held", []))) if st else "-",
                  f"{st['rss_bytes'] / 2**20:.0f} MiB" if st and isinstance(st.get("rss_bytes"), int) else "-")
    out.print(t)
    if wait and not all(rows.values()):
        raise ScenarioError("--wait", f"no answer within {wait:g} s from",
                            ", ".join(n for n, st in rows.items() if not st))


@cluster_app.command("stop")
def stop_cmd(
    cluster: ClusterOpt,
    node: Annotated[str | None, typer.Option("--node", help="Stop only this node.")] = None,
) -> None:
    """Stop the nodes of a cluster file (shutdown needs the 'admin' key when the file has keys)."""
    from slimcaching.runtime.harness import admin  # optional extra (runtime: pyzmq)

    addrs, keyring = _nodes(cluster, node)
    failed = []
    answers = _each(lambda n, a: admin.shutdown(a, keyring=keyring, node=n), addrs, addrs)
    for n, why in answers.items():
        console.print(f"{n}: {'stopped' if why is None else 'not stopped (' + why + ')'}", highlight=False,
                      markup=False)
        if why is not None:
            failed.append(n)
    if failed:
        raise ScenarioError("cluster", f"{len(failed)} node(s) not stopped", ", ".join(failed))
