"""Names the library offers, importable without importing the library itself: the command line's
help texts list them before anything heavy is loaded."""

from __future__ import annotations

# algorithms that re-plan a placement against the cost of moving experts (slimcaching.algorithms.replan)
REPLAN_ALGORITHMS = ("slimcaching", "slimcaching-fast", "exact")
# routing records that `profile import` reads (slimcaching.inputs.routing_import)
ROUTING_FORMATS = ("sglang-per-token", "sglang-stat", "sglang-routed", "vllm-routed", "counts", "tokens")
INDEPENDENT_TOKENS = 20_000  # tokens drawn per layer for a counts-only profile
