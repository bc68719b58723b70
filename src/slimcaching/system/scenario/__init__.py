"""Scenarios: the input schema, resolution to plain numbers, device caches and the canonical form.

- :mod:`~slimcaching.system.scenario.schema`: the pydantic input models (units, unknown fields refused);
- :mod:`~slimcaching.system.scenario.types`: the resolved dataclasses every later stage reads;
- :mod:`~slimcaching.system.scenario.resolve`: :func:`load_scenario` and :func:`resolve_scenario`;
- :mod:`~slimcaching.system.scenario.local_cache`: the device caches (``lfu``);
- :mod:`~slimcaching.system.scenario.export`: :func:`canonical_dict` / :func:`canonical_json`,
  :func:`scenario_fingerprint`.

Examples
--------
>>> from slimcaching.system.scenario import load_scenario
>>> sc = load_scenario()  # the built-in default scenario
>>> len(sc.servers), len(sc.users), [m.name for m in sc.models]
(5, 50, ['switch-base-8', 'moe-llava-stablelm', 'llama-moe-3.5b-4-16'])
"""

from slimcaching.system.scenario.export import canonical_dict, canonical_json, scenario_fingerprint
from slimcaching.system.scenario.local_cache import lfu_local_cache, resolve_local_caches, user_marginals
from slimcaching.system.scenario.resolve import (
    MAX_DERIVED_SECONDS,
    ScenarioErrors,
    check_local_cache,
    load_scenario,
    resolve_scenario,
)
from slimcaching.system.scenario.schema import MODEL_FIELDS, SCENARIO_FORMAT, pydantic_error
from slimcaching.system.scenario.types import (
    Cloud,
    Link,
    Model,
    Phase,
    Reach,
    Scenario,
    Server,
    User,
    WorkloadEntry,
    scenario_at_phase,
)

__all__ = [
    "MAX_DERIVED_SECONDS", "MODEL_FIELDS", "SCENARIO_FORMAT", "Cloud", "Link", "Model", "Phase", "Reach", "Scenario",
    "ScenarioErrors", "Server", "User", "WorkloadEntry", "canonical_dict", "canonical_json", "check_local_cache",
    "scenario_fingerprint",
    "lfu_local_cache", "load_scenario", "pydantic_error", "resolve_local_caches", "resolve_scenario",
    "scenario_at_phase", "user_marginals",
]
