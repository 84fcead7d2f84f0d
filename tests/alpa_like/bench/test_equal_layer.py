"""The "equal layer" ablation (Alpa Fig. 3.9): the stage DP restricted to equal stage lengths, which still
chooses the submeshes, against brute force."""
import numpy as np
import pytest

from alpa_like.bench import ours
from alpa_like.bench.workloads import cluster_for, make_workload
from alpa_like.compiler.stage_costs import StageCosts
from alpa_like.compiler.stage_dp import solve_stages
from tests.reference import brute_force_stages
from alpa_like.compiler.submesh import submesh_shapes
from alpa_like.compiler.stage_choice import equal_layer_costs

GIB = 2**30


def _costs(seed: int, num_layers: int, cluster: tuple[int, int]) -> StageCosts:
    """Random per-layer times (a few heavy layers), divided by the devices; one view per submesh."""
    rng = np.random.default_rng(seed)
    weight = rng.uniform(0.5, 4.0, num_layers)
    submeshes = submesh_shapes(*cluster)
    return StageCosts.from_fn(num_layers, submeshes,
                              lambda i, j, sub, view: (float(weight[i:j + 1].sum()) / (sub[0] * sub[1]) ** 0.8, 0, 0),
                              logical_shapes=[[(1, n * m)] for n, m in submeshes])


def _best_equal_by_brute_force(costs, cluster, batches):
    """The best plan over brute force restricted to equal stages: every stage length, every submesh choice."""
    best = None
    for per in (k for k in range(1, costs.num_layers + 1) if costs.num_layers % k == 0):
        solution = brute_force_stages(equal_layer_costs(costs, per), cluster, batches, GIB)
        if solution is not None and (best is None or solution.iteration_time < best.iteration_time - 1e-12):
            best = solution
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_layers, cluster", [(4, (1, 4)), (6, (2, 2)), (4, (2, 4))])
def test_equal_layer_dp_equals_brute_force_over_equal_partitions(seed, num_layers, cluster):
    costs = _costs(seed, num_layers, cluster)
    per_length = []
    for per in (k for k in range(1, num_layers + 1) if num_layers % k == 0):
        table = equal_layer_costs(costs, per)
        reference = brute_force_stages(table, cluster, 8, GIB)
        if reference is None:
            continue
        solution = solve_stages(table, cluster, 8, GIB, epsilon=0.0)
        assert set(solution.layers_per_stage) == {per}
        assert solution.iteration_time == pytest.approx(reference.iteration_time)
        per_length.append(solution.iteration_time)
    assert min(per_length) == pytest.approx(_best_equal_by_brute_force(costs, cluster, 8).iteration_time)


def test_equal_layers_may_get_unequal_submeshes():
    """Three one-layer stages on 4 devices, the first layer 4x heavier: the DP gives it (1, 2) and the light
    layers (1, 1) each (stage times 2, 1, 1: Eq. 3.2 = 4 + 7 * 2 with 8 micro-batches); equal submeshes do
    not exist here (4 devices in 3 stages)."""
    weight = [4.0, 1.0, 1.0]
    costs = StageCosts.from_fn(3, [(1, 1), (1, 2), (1, 4)],
                               lambda i, j, sub, view: (sum(weight[i:j + 1]) / (sub[0] * sub[1]), 0, 0),
                               logical_shapes=[[(1, 1)], [(1, 2)], [(1, 4)]])
    solution = solve_stages(equal_layer_costs(costs, 1), (1, 4), 8, GIB)
    assert solution.submeshes == ((1, 2), (1, 1), (1, 1))
    assert solution.iteration_time == pytest.approx(4 + 7 * 2)


def test_equal_layer_costs_rejects_a_length_that_does_not_divide():
    costs = _costs(0, 6, (1, 4))
    with pytest.raises(ValueError, match="layers_per_stage must be an int dividing the 6 layers, got 4"):
        equal_layer_costs(costs, 4)


def test_equal_layer_variant_cuts_equal_stages_and_chooses_submeshes():
    workload = make_workload("gpt-tiny", 8)
    cluster = cluster_for(4)
    result = ours.plan_variant("equal layer", workload, cluster, num_micro_batches=2)
    assert result.ok, result.error
    lengths = {len(stage.layer_ids) for stage in result.plan.stages}
    assert len(lengths) == 1
    assert sum(a * b for a, b in (s.submesh_shape for s in result.plan.stages)) == 4
    auto = ours.plan_variant("auto", workload, cluster, num_micro_batches=2)
    # the automatic DP's space contains every equal-layer plan: its Eq. 3.2 estimate is no worse
    assert auto.plan.estimated_iteration_time <= result.plan.estimated_iteration_time * (1 + 1e-9)
