"""The ``smoke`` selection (``pytest -m smoke``): existing tests that together run every config switch once.

``.ci/run`` runs it on each Python besides the README's (3.12, 3.13), in a few minutes: a
Python that changes how something behaves (3.12's ``isinstance`` against a data-member
Protocol, which hid every attention module from the head stages) fails there. ``conftest.py``
marks these node ids and refuses a listed id its file no longer has, so a rename cannot drop a
switch from the selection unnoticed. One switch per key; a test may serve several.
"""

SMOKE = {
    "head stages (isinstance of the contracts on this Python)": [
        "tests/test_contracts.py::test_isinstance_answers_from_the_class_alone[HeadAttention]",
        "tests/test_contracts.py::test_isinstance_answers_from_the_class_alone[RoutedExperts]",
        "tests/test_contracts.py::test_the_decoder_modules_are_recognised_with_their_submodules_kept_in_modules",
    ],
    "head stages, sp, FSDP, checkpoint groups, full_offload": [
        "tests/test_checkpoint_groups.py::test_groups_under_fsdp_ulysses_and_head_stages_match_one_process",
    ],
    "a shipped head-staged config's dry run at its world size": [
        "tests/test_dry_run.py::test_every_shipped_config_passes_the_dry_run[llama3_1b_2m_one_gpu.toml]",
    ],
    "cp and tp": ["tests/test_context_parallel.py::test_cp_layout_matches_single_process[cp2-tp2]"],
    # the trainer's fused AdamW over each mesh dim's parameters: tp alone (no FSDP dim) broke it (issue 43)
    "tp alone, and sp x tp, with the trainer's optimizer": [
        "tests/test_model_parallel.py::test_layout_matches_single_process[tp2]",
        "tests/test_model_parallel.py::test_layout_matches_single_process[sp2-tp2]",
    ],
    "ep": ["tests/test_expert_parallel.py::test_expert_parallel_matches_one_process[qwen3-mixtral]"],
    "LoRA and float8 emulation": ["tests/test_lora.py::test_lora_layout_matches_single_process[sp2-float8-rowwise]"],
    "compile (the trainer's apply_compile over head-staged, fully checkpointed layers)": [
        "tests/test_staged_attention.py::test_compiled_staged_layers_share_one_graph",
    ],
    "offload's host copies": [
        "tests/test_activation_offload.py::test_block_inputs_travel_to_host_and_back_one_block_ahead",
    ],
    "attention backends (sdpa, flex; flash_attn's refusal on CPU)": [
        "tests/test_attention_masks.py::test_local_backends_match_the_definition[7-2.5-sdpa]",
        "tests/test_attention_masks.py::test_local_backends_match_the_definition[7-2.5-flex]",
        "tests/test_attention_masks.py::test_packed_long_windows_on_sdpa_validate_where_they_were_refused",
        "tests/test_ulysses_attention.py::test_ulysses_document_masking_matches_single_process_sdpa",
    ],
    "each family": [
        *(f"tests/test_tiny_hf_families.py::test_tiny_folder_loads_renders_and_masks_like_transformers[{f}]"
          for f in ("gemma3_text", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe")),
        "tests/test_hf_families.py::test_export_round_trip_is_exact_and_loads_silently[gemma2-softcap]",
        "tests/test_hf_families.py::test_export_round_trip_is_exact_and_loads_silently[glm-half-rotary-bias]",
        "tests/test_moe_families.py::test_moe_family_matches_transformers[gpt_oss]",
    ],
    "the evals (and the trainer that writes their checkpoint)": [
        "tests/test_eval_long.py::test_eval_long_at_sp2_equals_one_process",
        "tests/test_eval_needle.py::test_ulysses_evaluation_equals_one_process",
    ],
    "export": ["tests/test_export_hf.py::test_exported_model_matches_in_transformers[tied]"],
}

SMOKE_IDS = {node for nodes in SMOKE.values() for node in nodes}
