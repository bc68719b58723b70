"""Test-session settings: the slowest tests start first, so that the parallel workers (pytest-xdist)
finish together instead of one of them running a long test alone at the end."""

from __future__ import annotations

# measured durations of more than ~15 s on a 2-core machine (pytest --durations=40)
SLOW_FIRST = (
    "test_experiment_all_quick_cli", "test_regime_map_quick", "test_concurrent_users_and_pace",
    "test_kill_an_edge_server_mid_generation_loses_no_token", "test_exact_time_limit_is_not_called_optimal",
    "test_ray_launcher", "test_quick_capacity_writes_csv_figures_summary", "test_hybrid_quality_against_the_milp",
    "test_quality_k2_k3", "test_home_server_dies_device_goes_to_the_cloud", "test_no_copy_anywhere_is_one_clear_error",
    "test_docs_blocks_run_as_printed", "test_node_and_generate_commands_across_a_cluster_file",
    "test_nodes_stop_when_the_launcher_is_killed", "test_file_fuzz_every_reader_ends_cleanly",
    "test_quality_k4_to_k8_several_models", "test_ray_backend_smoke",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(getattr(item, "originalname", None) or item.name, len(rank)))
