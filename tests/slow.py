"""The slow tier: the tests ``make test`` leaves out and ``make test-all`` (what CI runs) keeps.

``make test`` is the ten-minute loop on the 2-core machine: every test file but those of
:data:`WHOLE` runs, and each feature is checked at least once (every role, strategy and
schedule, each collective against NumPy, a killed, a failing and a hung process, a lost
replica and a restart), but for three of the launcher's faults that wait out a timeout (a
taken coordinator port, a worker that never starts, bad launcher arguments). What it leaves
out is the rest of a matrix whose other cases it runs (more layouts of the same roles, more
group shapes, more schedules on the same layout), a second model of a check it runs on one (a
second example trained to accuracy), and the multi-process cases that spend their time
waiting for a timeout or a restart the kept ones already exercise. ``make test-slow`` runs
these alone.

conftest.py marks them ``slow``; ``tests/test_collection.py`` checks that every entry still
names a collected test, and that every test file but those of :data:`WHOLE` keeps a test in
``make test``. An entry is a test's name (all its cases), a case's full name, or a
prefix of case names ending in ``*``.
"""

from __future__ import annotations

SLOW: dict[str, tuple[str, ...]] = {
    # Training to accuracy: train_digits_short_run keeps the example's recipe.
    "dp/test_examples.py": (
        "test_nnx_cnn_digits_dropout_and_round_trip",
        "test_resnet_digits_flax_imagenet_recipe",
        "test_train_digits_short_run",
    ),
    "dp/test_hooks.py": ("test_powersgd_rank4_trains_digits_above_95_percent",),
    "dp/test_equivalence.py": (
        "test_trainer_matches_single_device_optax_adam_and_sgd[mlp]",
        "test_trainer_matches_single_device_optax_adam_and_sgd[cnn]",
    ),
    # Layouts: each role and schedule stays in make test, on one layout each.
    "dp/test_layout.py": (
        "test_every_layout_equals_one_device[dp8]",
        "test_every_layout_equals_one_device[fsdp8]",
        "test_every_layout_equals_one_device[fsdp4xtp2]",
        "test_every_layout_equals_one_device[dp2xtp2xpp2]",
        "test_every_layout_equals_one_device[fsdp2xtp2xpp2]",
        "test_every_pipelined_layout_trains_with_each_schedule_equal_to_one_device[fsdp2xtp2xpp2-*",
        "test_the_3d_step_exports_for_gpus_and_the_export_runs_here",
        "test_a_checkpoint_moves_between_model_layouts",
    ),
    "test_gpt.py": (
        "test_a_layout_trains_the_single_device_params[fsdp4xtp2]",
        "test_a_layout_trains_the_single_device_params[fsdp2xtp2xpp2]",
        "test_1f1b_trains_the_single_device_params",
        "test_a_context_layout_trains_the_single_device_params[dp1xcp8]",
        "test_an_moe_gpt_trains_the_single_device_params_with_its_experts_split",
        "test_the_checkpoint_resumes_in_another_layout",
    ),
    "models/test_layouts.py": (
        "test_linen_llama_pipelined_equals_one_device",
        "test_nnx_llama_pipelined_equals_one_device",
        "test_linen_llama_with_partition_rules_equals_one_device[fsdp4xtp2]",
        "test_linen_llama_with_partition_rules_equals_one_device[fsdp2xcp4-ring]",
        "test_nnx_llama_with_logical_metadata_equals_one_device[dp8]",
        "test_nnx_llama_with_logical_metadata_equals_one_device[fsdp8]",
        "test_nnx_llama_with_logical_metadata_equals_one_device[fsdp4xtp2]",
        "test_nnx_llama_with_logical_metadata_equals_one_device[fsdp2xcp4-ring]",
        "test_nnx_llama_pipelined_equals_one_device",
    ),
    "dp/test_expert_training.py": (
        "test_expert_layouts_train_as_one_device[ep4]",
        "test_expert_layouts_train_as_one_device[ep8]",
        "test_expert_layouts_train_as_one_device[fsdp8-ep8]",
        "test_expert_layouts_train_as_one_device[hsdp2x4-ep4]",
        "test_expert_layouts_train_as_one_device[zero1-4x2-ep2]",
        "test_a_checkpoint_moves_between_expert_layouts",
        "test_expert_layouts_train_as_one_device[hsdp4x2-ep2]",
    ),
    "dp/test_expert_tensor.py": ("test_experts_split_over_tensor_train_as_one_device",),
    "dp/test_context_training.py": (
        "test_context_layouts_train_as_one_device[cp8-ring]",
        "test_context_layouts_train_as_one_device[dp4xcp2-ring]",
    ),
    "nn/test_llama_blocks.py": (
        "test_an_nnx_model_with_a_bridged_layer_trains_as_one_device[moe-fsdp8-ep8]",
    ),
    "parallel/test_pipeline_moe.py": (
        "test_a_stage_s_moe_loss_and_loads_equal_one_device[OneFOneB(microbatches=2)]",
        "test_a_stage_s_moe_loss_and_loads_equal_one_device[ZeroBubble(microbatches=2)]",
    ),
    "dp/test_fsdp_unrolled.py": (
        "test_the_forward_gathers_one_block_ahead_not_all_at_the_start",
        "test_the_compiled_backward_gathers_each_block_again",
        "test_the_backward_prefetches_the_next_block",
    ),
    # The documentation: the two longest pages' code; `make docs` builds the site strictly.
    "test_docs.py": (
        "test_page_code_runs_and_prints_what_the_page_shows[dp.md]",
        "test_page_code_runs_and_prints_what_the_page_shows[scaling.md]",
        "test_site_builds_strictly_without_warnings",
    ),
    # Collectives: every op, dtype and reduce op stays, on fewer group shapes.
    "primitives/test_collectives.py": (
        "test_matches_numpy_oracle[2d-both-float32-eager]",
        "test_matches_numpy_oracle[2d-both-int32-eager]",
        "test_matches_numpy_oracle[2d-both-bool-eager]",
        "test_matches_numpy_oracle[2d-both-complex64-eager]",
        "test_matches_numpy_oracle[2d-local-*",
        "test_matches_numpy_oracle[2d-node-*",
        "test_matches_numpy_oracle[n1-*",
        "test_matches_numpy_oracle[n2-*",
        "test_matches_numpy_oracle[n4-*",
        "test_matches_numpy_oracle[n3-float32-eager]",
        "test_matches_numpy_oracle[n3-int32-eager]",
        "test_matches_numpy_oracle[n3-bool-eager]",
        "test_matches_numpy_oracle[n3-complex64-eager]",
    ),
    "primitives/test_binding.py": (
        "test_every_op_under_every_binding[shard_map]",
        "test_grad_of_every_linear_op_under_every_binding[vmap]",
    ),
    "distributed/test_collectives.py": (
        "test_data_movement[local]",
        "test_data_movement[node]",
        "test_data_movement[size4]",
        "test_reducing_collectives[local-*",
        "test_reducing_collectives[node-*",
        "test_reducing_collectives[size4-*",
    ),
    "algorithms/test_algorithms.py": (
        "test_all_reduce_every_op_and_dtype[ring-shape2]",
        "test_all_reduce_every_op_and_dtype[ring-shape3]",
        "test_all_reduce_every_op_and_dtype[ring-shape4]",
        "test_all_reduce_every_op_and_dtype[tree-shape8]",
        "test_all_reduce_every_op_and_dtype[tree-shape9]",
        "test_all_reduce_every_op_and_dtype[hierarchical-shape13]",
        "test_all_reduce_every_op_and_dtype[hierarchical-shape14]",
        "test_all_reduce_every_op_and_dtype[ring-shape1]",
        "test_all_reduce_every_op_and_dtype[tree-shape7]",
        "test_all_reduce_every_op_and_dtype[hierarchical-shape12]",
    ),
    "parallel/test_experts.py": (
        "test_split_over_n_devices_equals_the_oracle_and_one_device[2-softmax-capacity]",
        "test_split_over_n_devices_equals_the_oracle_and_one_device[4-softmax-dropless]",
        "test_split_over_n_devices_equals_the_oracle_and_one_device[8-softmax-dropless]",
    ),
    "parallel/test_context.py": ("test_split_attention_equals_numpy_over_the_whole_sequence[8-*",),
    "dp/test_mixed_precision.py": (
        "test_an_fp32_reduce_is_the_fp32_mean_of_the_bf16_gradients[hsdp]",
        "test_an_fp32_reduce_is_the_fp32_mean_of_the_bf16_gradients[zero1]",
    ),
    "dp/test_fsdp_layers.py": (
        "test_fsdp_on_a_scanned_model_equals_one_device[nn.scan]",
        "test_fsdp_on_a_scanned_model_equals_one_device[nnx.scan]",
        "test_hsdp_equals_one_device_and_holds_a_quarter_per_device[unrolled]",
    ),
    "parallel/test_context_gqa.py": (
        "test_gqa_equals_dense_attention_over_the_whole_sequence[4-*",
    ),
    "dp/test_semisync.py": (
        "test_streaming_diloco_equals_the_numpy_reference[False-0]",
        "test_int8_pseudo_gradients_cut_the_bytes_across_replicas_about_4x",
        "test_an_hsdp_layout_by_degrees_runs_fsdp_within_each_replica",
    ),
    "distributed/test_inflight.py": ("test_loops_of_eager_collectives_end",),
    # Processes: each fault and hang kind stays once; these wait out more timeouts.
    "multihost/test_trainer.py": (
        "test_the_gpt_example_across_processes_equals_one_device",
        "test_trainer_2x4_matches_1x8_and_resumes_after_a_kill",
        "test_fsdp_2x4_matches_1x8_and_resumes_after_a_kill",
        "test_a_process_that_fails_for_good_is_left_out_and_the_job_ends_equal",
        "test_multihost_example_runs_under_the_launcher",
    ),
    "multihost/test_hangs.py": (
        "test_a_clean_job_with_the_watchdog_off_raises_no_alarm",
        "test_different_broadcast_sources_are_named_by_detection",
        "test_different_collectives_end_at_the_timeout",
        "test_different_shapes_raise_instead_of_an_xla_abort",
        "test_mismatches_without_detection_are_named_by_the_flight_records[shape]",
        "test_mismatches_without_detection_are_named_by_the_flight_records[src]",
        "test_peer_spinning_outside_any_collective_ends_at_the_timeout",
        "test_processes_that_finish_seconds_apart_end_cleanly[apart1]",
        "test_sigterm_to_one_process_stops_every_loop_after_the_same_step",
        "test_torchrun_variables_on_loopback_bind_the_coordinator_to_loopback",
        "test_process_0_that_fails_on_purpose_is_named_first",
        "test_processes_that_finish_seconds_apart_end_cleanly[apart]",
        "test_mismatches_without_detection_are_named_by_the_flight_records[dtype]",
    ),
    "multihost/test_checkpoint.py": (
        "test_a_save_two_steps_before_a_loss_is_committed_and_the_restart_resumes_there",
        "test_fsdp_2x4_checkpoints_restore_anywhere_and_host_params_are_whole",
    ),
    "multihost/test_faults.py": (
        "test_a_taken_coordinator_port_is_named_before_jax_starts",
        "test_launcher_rejects_bad_arguments",
        "test_worker_that_never_starts_fails_the_job_at_the_init_timeout",
    ),
    "multihost/test_replica_loss.py": (
        "test_survivor_trains_on_after_a_replica_dies[4x2]",
        "test_a_replacement_rejoins_and_trains_on_with_the_survivor",
    ),
    "multihost/test_run_recoverable.py": ("test_replace_starts_one_replacement_that_joins",),
    # Its one test restarts a killed job and resumes it on fewer processes (five process
    # starts); test_checkpoint.py keeps a killed job's restart in make test.
    "multihost/test_grain_data.py": (
        "test_a_killed_job_and_one_on_fewer_processes_see_the_uninterrupted_ids",
    ),
}


WHOLE = {"multihost/test_grain_data.py"}
"""The files all of whose tests are in the slow tier."""


def matches(entry: str, name: str) -> bool:
    """Whether ``entry`` of :data:`SLOW` names the test ``name`` (its name within its file,
    with its case in brackets)."""
    if entry.endswith("*"):
        return name.startswith(entry[:-1])
    return name == entry or name.startswith(entry + "[")


def is_slow(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (``tests/<file>::<name>``) is in the slow tier."""
    path, _, name = nodeid.partition("::")
    return any(matches(e, name) for e in SLOW.get(path.removeprefix("tests/"), ()))
