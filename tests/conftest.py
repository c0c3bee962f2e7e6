"""Test configuration: run on the CPU even where the CUDA plugin is installed, start each test
with no plans remembered from the ones before it, keep the long
cases of the default run's matrices for ``-m slow``, and mark the tests known to fail on
current JAX (0.12) for a cause outside the test's control.

On jax 0.12 (the newest end of the supported range) these fail for causes found and stated
below; each is marked ``xfail`` there with its cause, and runs as usual on jax 0.10.2.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

CURRENT_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)

# XLA:CPU in jaxlib 0.12 runs its optimization-barrier expander after scheduling instead of
# before CSE and fusion (jaxlib 0.10.2): a recomputed value (a plan's re-issue, or a
# jax.checkpoint policy's) is no longer merged back into its original on the CPU, it stays
# in a fusion of its own, and XLA:CPU rounds a transcendental such as a softmax's exp
# differently there. On gpt2 tiny with jax.checkpoint's save_qkv_proj the loss is the same
# and 33 of 37 gradient leaves differ by at most 1.0e-7 (3.2e-3 relative); no compiler flag
# restores the old pass order. Bit-exact plans of 32-bit steps are therefore checked on
# jax 0.10.2; on 0.12 they are as close as jax.checkpoint's own policies.
CPU_REMAT_BITS = ("XLA:CPU 0.12 keeps recomputations in fusions of their own (barrier "
                  "expansion after scheduling): recomputed values round differently on the CPU, "
                  "as under jax.checkpoint's own policies")
# The same pass order makes remat save memory on the CPU under the exact compiler options,
# where these tests measure that it saves none.
CPU_REMAT_BYTES = ("XLA:CPU 0.12 keeps recomputations under the exact compiler options, so CPU "
                   "remat saves bytes these tests expect it not to")
# The relaxed (bitwise=False) sublinear plans of tests/test_bitwise_auto.py's bf16 stack compile
# higher than its bit-exact ones for h100 under XLA 0.12 (lowest 6,325,116 B against
# 5,817,980 B; under 0.10.2 2,658,460 B against 2,943,444 B), so no budget lies between them.
CPU_OFFLOAD_BITS = ("on XLA:CPU 0.12 the offloads vDNN plans on the tiny GPT-2 train step change "
                    "its bits (on 0.10.2 they keep them); cause not established: host copies "
                    "are tied with the barriers that 0.12 expands after scheduling")
# On 0.12, 11 of the pre-LayerNorm residual step's 22 single offloads (each prefetched before
# its last reader) change its bits, 0 of 24 on 0.10.2; the compiled programs differ in their
# fusions only (a product of an offloaded matmul output, fused into its readers in the plain
# step, is a kernel of its own).
CPU_OFFLOAD_FUSION = ("on XLA:CPU 0.12 a host copy is tied with barriers that 0.12 expands after "
                      "scheduling, and XLA fuses the values around it otherwise than in the "
                      "plain step")
RELAXED_BF16 = ("on XLA 0.12 the relaxed plans of this bf16 step compile higher for h100 than "
                "its bit-exact ones (6,325,116 B against 5,817,980 B): no budget between")
# jaxmem.cost.hlo's byte count of a scan on h100 differs from XLA's cost analysis on 0.12.
SCAN_BYTES = ("jaxmem.cost.hlo's bytes of a scanned step on h100 differ from XLA 0.12's cost "
              "analysis")

KNOWN_ON_CURRENT_JAX = {
    CPU_REMAT_BITS: [
        "tests/test_blocks.py::test_emitted_blocks_plan_is_bitwise_equal_on_the_cpu[resnet50]",
        "tests/test_blocks.py::test_emitted_blocks_plan_is_bitwise_equal_on_the_cpu[gpt2]",
        "tests/test_exactness_property.py::test_random_programs_keep_their_arithmetic",
        # The split-everything remat plan of ['residual', 'reduce', 'reshape', 'residual'] at
        # width 16: each of its three re-issues alone moves 109 of the first weight gradient's
        # 256 elements on 0.12 (14 kernels, 10 in the plain step); exact without FMA
        # (--xla_cpu_max_isa=AVX), and on 0.10.2.
        "tests/test_exactness_property.py::test_found_examples_keep_their_arithmetic[spec4-16-0-",
        "tests/test_emit.py::test_a_copy_left_to_one_summing_reader_stays_a_buffer_on_the_cpu["
        "reissued-centred-input]",
        "tests/test_exactness_dropout.py::test_linen_dropout_read_by_a_layernorm_is_not_reissued[",
        "tests/test_literature_planners.py::test_fused_segments_are_exact_on_32_bit_steps_and_"
        "close_on_16_bit_ones[gpt2-True-0]",
        "tests/test_matmuls.py::test_emitted_plan_is_bitwise_equal_on_the_cpu[gpt2-",
        "tests/test_matmuls.py::test_emitted_plan_is_bitwise_equal_on_the_cpu[resnet50-",
        "tests/test_matmuls.py::test_fit_variant_offers_the_whole_last_group_as_an_alternative_"
        "of_the_same_bits",
        "tests/test_models.py::test_peer_policy_matches_none_on_cpu[gpt2-False-grad-save_qkv_proj-",
        "tests/test_models.py::test_peer_policy_matches_none_on_cpu[gpt2-False-train-"
        "qkv_proj_offloaded-",
        "tests/test_schedule_stale_fused.py::test_a_relu_mask_read_by_a_bias_gradient_is_refreshed",
        "tests/test_principles.py::test_any_planners_reissued_product_gets_its_scaled_"
        "operand",
        # The two matmuls that read the dropped scaling chain stay re-issued; on 0.12 their
        # copies round otherwise (the chain's hand plan differs on 0.12 only), on 0.10.2 not.
        "tests/test_principles.py::test_no_plan_keeps_a_copied_chain_of_two_constant_scalings"
        "[reissued-from-argument]",
        "tests/test_block_detection.py::test_blocks_plan_of_an_nnx_gpt_lowers_its_peak_and_runs_bitwise",
        "tests/test_nnx_steps.py::test_a_plain_nnx_step_plans_at_half_its_unplanned_peak_on_h100",
        # The MLP's gelu product re-issued alone: its tie sits before the dropout's division
        # (a fused value since the masks are counted as XLA keeps them), 2 ulps on 0.12.
        "tests/test_exactness_corpus_reissues.py::test_value_reissued_for_its_weight_gradient_"
        "keeps_the_bits[equinox_gpt_block]",
        # A LayerNorm's mean sum, or centred input, re-issued alone: exact on 0.10.2 with the
        # emitter's ties and the principles, 1-2 ulps on 0.12.
        "tests/test_exactness_layernorm_variance.py::test_mean_sum_reissued_for_the_variance_",
        "tests/test_exactness_residual_layernorm.py::test_residual_sum_reissued_with_the_centred_",
    ],
    CPU_REMAT_BYTES: [
        "tests/test_cpu_target_fits.py::test_jax_checkpoint_saves_cpu_memory_only_when_remat_is_kept",
        "tests/test_optimize.py::test_re_plans_get_what_the_rounds_before_them_left",
        "tests/test_optimize.py::test_re_plans_go_on_while_the_plan_that_missed_is_estimated_faster",
        "tests/test_optimize.py::test_the_loop_tightens_by_the_plan_of_the_round_that_came_closest",
    ],
    SCAN_BYTES: [
        "tests/test_measure.py::test_totals_match_xla_cost_analysis[scan-h100]",
    ],
    CPU_OFFLOAD_BITS: [
        "tests/test_literature_planners.py::test_offloads_leave_a_matmul_folded_with_its_transpose",
    ],
    CPU_OFFLOAD_FUSION: [
        "tests/test_exactness_residual_layernorm.py::test_an_offloaded_matmul_output_summed_",
        "tests/test_exactness_residual_layernorm.py::test_a_prefetched_matmul_output_summed_",
    ],
    RELAXED_BF16: [
        "tests/test_bitwise_auto.py::test_auto_plans_a_16_bit_step_that_no_exact_plan_fits_",
        "tests/test_bitwise_auto.py::test_strict_bitwise_refuses_the_same_budget_",
        "tests/test_bitwise_auto.py::test_a_relaxed_plan_is_no_further_from_the_plain_step_",
        "tests/test_bitwise_auto.py::test_when_neither_attempt_fits_the_error_names_the_",
    ],
}


# The long cases of the default run's matrices run under ``-m slow`` only, so that each leg
# of CI stays within its time: each group's comment names what the default run keeps of it.
LONG_CASES = [
    # Every model compiles for every target: the default run keeps the MLP on both targets and
    # llama's scanned gradient step and VGG-16's train step on h100.
    *(f"tests/test_models.py::test_compiles_for_every_target[{case}"
      for case in ("h100-vgg16-grad", "h100-resnet50-", "h100-unet-", "h100-gpt2-",
                   "h100-llama-train", "h100-llama-grad", "h100-llama-scan-train", "h200-",
                   "cpu-vgg16-", "cpu-resnet50-", "cpu-unet-", "cpu-gpt2-", "cpu-llama-")),
    # Peers against no policy on the CPU: the MLP, VGG-16 and U-Net cases stay.
    "tests/test_models.py::test_peer_policy_matches_none_on_cpu[gpt2-",
    "tests/test_models.py::test_peer_policy_matches_none_on_cpu[llama-",
    "tests/test_models.py::test_peer_policy_matches_none_on_cpu[resnet50-",
    # Dropout keys: the unrolled gradient step stays; each layer's own mask (unrolled and
    # scanned) is checked by test_each_layer_draws_its_own_mask.
    "tests/test_models.py::test_dropout_draws_from_the_step_key[train-",
    "tests/test_models.py::test_dropout_draws_from_the_step_key[grad-scan]",
    # Offload policies use host memory: offload_dots_no_batch stays.
    "tests/test_models.py::test_offload_policies_use_host_memory_on_h100[minimal_offloaded]",
    "tests/test_models.py::test_offload_policies_use_host_memory_on_h100[qkv_proj_offloaded]",
    # Offloads of the bf16 step keep its bits: vdnn_all stays.
    "tests/test_literature_planners.py::test_offloads_of_a_bf16_step_keep_its_bits[qlearn]",
    "tests/test_literature_planners.py::test_offloads_of_a_bf16_step_keep_its_bits[vdnn_dynamic]",
    "tests/test_literature_planners.py::test_fused_segments_are_exact_on_32_bit_steps_and_"
    "close_on_16_bit_ones[llama-",
    # Emitted plans on the CPU: the MLP and VGG-16 (blocks), gpt2's keep_matmuls and the MLP
    # (matmuls), the MLP's remat, offload and reorder plans (emit) stay.
    "tests/test_blocks.py::test_emitted_blocks_plan_is_bitwise_equal_on_the_cpu[resnet50]",
    "tests/test_blocks.py::test_emitted_blocks_plan_is_bitwise_equal_on_the_cpu[gpt2]",
    "tests/test_matmuls.py::test_emitted_plan_is_bitwise_equal_on_the_cpu[gpt2-keep_matmuls_",
    "tests/test_matmuls.py::test_emitted_plan_is_bitwise_equal_on_the_cpu[resnet50-",
    "tests/test_emit.py::test_planned_train_step_is_bitwise_equal[gpt2-all]",
    "tests/test_emit.py::test_planned_train_step_is_bitwise_equal[resnet50-all]",
    "tests/test_host_update.py::test_host_updated_step_is_bitwise_equal_on_the_cpu[gpt2]",
    "tests/test_placement.py::test_placed_step_is_bitwise_equal_and_returns_the_state_on_host"
    "[gpt2-",
    # One value re-issued alone: the Equinox MLP and the Haiku attention step stay.
    "tests/test_exactness_corpus_reissues.py::test_value_reissued_for_its_weight_gradient_"
    "keeps_the_bits[equinox_gpt_block]",
    "tests/test_exactness_layernorm_variance.py::test_mean_sum_reissued_for_the_variance_"
    "gradient_keeps_the_bits[equinox_gpt_block]",
    "tests/test_prng_keys.py::test_dropout_plans_recompute_masks_and_keep_the_bits[greedy-",
    "tests/test_simulate.py::test_prediction_is_close_to_the_compiled_step[gpt2-small-",
    # One search per rule where the rule is the searches' shared code: keep_matmuls_fit
    # searches again keeping its values, and keeps a Linen dropout read by a LayerNorm
    # (sublinear's and keep_matmuls' cases took 27 s and 17 s of a 2-core run).
    "tests/test_principles.py::test_a_search_the_rules_leave_over_the_budget_searches_again_"
    "keeping_their_values[sublinear-",
    "tests/test_exactness_dropout.py::test_linen_dropout_read_by_a_layernorm_is_not_reissued"
    "[keep_matmuls]",
    # The 16-bit refusal and the segments it forbids stay; the evidence that one re-issued
    # bf16 matmul alone moves the bits (17 s) is for -m slow.
    "tests/test_exactness_bf16_segments.py::test_a_single_reissued_bf16_matmul_changes_the_"
    "bits_under_excess_precision",
    # A heuristic's own scores: the MLP at two budgets stays (GPT-2 took 11 s).
    "tests/test_cpsat.py::test_a_heuristics_own_scores_are_the_simulators_and_the_estimate"
    "[gpt2-",
]


# Known failures on current JAX that take long to fail: there, under ``-m slow`` only
# (the random programs' arithmetic took 109 s of the 0.12 leg before it failed, the fit
# variant's whole-group alternative 22 s).
LONG_ON_CURRENT_JAX = [
    "tests/test_exactness_property.py::test_random_programs_keep_their_arithmetic",
    "tests/test_matmuls.py::test_fit_variant_offers_the_whole_last_group_as_an_alternative_"
    "of_the_same_bits",
]


def _named(item, prefixes) -> bool:
    return any(item.nodeid.startswith(p) for p in prefixes)


@pytest.hookimpl(tryfirst=True)  # before the -m selection reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _named(item, LONG_CASES):
            item.add_marker(pytest.mark.slow)
    if not CURRENT_JAX:
        return
    for item in items:
        if _named(item, LONG_ON_CURRENT_JAX):
            item.add_marker(pytest.mark.slow)
        for reason, prefixes in KNOWN_ON_CURRENT_JAX.items():
            if _named(item, prefixes):
                # Not strict: which plans a time-limited planner keeps, and so whether a
                # cause shows, depends on the machine's load.
                item.add_marker(pytest.mark.xfail(strict=False, reason=f"jax 0.12: {reason}"))
                break


@pytest.fixture(autouse=True)
def _no_remembered_plans():
    """Each test starts as a new process would: no plans of earlier tests' calls to recall
    (``jaxmem.verify.recall``), whatever order the tests run in."""
    from jaxmem.verify import recall

    recall.forget()
