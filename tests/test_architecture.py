"""The package's shape: no import circles, no private names borrowed across modules, and imports
inside functions only where a comment says why (an optional extra or measured start-up cost).

Read with the standard library's ``ast``; imports inside functions count like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "slimcaching"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path):
    """Yield (node, imported module, imported name or None) for every slimcaching import."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "slimcaching":
                for alias in node.names:
                    yield node, mod, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "slimcaching":
                    yield node, alias.name, None


def _targets(importer: str, mod: str, attr: str | None) -> list[str]:
    """Modules an import runs: the module (or the submodule it names) and, when the importer is
    outside it, the packages above it (their ``__init__`` runs first)."""
    full = f"{mod}.{attr}" if attr else mod
    target = full if full in MODULES else mod
    out = [target]
    parts = target.split(".")
    for k in range(1, len(parts)):
        pkg = ".".join(parts[:k])
        if pkg in MODULES and not importer.startswith(pkg + ".") and importer != pkg:
            out.append(pkg)
    return [t for t in out if t in MODULES and t != importer]


def import_graph() -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(MODULES)
    for name, path in MODULES.items():
        for _, mod, attr in _imports(name, path):
            for target in _targets(name, mod, attr):
                g.add_edge(name, target)
    return g


def test_no_import_cycles():
    cycles = sorted(nx.simple_cycles(import_graph()), key=len)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_no_private_names_across_modules():
    bad = []
    for name, path in MODULES.items():
        for node, mod, attr in _imports(name, path):
            if attr is None or f"{mod}.{attr}" in MODULES or mod == name:
                continue
            if attr.startswith("_"):
                bad.append(f"{name} imports {mod}.{attr} (line {node.lineno})")
            # a private module is private to its package
            private = [p for p in mod.split(".") if p.startswith("_")]
            if private and not name.startswith(mod.rsplit(".", 1)[0] + "."):
                bad.append(f"{name} imports private module {mod} (line {node.lineno})")
    assert not bad, "\n".join(bad)


def test_the_graph_sees_a_circle():
    """The check itself can fail: a made-up circle through two real modules is found."""
    g = import_graph()
    g.add_edge("slimcaching.system.latency", "slimcaching.system.problem")
    assert any("slimcaching.system.latency" in c for c in nx.simple_cycles(g))


def test_imports_inside_functions_say_why():
    """An import inside a function is for an optional extra or a measured start-up cost; a comment
    on its line or the line above says which (``optional extra`` / ``start-up``)."""
    bad = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    here = " ".join(lines[max(node.lineno - 3, 0):node.end_lineno]).lower()
                    if "optional extra" not in here and "start-up" not in here:
                        bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not bad, f"{len(bad)} imports inside functions without a reason: " + ", ".join(sorted(set(bad))[:40])


def test_public_functions_and_classes_have_docstrings():
    missing = []
    for name, path in MODULES.items():
        if name.startswith("slimcaching.cli"):  # typer takes the command docstrings as help (tested there)
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                if not ast.get_docstring(node):
                    missing.append(f"{name}.{node.name}")
    assert not missing, "no docstring: " + ", ".join(missing)


def test_cli_modules_stay_thin():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "cli").glob("*.py")}
    assert sizes and max(sizes.values()) <= 250, sizes


def _layer(module: str) -> str:
    """cli, runtime, experiments or planner (everything else: the model, algorithms, evaluation);
    the command's entry point (``__main__``, which guards the CLI's imports) sits above them all."""
    if module == "slimcaching.__main__":
        return "entry"
    for layer in ("cli", "runtime", "experiments"):
        if module == f"slimcaching.{layer}" or module.startswith(f"slimcaching.{layer}."):
            return layer
    return "planner"


# who may import whom, by layer: the planner knows nothing of running it, the runtime nothing of the CLI
FORBIDDEN = {"planner": {"runtime", "cli", "experiments"}, "runtime": {"cli", "experiments"},
             "experiments": {"cli"}}


def layering_violations(graph: nx.DiGraph) -> list[str]:
    return sorted(f"{a} -> {b}" for a, b in graph.edges if _layer(b) in FORBIDDEN.get(_layer(a), ()))


def test_layers_import_only_downwards():
    bad = layering_violations(import_graph())
    assert not bad, "layering broken: " + "; ".join(bad)


def test_the_layering_rule_can_fail():
    g = import_graph()
    g.add_edge("slimcaching.system.problem", "slimcaching.runtime.node")
    assert layering_violations(g) == ["slimcaching.system.problem -> slimcaching.runtime.node"]


# inside the planner, by package: a rank each; a module imports only its own package and lower ranks
# (docs/development.md, "Layout"). The top-level modules (errors, version, catalogue) are rank 0.
PLANNER_RANK = {"": 0, "inputs": 1, "system": 2, "evaluation": 3, "algorithms": 4, "bounds": 5}


def _planner_part(module: str) -> str | None:
    """The planner package a module belongs to ("" for a top-level module), None outside the planner."""
    if _layer(module) != "planner":
        return None
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in PLANNER_RANK):
        return ""
    return parts[1]


def rank_violations(graph: nx.DiGraph, part_of, rank: dict[str, int]) -> list[str]:
    """Edges from a part to a part of the same or a higher rank (modules outside the parts: None)."""
    bad = []
    for a, b in graph.edges:
        pa, pb = part_of(a), part_of(b)
        if pa is None or pb is None or pa == pb:
            continue
        if rank[pb] >= rank[pa]:
            bad.append(f"{a} -> {b}")
    return sorted(bad)


def planner_violations(graph: nx.DiGraph) -> list[str]:
    return rank_violations(graph, _planner_part, PLANNER_RANK)


def test_planner_packages_import_only_downwards():
    """top level < inputs < system < evaluation < algorithms < bounds (docs/development.md)."""
    g = import_graph()
    parts = {_planner_part(m) for m in g.nodes} - {None}
    assert parts <= set(PLANNER_RANK), parts - set(PLANNER_RANK)
    bad = planner_violations(g)
    assert not bad, "planner layering broken: " + "; ".join(bad)


def test_the_planner_rule_can_fail():
    g = import_graph()
    g.add_edge("slimcaching.inputs.profiles", "slimcaching.system.problem")  # upwards
    g.add_edge("slimcaching.system.latency", "slimcaching.bounds.certificate")  # upwards, far
    g.add_edge("slimcaching.errors", "slimcaching.inputs.units")  # the top level is the bottom rank
    assert planner_violations(g) == ["slimcaching.errors -> slimcaching.inputs.units",
                                     "slimcaching.inputs.profiles -> slimcaching.system.problem",
                                     "slimcaching.system.latency -> slimcaching.bounds.certificate"]


def test_the_top_level_stays_small():
    """At most eight modules at the package's top level: everything else lives in a package by concern."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def test_the_planner_map_lists_every_module_once():
    """docs/development.md's "Layout" table names every module outside runtime/ exactly once."""
    import re

    text = (PACKAGE.parents[1] / "docs" / "development.md").read_text()
    section = text.split("## Layout", 1)[1].split("### The runtime", 1)[0]
    listed = re.findall(r"^\| `([\w/]+\.py)` \|", section, re.M)
    actual = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                    if p.relative_to(PACKAGE).parts[0] != "runtime")
    assert sorted(listed) == actual, (sorted(set(actual) - set(listed)), sorted(set(listed) - set(actual)))
    assert len(listed) == len(set(listed)), "listed twice"


# inside the runtime, by subpackage: a rank each; a module imports only its own subpackage and lower
# ranks. node and device share a rank and never import each other (a node is not a device).
RUNTIME_RANK = {"config": 0, "model": 1, "cluster": 2, "net": 3, "node": 4, "device": 4, "harness": 5, "serving": 6}


def _runtime_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["slimcaching", "runtime"] else None


def runtime_violations(graph: nx.DiGraph) -> list[str]:
    return rank_violations(graph, _runtime_part, RUNTIME_RANK)


def test_runtime_subpackages_import_only_downwards():
    """config < model < cluster < net < node | device < harness < serving (docs/development.md)."""
    g = import_graph()
    parts = {_runtime_part(m) for m in g.nodes if _runtime_part(m)}
    assert parts <= set(RUNTIME_RANK) | {"__init__"}, parts - set(RUNTIME_RANK)
    bad = runtime_violations(g)
    assert not bad, "runtime layering broken: " + "; ".join(bad)


def test_the_runtime_layering_rule_can_fail():
    g = import_graph()
    g.add_edge("slimcaching.runtime.node.server", "slimcaching.runtime.device.offload")  # node -> device
    g.add_edge("slimcaching.runtime.net.transport", "slimcaching.runtime.harness.launch")  # upwards
    assert runtime_violations(g) == ["slimcaching.runtime.net.transport -> slimcaching.runtime.harness.launch",
                                     "slimcaching.runtime.node.server -> slimcaching.runtime.device.offload"]


def test_the_runtime_map_lists_every_module_once():
    """docs/development.md's map of the runtime names every module exactly once, and no other."""
    import re

    text = (PACKAGE.parents[1] / "docs" / "development.md").read_text()
    section = text.split("### The runtime", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    listed = re.findall(r"^\| `(runtime/[\w/]+\.py)` \|", section, re.M)
    actual = sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "runtime").rglob("*.py"))
    assert sorted(listed) == actual, (sorted(set(actual) - set(listed)), sorted(set(listed) - set(actual)))
    assert len(listed) == len(set(listed)), "listed twice"


def test_no_runtime_class_is_over_350_lines():
    sizes = {f"{name}.{node.name}": node.end_lineno - node.lineno + 1
             for name, path in MODULES.items() if name.startswith("slimcaching.runtime")
             for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    big = {k: v for k, v in sizes.items() if v > 350}
    assert not big, big


def test_only_the_cli_imports_typer():
    bad = []
    for name, path in MODULES.items():
        if _layer(name) == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] == "typer" for n in names):
                bad.append(f"{name}:{node.lineno}")
    assert not bad, "typer outside cli/: " + ", ".join(bad)


def test_serving_does_not_pass_through_the_cluster_run_harness():
    """``serve``'s engine reaches devices through runtime.device.modes, never through ``cluster run``'s
    harness (session) or its launcher (imports inside functions count)."""
    reach = nx.descendants(import_graph(), "slimcaching.runtime.serving.engine")
    assert "slimcaching.runtime.device.modes" in reach
    assert not reach & {"slimcaching.runtime.harness.run", "slimcaching.runtime.harness.launch"}, sorted(reach)


def test_one_peer_health_tracker():
    """Failed peers are banned in one place (runtime/net/health.py), not by a dict per sender."""
    bad = [name for name, path in MODULES.items()
           if name.startswith("slimcaching.runtime.") and "dead_until" in path.read_text()]
    assert not bad, bad


def test_one_capacity_tolerance():
    """"Does it fit" is slimcaching.system.capacity.fits everywhere: no module writes its own slack."""
    import re

    slack = re.compile(r"(capacity|free|room|cache_bytes)\b.*(\(1 [+-] 1e-\d+\)|\* 1e-\d+\b)")
    bad = [f"{name}: {line.strip()}" for name, path in MODULES.items() if name != "slimcaching.system.capacity"
           for line in path.read_text().splitlines() if slack.search(line) and "slots" not in line]
    assert not bad, bad


def _uses_pyzmq(path: Path) -> bool:
    """Whether a module calls into pyzmq (``zmq.<name>`` anywhere; a bare ``import zmq`` that
    only checks the extra is installed does not count)."""
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "zmq"
               for n in ast.walk(tree))


def test_one_transport():
    """Sockets are made, polled and read in runtime/net/transport.py (and CURVE set up in
    runtime/net/security.py): a new transport replaces those two modules, not every sender."""
    users = sorted(name for name, path in MODULES.items() if _uses_pyzmq(path))
    assert users == ["slimcaching.runtime.net.security", "slimcaching.runtime.net.transport"], users


def test_the_transport_rule_can_fail(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("import zmq\n\ndef f(s):\n    return s.poll(1, zmq.POLLIN)\n")
    assert _uses_pyzmq(sample)
    sample.write_text("def f():\n    import zmq  # noqa: F401 - the extra is installed\n")
    assert not _uses_pyzmq(sample)
