"""``exact`` on EP deployments: every layer's node contents by HiGHS (MILP), warm-started.

The programme (:mod:`slimcaching.system.ep.formulation`) minimises the expected inter-node copies
over the node contents; the GPUs of a node are then packed as ``slimcaching`` packs them. Without
redundant slots it is the exact optimum of ``slimcaching``'s objective without its load slack; with
them, a token may pick its best holder per expert, so the optimum is a lower bound for the
``nearest`` rule and the placement is judged by that rule afterwards. Meant for small instances:
a layer's programme over ``max_nonzeros`` is refused before it is built.
"""

from __future__ import annotations

import numpy as np

from slimcaching.algorithms.ep import EPPlacement, register_ep
from slimcaching.algorithms.ep.coactivation import slimcaching_ep
from slimcaching.algorithms.ep.peers import pack_nodes
from slimcaching.errors import ScenarioError
from slimcaching.system.ep.cost import EPProblem
from slimcaching.system.ep.formulation import build_programme, programme_size, warm_values
from slimcaching.system.formulation import solve_milp


def node_contents(problem: EPProblem, row: np.ndarray) -> np.ndarray:
    """[N, E]: which experts each node holds in a layer's row."""
    dep = problem.deployment
    per_node = dep.slots_per_gpu * dep.gpus_per_node
    held = np.zeros((dep.nodes, problem.experts), dtype=bool)
    for m in range(dep.nodes):
        held[m, row[m * per_node:(m + 1) * per_node]] = True
    return held


@register_ep("exact", "MILP of each layer's node contents by HiGHS, warm-started with slimcaching; small "
             "instances", rank=2)
def exact_ep(problem: EPProblem, time_limit: float = 60.0, max_nonzeros: int = 2_000_000) -> EPPlacement:
    """Per layer, the MILP of the node contents with ``time_limit / layers`` seconds, started from
    ``slimcaching``'s; the result reports each layer's status and HiGHS's proven bound (expected
    inter-node copies per token) in ``info``.

    References
    ----------
    Q. Huangfu and J. A. J. Hall, "Parallelizing the dual revised simplex method", Math. Prog. Comp.
    10, 2018 (HiGHS).
    """
    if not time_limit > 0:
        raise ScenarioError("--time-limit", "must be a positive number of seconds", time_limit)
    dep = problem.deployment
    for li in range(dep.layers):
        size = programme_size(problem, li)
        if size > max_nonzeros:
            raise ScenarioError("algorithm exact", f"layer {li}'s programme has about {size:,} nonzeros, more than "
                                f"max_nonzeros={max_nonzeros:,}: use slimcaching (and --bound for its gap)", size)
    start = slimcaching_ep(problem).phy2log
    rows, statuses, bounds, values = [], [], [], []
    for li in range(dep.layers):
        held = node_contents(problem, start[li])
        if dep.slots_per_gpu * dep.gpus_per_node >= problem.experts:
            rows.append(start[li])
            statuses.append("optimal")
            bounds.append(0.0)
            values.append(0.0)
            continue
        prog = build_programme(problem, li)
        res = solve_milp(prog, time_limit / dep.layers, 1e-9, warm_values(prog, problem, li, held))
        if res.values is not None:
            held = prog.holders(res.values)
        rows.append(pack_nodes(problem, li, held) if res.values is not None else start[li])
        statuses.append(res.status)
        bounds.append(res.dual_bound if res.dual_bound is not None else 0.0)
        values.append(res.objective if res.objective is not None else float("nan"))
    return EPPlacement(np.stack(rows), {
        "optimal": all(s == "optimal" for s in statuses), "status": statuses,
        "bound_copies": float(np.mean(bounds)), "milp_copies": float(np.mean(values)),
        "per_layer_bound": bounds})
