"""Token slicing in planning: closed-form cases of the stage-time model and the plan it prints."""
import itertools

import jax
import numpy as np
import pytest

import alpa_like as al
from alpa_like.compiler.terapipe_planning import batch_slice_sizes, choose_token_slicing, stage_slice_costs, token_grain
from alpa_like.compiler.token_slicing import format_scheme
from alpa_like.models import gpt


def test_token_only_floor_model_has_a_closed_form():
    """rho = 0, floor s = L/4, K = 4: four slices of s tokens, each T/4: T + 3 T/4 versus 4 T unsliced."""
    decision = choose_token_slicing([2.0] * 4, [0.0] * 4, 64, 1, 1, saturation_tokens=16)
    assert decision.batch_slices == ((1, (16, 16, 16, 16)),)
    assert decision.latency == pytest.approx(1.75 * 2.0)
    assert decision.latency_unsliced == pytest.approx(4 * 2.0)


def test_no_slicing_kept_when_it_does_not_help():
    """One stage, no attention: slices of >= s tokens cost the same in sum and shorter ones more (the floor),
    so the plan keeps whole sequences. (With attention, slicing also skips the masked half of each block.)"""
    decision = choose_token_slicing([1.0], [0.0], 32, 2, 4, saturation_tokens=8)
    assert decision.batch_slices == ()
    assert decision.latency == decision.latency_unsliced


def _compositions(n):
    for cuts in itertools.product((False, True), repeat=n - 1):
        out, current = [], 1
        for cut in cuts:
            if cut:
                out.append(current)
                current = 1
            else:
                current += 1
        yield tuple(out + [current])


def _brute_force(stage_times, fractions, seq_len, micro_batches, rows, floor):
    """Every multiset of batch-slice sizes summing to B, every token slicing of each: the best Eq. 2.4."""
    sizes = batch_slice_sizes(micro_batches * rows, rows)
    costs = {b: [stage_slice_costs(t, f, seq_len, floor, b, rows) for t, f in zip(stage_times, fractions)]
             for b in sizes}

    def partitions(n, largest):
        if n == 0:
            yield ()
        for b in sizes:
            if b <= min(n, largest):
                for rest in partitions(n - b, b):
                    yield (b,) + rest

    best = np.inf
    for sizes_chosen in partitions(micro_batches * rows, micro_batches * rows):
        for slicings in itertools.product(list(_compositions(seq_len)), repeat=len(sizes_chosen)):
            times = []
            for b, lengths in zip(sizes_chosen, slicings):
                for length, context in zip(lengths, np.cumsum((0,) + lengths[:-1])):
                    times.append(max(float(c(length, context)) for c in costs[b]))
            best = min(best, sum(times) + (len(stage_times) - 1) * max(times))
    return best


def test_joint_batch_and_token_slicing_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(25):
        k, seq_len, rows, micro = (int(rng.integers(1, 4)), int(rng.integers(2, 6)), int(rng.integers(1, 3)),
                                   int(rng.integers(1, 3)))
        times, fractions = rng.uniform(0.5, 2, k).tolist(), rng.uniform(0, 1, k).tolist()
        floor = int(rng.integers(1, 2 * seq_len * rows + 1))
        decision = choose_token_slicing(times, fractions, seq_len, micro, rows, saturation_tokens=floor, epsilon=0.0)
        best = _brute_force(times, fractions, seq_len, micro, rows, floor)
        assert decision.latency == pytest.approx(min(best, decision.latency_unsliced), rel=1e-9)
        if decision.batch_slices:
            assert sum(b for b, _ in decision.batch_slices) == micro * rows
    assert batch_slice_sizes(3, 1) == (1, 2) and batch_slice_sizes(12, 3) == (1, 2, 3, 4, 8)


def test_fixed_scheme_latency_is_eq_2_4_over_every_unit():
    """rho = 1 (attention only), floor 1: t(b, k, c) = T b k (c + k) / (R L^2), T = 4, R = 2, L = 8."""
    decision = choose_token_slicing([4.0, 4.0], [1.0, 1.0], 8, 1, 2, saturation_tokens=1,
                                    fixed=((1, (4, 4)), (1, (8,))))
    times = [4.0 / 2 * 1 * 4 * 4 / 64, 4.0 / 2 * 1 * 4 * 8 / 64, 4.0 / 2 * 1 * 8 * 8 / 64]
    assert decision.latency == pytest.approx(sum(times) + max(times))
    assert decision.latency_unsliced == pytest.approx(2 * 4.0)


def test_shared_executables_price_every_slice_at_its_padded_context():
    """share_slice_executables: a slice runs (and is priced) at the longest context among the slices of its
    length. rho = 1, floor 1, T = 4, R = 1, L = 8: t(k, c) = 4 k (c + k) / 64; slices (4, 2, 2) start at 0, 4,
    6, and the two 2-token slices both run at context 6."""
    unpadded = choose_token_slicing([4.0, 4.0], [1.0, 1.0], 8, 1, 1, saturation_tokens=1, fixed=((1, (4, 2, 2)),))
    padded = choose_token_slicing([4.0, 4.0], [1.0, 1.0], 8, 1, 1, saturation_tokens=1, fixed=((1, (4, 2, 2)),),
                                  shared_contexts=True)
    assert unpadded.latency == pytest.approx((1 + 0.75 + 1) + 1)
    assert padded.latency == pytest.approx((1 + 1 + 1) + 1)


def test_shared_executables_drop_slicing_the_padding_makes_dearer():
    """rho = 1/2, floor 1, one stage, L = 8: the DP's 8 one-token slices cost 0.5 + 0.5 * 36/64 = 0.78 of the
    whole sequence; shared, each runs at context 7 (8 x (1/16 + 1/16) = 1.0): no gain, so no slicing."""
    plain = choose_token_slicing([1.0], [0.5], 8, 1, 1, saturation_tokens=1)
    assert plain.batch_slices == ((1, (1,) * 8),) and plain.latency == pytest.approx(0.78125)
    shared = choose_token_slicing([1.0], [0.5], 8, 1, 1, saturation_tokens=1, shared_contexts=True)
    assert shared.batch_slices == () and shared.latency == shared.latency_unsliced == pytest.approx(1.0)


def test_token_grain_keeps_tables_small():
    assert token_grain(512) == 1 and token_grain(2048) == 4 and token_grain(1000) == 2


def test_stage_cost_is_the_stage_time_for_the_whole_sequence():
    cost = stage_slice_costs(3.0, 0.25, 128, saturation_tokens=32)
    assert float(cost(128, 0)) == pytest.approx(3.0)
    assert float(cost(8, 0)) == pytest.approx(float(cost(32, 0)) - 3.0 * 0.25 * (32 * 32 - 8 * 8) / 128**2)


def gpt_plan(num_stages=8, batch_size=8, seq_len=512, **method_options):
    """Planning only (shapes, no arrays) on one simulated 8-GPU node, one layer per stage, one sequence per
    micro-batch. A narrow model keeps the ILP fast."""
    config = gpt.GPTConfig(vocab_size=256, seq_len=seq_len, hidden_size=64, num_layers=num_stages, num_heads=4)
    model = gpt.GPTModel(config)
    params = gpt.gpt_param_shapes(config)
    batch = gpt.gpt_batch_shapes(config, batch_size, position_ids=True)

    def step(params, batch):
        grads = al.grad(gpt.gpt_loss(model))(params, batch)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    method = al.PipeshardParallel(num_micro_batches=batch_size,
                                  layer_option=al.AutoLayerOption(layer_num=num_stages, eps=None),
                                  stage_option=al.UniformStageOption(num_stages=num_stages,
                                                                     submesh_physical_shape=(1, 8 // num_stages),
                                                                     submesh_logical_shape=(1, 8 // num_stages),
                                                                     show_progress=False),
                                  pipeline_schedule="terapipe", **method_options)
    return al.plan(step, params, batch, method=method, cluster=al.ClusterSpec.preset("p3.16xlarge", num_nodes=1))


def test_token_slices_must_cover_the_sequence():
    with pytest.raises(ValueError, match="summing to the sequence length 512"):
        gpt_plan(token_slices=(256, 128))


def test_plan_prints_the_token_slicing_scheme():
    plan = gpt_plan(num_stages=4, batch_size=2, seq_len=256)
    assert plan.token_slicing, "4 stages, 2 sequences of 256 tokens: slicing must pay off"
    assert sum(rows for rows, _ in plan.token_slicing) == 2
    for _, lengths in plan.token_slicing:
        assert sum(lengths) == 256 and list(lengths) == sorted(lengths, reverse=True)
    assert any(len(lengths) > 1 for _, lengths in plan.token_slicing)
    assert plan.estimated_iteration_time < plan.iteration_time_without_token_slicing
    assert format_scheme(plan.token_slicing) in str(plan)
    assert plan.num_micro_batches == len(plan.token_slicing), "the plan must say what runs: its batch slices"
    assert f"micro-batches: {plan.num_micro_batches}," in str(plan)
    again = al.ParallelPlan.from_json(plan.to_json())
    assert again.token_slicing == plan.token_slicing and again.num_micro_batches == plan.num_micro_batches


def test_plan_counts_the_batch_slices_it_runs_as_micro_batches():
    """A fixed scheme of 3 batch slices (rows 4, 2, 2) from a method asking for 8 micro-batches: the plan's
    micro-batches are the 3 batch slices that will run."""
    plan = gpt_plan(num_stages=2, token_slices=((4, (256, 256)), (2, (512,)), (2, (384, 128))))
    assert plan.token_slicing == ((4, (256, 256)), (2, (512,)), (2, (384, 128)))
    assert plan.num_micro_batches == 3
