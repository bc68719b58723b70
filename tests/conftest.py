"""Test-session settings: the slowest tests start first, so that the parallel workers (pytest-xdist)
finish together instead of one of them running a long test alone at the end.

This needs ``--maxschedchunk 1`` (``make test`` passes it): xdist then hands the tests out one at a
time in this order. By default it gives each worker a consecutive block (a quarter of its share) at
the start, which put every slow test in the first worker's queue (a clean-clone run ended with
the other worker idle for minutes)."""

from __future__ import annotations

# the tests of more than ~13 s on a 2-core machine, longest first (pytest --durations, the larger of
# two full runs; a parametrised test by its id where its cases differ much)
SLOW_FIRST = (
    "test_docs_blocks_run_as_printed[runtime.md]", "test_ray_launcher", "test_docs_blocks_run_as_printed[usage.md]",
    "test_experiment_drift_quick", "test_experiment_all_quick_cli",
    "test_nodes_are_placed_on_the_ray_nodes_the_cluster_file_names", "test_lm_eval_local_completions_equals_lm_eval_hf",
    "test_file_fuzz_every_reader_ends_cleanly", "test_the_demo_table_is_the_same_under_every_kernel_and_thread_count",
    "test_sigterm_mid_request_answers_it_and_exits_fast", "test_docs_blocks_run_as_printed[README.md]",
    "test_concurrent_users_and_pace", "test_experiment_peers_quick",
    "test_node_and_generate_commands_across_a_cluster_file",
    "test_device_pool_serves_as_the_threads_do", "test_cluster_run_executes_a_hybrid_placement",
    "test_a_top8_placement_is_the_same_under_every_kernel_and_thread_count",
    "test_serve_command_starts_answers_and_stops_every_node_on_sigterm",
    "test_serve_joins_running_nodes_from_a_cluster_file", "test_kill_9_leaves_no_node_and_no_keys",
    "test_the_drift_controller_replans_a_full_window_every_few_checks", "test_quality_top8_against_the_milp_optimum",
    "test_nodes_stop_when_the_launcher_is_killed", "test_a_low_file_limit_and_400_half_open_connections_log_no_storm",
    "test_readme_demo_table_is_what_make_demo_prints", "test_ray_backend_smoke",
    "test_calibrated_model_predicts_a_paced_run",
    "test_ctrl_c_stops_cluster_run_and_its_nodes", "test_kill_an_edge_server_mid_generation_loses_no_token",
    "test_quality_k2_k3", "test_ctrl_c_stops_a_long_solve", "test_home_server_dies_device_goes_to_the_cloud",
    "test_hybrid_quality_against_the_milp", "test_row_groups_agree_with_pattern_tables", "test_regime_map_quick",
    "test_a_migration_serves_each_copy_from_its_arrival", "test_compiled_row_greedy_matches_the_numpy_row_greedy",
    "test_cluster_output_equals_the_model", "test_no_copy_anywhere_is_one_clear_error",
    "test_lp_bound_below_milp_optimum_and_placements", "test_every_parameter_arrives_with_its_declared_type",
    "test_hybrid_under_load_avoids_saturating_the_edge", "test_calibrate_prints_flops_and_message_overhead",
    "test_quick_capacity_writes_csv_figures_summary", "test_cluster_run_adapt_re_places_experts_live",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    last = len(rank)
    items.sort(key=lambda item: rank.get(item.name, rank.get(getattr(item, "originalname", None) or item.name, last)))
