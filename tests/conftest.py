"""Shared fixtures: a small corpus and tokenizer built offline (helpers live in tests/helpers.py)."""

from __future__ import annotations

import os

import pytest

from tests.helpers import make_corpus

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from zeroband.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    jsonl = make_corpus(root / "train.jsonl")
    train_tokenizer([jsonl], 384, root / "tokenizer")
    return {"path": str(jsonl), "tokenizer": str(root / "tokenizer")}


@pytest.fixture(params=["native", "eager"])
def kernel_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with each implementation of the outer step's kernels (zeroband/comm/kernels.py),
    through its own switch; "native" needs a C compiler and skips without one."""
    from zeroband.comm.kernels import native_or_eager

    if request.param == "eager":
        monkeypatch.setenv("ZEROBAND_KERNELS", "eager")
    else:
        monkeypatch.delenv("ZEROBAND_KERNELS", raising=False)
        if native_or_eager().name != "native":
            pytest.skip("no native kernels on this machine (no C compiler): the eager run covers the code")
    return request.param




# ------------------------------------------------------------------------------------------ test tiers
# `pytest -m unit`: in-process only (no child processes; a loopback store at most), the whole tier in
# well under a minute. `pytest -m integration`: real forked ranks, torchrun, launchers, etcd, network
# namespaces; each test under the global 120 s timeout (pyproject.toml). `slow` marks the end-to-end
# integration tests that take tens of seconds (`-m "not slow"` leaves them out). A test not listed
# below is integration, so a new test can only make the unit tier faster, never slower.
UNIT_MODULES = {"test_config", "test_link", "test_data", "test_model", "test_plan", "test_rounds", "test_fetch_safety",
                "test_outer_units", "test_outer_step", "test_save_policy", "test_layers", "test_outer_sync",
                "test_transport", "test_docs_links", "test_ledger"}
UNIT_TESTS = {
    "test_attacks_flood_store": {"test_the_guard_decides_on_a_whole_answer_bound_to_its_challenge_and_port"},
    "test_gpu_suite_smoke": {"test_cached_spec_is_skipped_and_a_changed_spec_runs_again",
                             "test_budget_stops_between_rows_and_the_next_invocation_goes_on",
                             "test_a_worker_that_dies_costs_only_its_row",
                             "test_checks_are_fixed_and_a_failing_check_stays_failing",
                             "test_the_fair_plain_loop_is_causal_and_gets_no_mask",
                             "test_the_gpu_plan_meets_the_issue_minimums"},
    "test_attacks": {"test_verified_sites_rule", "test_forged_heartbeat_and_leave_are_refused",
                     "test_forged_members_votes_verdict_and_committed_are_refused",
                     "test_multi_site_without_a_secret_needs_insecure"},
    "test_attacks_store": {"test_deleted_values_are_written_back_and_a_storm_is_named",
                           "test_a_deleted_heartbeat_is_no_death_and_generations_are_never_reused",
                           "test_a_value_deleted_after_its_writer_moved_on_comes_back"},
    "test_auth": {"test_proofs_verify_only_with_the_same_secret", "test_old_or_copied_proofs_do_not_verify",
                  "test_decide_all_admitted", "test_decide_wrong_secret_is_refused_by_the_majority",
                  "test_decide_two_sites_that_disagree_admit_nobody", "test_decide_fingerprint_majority_and_tie",
                  "test_the_secret_is_resolved_into_one_object_that_never_shows_it", "test_flatten_fingerprint",
                  "test_reused_prefix_is_rejected",
                  "test_session_keys_are_new_at_every_admission_and_each_identity_is_sealed_once",
                  "test_replayed_admission_transcript_is_refused"},
    "test_checkpoint_safety": {"test_prune_victims_only_this_runs_older_checkpoints",
                               "test_find_checkpoint_names_what_it_skipped"},
    "test_checkpoint_trust": {"test_trust_rule_without_a_secret",
                              "test_rng_state_is_plain_data_and_old_tuples_still_restore"},
    "test_comm": {"test_dense_codec_round_trip", "test_pieces_cover_everything_on_block_boundaries"},
    "test_exposure": {"test_config_errors_never_echo_a_secret"},
    "test_faults": {"test_parse_faults", "test_inner_fault_fires_at_its_step_on_its_site_and_rank_only",
                    "test_seal_fault_fires_between_the_two_renames", "test_uninstall_restores_every_seam",
                    "test_inject_command_wraps_the_trainer_of_a_site_command"},
    "test_hangs": {"test_store_survives_a_flood_of_idle_connections",
                   "test_decide_resume_takes_the_newest_common_step_or_names_who_has_what", "test_launcher_lines",
                   "test_store_waits_name_the_missing_sites_and_log_while_waiting"},
    "test_launch": {"test_site_cpus_are_disjoint_and_refuse_too_many_sites", "test_the_launcher_shows_the_settings_a_resume_changed",
                    "test_decide_names_the_first_failure_and_bounds_the_rest", "test_policy_bound_follows_the_config",
                    "test_terminal_filter_holds_back_everything_from_the_first_failure_on",
                    "test_local_secret_is_made_once_0600_and_reused"},
    "test_outer_optimizer": {"test_the_outer_optimizer_is_a_pure_function_of_the_config",
                             *(f"test_outer_optimizer_settings_are_refused_in_one_line[{k}]"
                               for k in ("no_lr", "unknown", "kwargs", "momentum", "overlap"))},
    "test_optim": {"test_muon_takes_hidden_matrices_adamw_the_rest", "test_resume_keeps_the_muon_runs_adamw_kernel",
                   "test_resume_keeps_this_runs_adamw_kernel[host-gpu]",
                   "test_resume_keeps_this_runs_adamw_kernel[gpu-host]"},
    "test_inner_step": {"test_step_result_takes_the_site_mean_and_stops_on_any_bad_rank",
                        "test_settle_step_on_a_one_rank_site_is_its_own_loss_with_no_collective",
                        "test_graceful_stop_on_a_one_rank_site_reads_its_own_flag[True]",
                        "test_graceful_stop_on_a_one_rank_site_reads_its_own_flag[False]",
                        "test_compute_timer_sums_its_spans_and_starts_over",
                        "test_adamw_kernel_is_the_single_tensor_loop_off_the_gpu"},
    "test_quantized": {"test_nearest_level_table_equals_bucketize", "test_codec_round_trip_sizes",
                       "test_codec_rejects_non_finite", "test_chunks_cover_everything_on_block_boundaries"},
    "test_run_dir": {"test_resume_rules_apply_cadence_refuse_state_and_ignore_plumbing",
                     "test_config_changes_between_two_resolved_configs",
                     "test_old_victims_keep_the_newest_retired_runs_only",
                     "test_a_held_run_dir_refuses_a_second_owner_naming_the_first",
                     "test_a_loaded_optimizer_keeps_this_runs_settings_and_schedule"},
    "test_scripts_smoke": {"test_experiment_corpus_location_is_a_flag",
                           "test_out_refusal_keeps_smoke_runs_out_of_the_committed_results"},
    "test_store": {"test_set_get_check_delete[tcp]", "test_add_and_compare_set[tcp]",
                   "test_add_is_atomic_across_clients[tcp]", "test_wait_and_blocking_get[tcp]",
                   "test_missing_key_times_out_clearly[tcp]"},  # the etcd variants start an etcd cluster
    "test_train": {"test_wsd_schedule_shape"},
    "test_wire_agreement": {*(f"test_honest_measurements_of_the_same_bytes_agree[{w}]"
                              for w in ("fp32", "bf16", "fp16", "int8", "int4")),
                            "test_agreement_tolerance_is_tight_and_handles_zero_and_overflow",
                            "test_exclusions_say_what_happened"},
    "test_user_messages": {"test_launch_without_a_diloco_section", "test_data_command_names_a_bad_corpus_it_would_reuse",
                           "test_steps_not_a_multiple_of_inner_steps_names_each_fix_once",
                           "test_first_bad_json_line_kinds", "test_log_lines_print_above_the_progress_bar",
                           "test_records_through_drops_redone_steps"},
}
# Measured at 15-60 s each on a loaded 2-core machine (besides the modules that mark themselves slow).
SLOW_TESTS = {
    "test_chaos": {"test_killed_site_rejoins_identical", "test_fixed_mode_frozen_peer_then_resume"},
    "test_launch": {"test_launch_two_sites_then_export", "test_train_command_runs_torchrun_with_two_ranks",
                    "test_launcher_names_a_stopped_site_and_ends_the_run_within_the_bound",
                    "test_launch_without_a_secret_makes_one_for_the_run_and_shows_it_nowhere",
                    "test_a_failing_two_rank_site_is_one_line_on_the_launchers_terminal"},
    "test_hangs": {"test_a_site_without_the_secret_is_kept_out_of_the_store_and_told_why",
                   "test_sigterm_to_launcher_stops_every_site", "test_sigterm_interrupts_a_wait_on_a_frozen_peer"},
    "test_exposure": {"test_default_launch_listens_on_loopback_and_never_shows_its_secret"},
    "test_checkpoint_trust": {"test_crafted_checkpoint_is_refused_by_resume_and_export"},
    "test_checkpoint_safety": {"test_foreign_checkpoint_is_never_pruned_and_the_new_one_is_kept"},
    "test_elastic": {"test_foreign_peer_refused"},
    "test_faults": {"test_inject_under_launch_arms_the_sites"},
    # ~15 s once its image is cached; the first run builds the base image and the deps layer (~3 min).
    "test_docker": {"test_image_builds_and_two_sites_train_identical_on_loopback"},
}
UNIT_TIMEOUT_S = 30  # a unit test that needs longer is doing integration work


def tier(module: str, name: str) -> str:
    """`unit` or `integration` for test `name` (with its parameters, e.g. `test_x[tcp]`) of `module`."""
    if module in UNIT_MODULES or name in UNIT_TESTS.get(module, ()):
        return "unit"
    return "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module, base = item.module.__name__.rpartition(".")[2], item.name.partition("[")[0]
        kind = tier(module, item.name)
        item.add_marker(kind)
        if kind == "unit" and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))
        if base in SLOW_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)
