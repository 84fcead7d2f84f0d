"""The suite's plumbing: cases, rows (with and without plans), the table, the CLI and the backends."""
import jax
import jax.numpy as jnp
import pytest

import alpa_like as al
from alpa_like.bench import __main__ as cli
from alpa_like.bench import ours, report, suites
from alpa_like.bench.ours import equal_operator_layers
from alpa_like.bench.workloads import make_workload


def test_equal_operator_layers_split_matmuls_evenly():
    def f(x, w):
        for _ in range(6):
            x = jnp.tanh(x @ w)
        return x.sum()

    jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 2)), jnp.ones((2, 2))).jaxpr
    layers = equal_operator_layers(3)(jaxpr)
    dots = [layers[i] for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general"]
    assert dots == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="needs at least that many"):
        equal_operator_layers(7)(jaxpr)


def test_unknown_model_or_suite_is_a_clear_error():
    with pytest.raises(ValueError, match="not in the gpt suite"):
        suites.suite_cases("gpt", ["gpt-7t"])
    with pytest.raises(ValueError, match="suite must be one of"):
        suites.suite_cases("bert")
    with pytest.raises(SystemExit):
        cli.parse_args(["bert"])
    with pytest.raises(SystemExit):
        cli.parse_args(["gpt", "--micro-batches", "0"])


def test_rows_without_a_plan_print_as_such():
    row = {"model": "gpt-x", "gpus": 16, "ours": {"auto": {"variant": "auto", "error": "no plan fits 16 GiB\nmore"}},
           "baselines": {"megatron": {"config": "t=8 p=2 d=1 b=1", "step_s": 2.0, "tflops": 100.0}}}
    lines = report.table([row])
    assert lines[1][2] == "no plan: no plan fits 16 GiB"
    assert lines[1][-1] == "-"  # no ratio without our plan
    assert "no plan" in report.format_terminal(lines)


def test_a_tiny_gpt_case_end_to_end():
    case = suites.Case(suite="gpt", model="gpt-tiny", gpus=2, global_batch=8, num_micro_batches=2)
    row = suites.run_case(case, "p3.16xlarge", ablations=True)
    auto = row["ours"]["auto"]
    assert auto["simulated_s"] > 0 and auto["tflops"] > 0
    assert sum(auto["layers_per_stage"]) == 3  # two blocks and the logits
    mega = row["baselines"]["megatron"]
    assert mega["step_s"] > 0 and mega["configs_fitting"] >= 1
    assert set(row["ours"]) == {"auto", "intra-op only", "inter-op only"}
    assert report.table([row])[1][0] == "gpt-tiny"


def test_our_automatic_plan_keeps_the_fastest_micro_batch_count():
    case = suites.Case(suite="gpt", model="gpt-tiny", gpus=2, global_batch=8, num_micro_batches=2,
                       auto_micro_batches=(1, 2, 4, 3))
    auto = suites.run_case(case, "p3.16xlarge")["ours"]["auto"]
    tried = auto["micro_batches_tried"]
    assert set(tried) == {"1", "2", "4"}  # 3 does not divide the batch of 8
    assert auto["simulated_s"] == min(t for t in tried.values() if t is not None)
    assert tried[str(auto["micro_batches"])] == auto["simulated_s"]
    assert report.plan_text(auto).endswith(f", B={auto['micro_batches']}")


def test_cases_try_several_micro_batch_counts_unless_given():
    assert suites.suite_cases("gpt", ["gpt-1.3b"])[0].auto_micro_batches == suites.AUTO_MICRO_BATCHES["gpt"]
    assert suites.suite_cases("gpt", ["gpt-1.3b"], micro_batches=32)[0].auto_micro_batches == (32,)
    assert suites.suite_cases("moe", ["moe-380m"])[0].auto_micro_batches == suites.AUTO_MICRO_BATCHES["moe"]
    assert suites.suite_cases("wresnet", ["wresnet-250m"])[0].auto_micro_batches == (24, 32)


def test_wresnet_ablations_get_their_best_micro_batch_count_from_the_same_grid():
    """Fig. 3.9 compares stage partitionings: on ``wresnet`` the equal-layer and equal-operator plans try the
    row's micro-batch counts as our automatic plan does, each keeping its fastest."""
    case = suites.Case(suite="wresnet", model="wresnet-tiny", gpus=2, global_batch=8, num_micro_batches=2,
                       auto_micro_batches=(1, 2))
    row = suites.run_case(case, "p3.16xlarge")
    for variant in ("auto", "equal layer", "equal operator"):
        entry = row["ours"][variant]
        assert set(entry["micro_batches_tried"]) == {"1", "2"}, variant
        assert entry["simulated_s"] == min(entry["micro_batches_tried"].values()), variant


def test_recompute_aware_layers_reach_the_layer_option_of_remat_workloads_only():
    args = cli.parse_args(["wresnet", "--recompute-aware-layers"])
    cases = suites.suite_cases("wresnet", ["wresnet-250m"], recompute_aware=args.recompute_aware_layers)
    assert cases[0].recompute_aware
    workload = make_workload("wresnet-tiny", 8, recompute_aware=True)
    option = ours.pipeshard_method(workload, 2).layer_option
    assert option.recompute_aware and option.remat_layer
    moe = suites.Case(suite="moe", model="moe-tiny", gpus=2, global_batch=8, num_micro_batches=2,
                      recompute_aware=True)
    with pytest.raises(ValueError, match="recompute-aware-layers: moe-tiny"):
        suites.run_case(moe, "p3.16xlarge")


def test_plan_text_counts_repeats():
    entry = {"stages": 4, "layers_per_stage": [3, 1, 1, 2], "submeshes": [[1, 4], [1, 1], [1, 1], [1, 2]],
             "logical_meshes": [[1, 4], [1, 1], [1, 1], [1, 2]]}
    assert report.plan_text(entry) == "4 st [3, 1 x2, 2] on (1,4),(1,1) x2,(1,2) as 1x4,1x1 x2,1x2"


def test_a_tiny_moe_case_has_every_baseline():
    case = suites.Case(suite="moe", model="moe-tiny", gpus=2, global_batch=8, num_micro_batches=2)
    row = suites.run_case(case, "p3.16xlarge")
    assert set(row["baselines"]) == {"zero2", "zero3", "expert parallel"}
    for entry in row["baselines"].values():
        assert entry["step_s"] > 0
    # the same FLOPs at the same peak: the baselines differ only in communication
    assert row["baselines"]["zero2"]["compute_s"] == pytest.approx(row["baselines"]["zero3"]["compute_s"])


def test_breakdown_plans_auto_equal_layer_and_each_restriction(tmp_path, capsys):
    from alpa_like.bench import breakdown

    assert breakdown.parse_shapes("2x8,1x4") == ((2, 8), (1, 4))
    with pytest.raises(ValueError, match="--restrict takes submesh shapes like 2x8"):
        breakdown.parse_shapes("2by8")
    rows = breakdown.plan_rows("gpt-tiny", 4, [((1, 4),)], num_micro_batches=2, what_if=True)
    assert [r["variant"] for r in rows] == ["auto", "equal layer", "only 1x4"]
    assert rows[2]["submeshes"] == [[1, 4]]  # the only shape allowed: one stage on all four devices
    launches = 2 * 2 + 1  # the mesh runs a forward and a backward per micro-batch and the apply-grad, each launched
    launch = al.ClusterSpec.preset("p3.16xlarge").launch_overhead
    for r in rows:
        assert r["busy_s"][0] == pytest.approx(r["stage_compute_s"][0] + r["stage_intra_op_s"][0] + launches * launch,
                                               rel=0.02)
        # one node: no NIC, so unshared NICs change nothing; free transfers can only shorten the step
        assert r["no_nic_contention_s"] == pytest.approx(r["simulated_s"])
        assert r["free_transfers_s"] <= r["simulated_s"] * (1 + 1e-12)
    text = breakdown.format_rows(rows)
    assert "only 1x4" in text and "free transfers s" in text


def test_breakdown_near_lists_aligned_plans_cheapest_first_each_covering_the_cluster():
    """``--near``: the aligned plans within the slack of the DP's slowest stage, priced by Eq. 3.2 and
    simulated; each uses every device, and they come cheapest first by the DP's price."""
    from alpa_like.bench import breakdown

    rows = breakdown.plan_rows("gpt-tiny", 4, [], num_micro_batches=2, with_auto=False, near=(2.0, 3))
    assert rows and all(r["variant"].startswith("near ") for r in rows)
    for r in rows:
        assert sum(a * b for a, b in r["submeshes"]) == 4
        assert r["simulated_s"] > 0
    predicted = [r["dp_predicted_s"] for r in rows]
    assert predicted == sorted(predicted)


def test_breakdown_parses_a_given_plan_and_rejects_bad_ones():
    from alpa_like.bench import breakdown

    assert breakdown.parse_plan("2,3@1x2,2x4@2x1,4x2") == ((2, 3), ((1, 2), (2, 4)), ((2, 1), (4, 2)))
    option = breakdown.manual_option((2, 3), ((1, 2), (2, 4)), ((2, 1), (4, 2)))
    assert option.forward_stage_layer_ids == ((0, 1), (2, 3, 4))
    for bad, match in (("2,3@1x2,2x4", "LAYERS@SUBMESHES@LOGICAL"), ("2,x@1x2,2x4@2x1,4x2", "LAYERS@SUBMESHES"),
                       ("2@1x2,2x4@2x1,4x2", "one positive layer count"), ("0,3@1x2,2x4@2x1,4x2", "positive"),
                       ("2,3@1x2,2x4@2x1,2x2", "logical mesh 2x2 does not have the 8 devices")):
        with pytest.raises(ValueError, match=match):
            breakdown.parse_plan(bad)


def test_breakdown_prices_a_given_plan_no_better_than_the_dp():
    """A given plan inside the DP's space, priced by the same cost table, is never better than the DP's
    optimum (Eq. 3.2), and its stages are the ones asked for."""
    from alpa_like.bench import breakdown
    from alpa_like.bench.workloads import make_workload

    layers = make_workload("gpt-tiny", 8).num_layers
    given = ((1, layers - 1), ((1, 2), (1, 2)), ((1, 2), (2, 1)))
    rows = breakdown.plan_rows("gpt-tiny", 4, [], num_micro_batches=2, plans=[given])
    auto, manual = rows[0], rows[-1]
    assert manual["variant"].startswith("given [1, ")
    assert manual["layers_per_stage"] == [1, layers - 1]
    assert manual["submeshes"] == [[1, 2], [1, 2]] and manual["logical_meshes"] == [[1, 2], [2, 1]]
    assert auto["dp_predicted_s"] <= manual["dp_predicted_s"] * (1 + 1e-9)
    wrong = breakdown.plan_rows("gpt-tiny", 4, [], num_micro_batches=2, with_auto=False,
                                plans=[((1, 1), ((1, 2), (1, 2)), ((1, 2), (1, 2)))])
    assert "layers 0.." in wrong[0]["error"]  # the layers must cover the model: a row with the planner's message


def test_cyclic_gc_is_paused_inside_and_restored_after():
    import gc

    from alpa_like.bench import ours

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with ours.cyclic_gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with ours.cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a caller's own pause is kept
    finally:
        gc.enable()


@pytest.mark.parametrize("seed", range(6))
def test_near_optimal_plans_start_with_the_brute_force_optimum(seed):
    """On two devices every layout is aligned, so the cheapest plan :func:`near_optimal_stages` lists with an
    unbounded slowest stage is the brute-force optimum of Eq. 3.2 (random times and memory, some views not
    fitting); the list is sorted, and a bound keeps only plans whose every stage is within it."""
    import numpy as np

    from alpa_like.bench import breakdown
    from alpa_like.compiler.stage_costs import StageCosts, pipeline_latency
    from tests.reference import brute_force_stages

    rng = np.random.default_rng(seed)
    table = {}

    def cost(i, j, sub, view):
        key = (i, j, sub, view)
        if key not in table:
            table[key] = (float(rng.uniform(0.5, 2.0)) * (j - i + 1) / sub[1], float(rng.uniform(0, 0.8)),
                          float(rng.uniform(0, 0.2)))
        return table[key]

    costs = StageCosts.from_fn(4, [(1, 1), (1, 2)], cost)
    best = brute_force_stages(costs, (1, 2), 3, 1.0)
    plans = breakdown.near_optimal_stages(costs, (1, 2), 3, 1.0, np.inf)
    assert best is not None and plans
    assert plans[0][0] == pytest.approx(best.iteration_time)
    assert [t for t, _ in plans] == sorted(t for t, _ in plans)
    assert all(t == pytest.approx(pipeline_latency(stages, 3)) for t, stages in plans)
    bound = best.t_max
    kept = breakdown.near_optimal_stages(costs, (1, 2), 3, 1.0, bound)
    assert kept and all(max(s.t_intra for s in stages) <= bound for _, stages in kept)
    assert [t for t, _ in kept] == [t for t, stages in plans if max(s.t_intra for s in stages) <= bound]


def test_breakdown_near_optimal_plans_are_simulated_and_the_first_is_the_dps():
    from alpa_like.bench import breakdown

    rows = breakdown.plan_rows("gpt-tiny", 4, [], num_micro_batches=2, near=(1.5, 3))
    auto, near = rows[0], [r for r in rows if r["variant"].startswith("near ")]
    assert 1 <= len(near) <= 3 and near[0]["variant"].startswith("near 1 of ")
    assert near[0]["dp_predicted_s"] >= auto["dp_predicted_s"] * (1 - 1e-9)  # the DP's optimum is a lower bound
    assert all(r["simulated_s"] > 0 for r in near)
    assert [r["dp_predicted_s"] for r in near] == sorted(r["dp_predicted_s"] for r in near)
    with pytest.raises(ValueError, match="--near takes a slack >= 1"):
        breakdown.plan_rows("gpt-tiny", 4, [], num_micro_batches=2, with_auto=False, near=(0.5, 3))
