"""The stage DP (Alpa Eq. 3.2-3.5, Alg. 2) against brute force, its pruning, its memory rule and its speed."""
import dataclasses
import doctest
import math
import time
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from alpa_like.compiler import stage_dp as stage_dp_module
from alpa_like.compiler.logical_mesh import logical_shapes
from alpa_like.compiler.schedule_tables import make_schedule
from alpa_like.compiler.schedules import ScheduleName
from alpa_like.compiler import stage_costs, stage_placement
from alpa_like.compiler.stage_costs import StageCosts
from alpa_like.compiler.stage_dp import micro_batches_in_flight, solve_stages
from alpa_like.compiler.stage_placement import AlignedLayouts, contiguous_offsets, price_placed_stages, shared_nodes
from tests.reference import brute_force_stages
from alpa_like.compiler.submesh import assign_devices, submesh_shapes

GIB = 2**30
SMALL_CLUSTERS = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2), (8, 1), (1, 6), (3, 2)]


def random_costs(seed: int, num_layers: int, cluster: tuple[int, int]) -> StageCosts:
    """A random subset of submeshes and views, some views listed twice (a second, ``"lean"`` variant); times
    roughly ``layers / devices^0.5`` times a random factor in [0.3, 3], on a 0.1 s grid (ties happen), 15%
    infeasible; with ``device_memory = 10`` memory binds for some stages, more often the earlier ones
    (Eq. 3.5)."""
    rng = np.random.default_rng(seed)
    allowed = submesh_shapes(*cluster)
    submeshes = [s for s in allowed if rng.random() < 0.8] or [allowed[-1]]
    views, variants = [], []
    for n, m in submeshes:
        shapes = logical_shapes(n * m)
        chosen = [v for v in shapes if rng.random() < 0.6] or [shapes[0]]
        lean = [v for v in chosen if rng.random() < 0.3]
        views.append(chosen + lean)
        variants.append([""] * len(chosen) + ["lean"] * len(lean))
    shape = (num_layers, num_layers, len(submeshes), max(map(len, views)))
    layers = (np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1)[:, :, None, None]
    devices = np.array([n * m for n, m in submeshes])[None, None, :, None]
    t = np.maximum(np.round(layers * rng.uniform(0.3, 3.0, shape) / devices**0.5, 1), 0.1)
    t[rng.random(shape) < 0.15] = np.inf
    for p, v in enumerate(views):
        t[:, :, p, len(v):] = np.inf
    return StageCosts(num_layers=num_layers, submeshes=submeshes, logical_shapes=views, variants=variants,
                      t_intra=t, mem_stage=rng.uniform(0.0, 5.0, shape), mem_act=rng.uniform(0.0, 2.0, shape))


def uniform_layers(num_layers, cluster, heavy=None, heavy_factor=4.0) -> StageCosts:
    """GPT-like additive costs: identical layers (one ``heavy`` layer optional) whose intra-op efficiency drops
    with the tensor-parallel degree and with data parallelism across nodes; memory never binds."""
    work = np.ones(num_layers)
    if heavy is not None:
        work[heavy] = heavy_factor
    prefix = np.concatenate([[0.0], np.cumsum(work)])

    def cost(first, last, submesh, view):
        devices, (dp, tp) = submesh[0] * submesh[1], view
        across_nodes = 5.0 if submesh[0] > 1 else 1.0
        seconds = (prefix[last + 1] - prefix[first]) * (1.0 / devices + 0.02 * (tp - 1) + 0.01 * (dp - 1)
                                                        * across_nodes)
        return seconds, 0.0, 0.0

    return StageCosts.from_fn(num_layers, submesh_shapes(*cluster), cost)


def gpt_like_costs(num_layers, cluster, noise=0.0, seed=0, views_per_submesh=2) -> StageCosts:
    """A 39B-GPT-flavoured table: embedding in the first layer, LM head in the last, tensor parallelism
    slower across nodes, 8 GB/layer of weights and optimizer state sharded over the submesh, 0.3 GB/layer of
    activations per micro-batch divided by the tensor-parallel degree; ``noise`` makes every entry distinct
    (as profiling would)."""
    n_nodes, per_node = cluster
    rng = np.random.default_rng(seed)
    submeshes = submesh_shapes(*cluster)
    views = [logical_shapes(n * m)[-views_per_submesh:] for n, m in submeshes]
    shape = (num_layers, num_layers, len(submeshes), max(map(len, views)))
    t, mem_stage, mem_act = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
    work = np.ones(num_layers)
    work[0] += 0.5
    work[-1] += 1.0
    prefix = np.concatenate([[0.0], np.cumsum(work)])
    first, last = np.triu_indices(num_layers)
    stage_work = prefix[last + 1] - prefix[first]
    for p, (n, m) in enumerate(submeshes):
        for l, (dp, tp) in enumerate(views[p]):
            tp_slowdown = 1.0 if tp <= per_node else 10.0
            dp_slowdown = 1.0 if n == 1 else 5.0
            seconds = stage_work * (0.2 / (n * m) + 0.01 * (tp - 1) * tp_slowdown
                                    + 0.002 * (dp - 1) / dp * dp_slowdown)
            t[first, last, p, l] = seconds * (1.0 + noise * rng.random(len(first)))
            mem_stage[first, last, p, l] = stage_work * 8e9 / (n * m)
            mem_act[first, last, p, l] = stage_work * 0.3e9 / tp
    return StageCosts(num_layers=num_layers, submeshes=submeshes, logical_shapes=views, t_intra=t,
                      mem_stage=mem_stage, mem_act=mem_act)


def with_boundary_saving(costs: StageCosts, seed: int) -> StageCosts:
    """``costs`` with a random ``boundary_saving`` of 30-90% of each entry's fastest time per side, on the
    0.1 s grid (0 where the entry is infeasible)."""
    rng = np.random.default_rng(seed)
    fastest = np.where(np.isfinite(costs.t_intra), costs.t_intra, np.nan)
    fastest = np.nan_to_num(np.nanmin(np.where(np.isnan(fastest), np.inf, fastest), axis=-1), posinf=0.0)
    saving = np.round(fastest[..., None] * rng.uniform(0.3, 0.9, fastest.shape + (2,)), 1)
    return dataclasses.replace(costs, boundary_saving=saving)


def with_nic_wait(costs: StageCosts, seed: int, high: float = 0.6) -> StageCosts:
    """``costs`` with a random ``nic_wait`` of 0-``high`` times each entry's fastest time per side, on a
    0.01 s grid (0 where the entry is infeasible)."""
    rng = np.random.default_rng(seed)
    fastest = np.nan_to_num(np.min(costs.t_intra, axis=-1), posinf=0.0)
    nic = np.round(fastest[..., None] * rng.uniform(0.0, high, fastest.shape + (2,)), 2)
    return dataclasses.replace(costs, nic_wait=nic)


def placed_t_intra(costs: StageCosts, stages, cluster) -> list[float]:
    """Stage times for the placement ``assign_devices`` gives, when the plan's contiguous layout is aligned:
    the table's time minus the saving of each boundary whose two meshes share their node(s), plus, for each
    boundary across nodes, the ``nic_wait`` of that side once for each of the sending and receiving nodes
    that is a middle node (neither the first nor the last) holding two meshes or more; otherwise the table's
    time (every boundary priced across nodes, each transfer with NICs to itself)."""
    table = [float(costs.t_intra[s.layers[0], s.layers[1], s.submesh_index, s.view_index]) for s in stages]
    sizes = [n * m for n, m in (s.submesh for s in stages)]
    if ((costs.boundary_saving is None and costs.nic_wait is None)
            or contiguous_offsets(sizes, cluster[1]) is None):
        return table
    nodes = [{d // cluster[1] for d in ids} for ids in assign_devices([s.submesh for s in stages], *cluster)]
    shared = {n for n in range(1, cluster[0] - 1) if sum(nodes_ == {n} for nodes_ in nodes) >= 2}
    zeros = np.zeros(costs.t_intra.shape[:3] + (2,))
    savings = zeros if costs.boundary_saving is None else costs.boundary_saving
    nics = zeros if costs.nic_wait is None else costs.nic_wait
    times = []
    for q, stage in enumerate(stages):
        index = (stage.layers[0], stage.layers[1], stage.submesh_index)
        before = q > 0 and nodes[q - 1] == nodes[q]
        after = q + 1 < len(stages) and nodes[q + 1] == nodes[q]
        seconds = max(table[q] - before * savings[index][0] - after * savings[index][1], 0.0)
        if q > 0 and not before:
            seconds += ((max(nodes[q - 1]) in shared) + (min(nodes[q]) in shared)) * nics[index][0]
        if q + 1 < len(stages) and not after:
            seconds += ((max(nodes[q]) in shared) + (min(nodes[q + 1]) in shared)) * nics[index][1]
        times.append(seconds)
    return times


def check_solution(solution, costs, cluster, batches, device_memory, schedule="1f1b"):
    """The plan is well formed: contiguous layers, the whole cluster, table costs, Eq. 3.5 and Eq. 3.2."""
    stages = solution.stages
    assert stages[0].layers[0] == 0 and stages[-1].layers[1] == costs.num_layers - 1
    for before, after in zip(stages, stages[1:]):
        assert after.layers[0] == before.layers[1] + 1
    assert sum(n * m for n, m in solution.submeshes) == cluster[0] * cluster[1]
    for q, stage in enumerate(stages):
        (i, j), p = stage.layers, stage.submesh_index
        l = stage.view_index
        assert costs.logical_shapes[p][l] == stage.logical_shape and costs.variants[p][l] == stage.variant
        assert costs.submeshes[p] == stage.submesh
        assert stage.t_intra == pytest.approx(placed_t_intra(costs, stages, cluster)[q], rel=1e-12, abs=1e-12)
        held = micro_batches_in_flight(schedule, len(stages), batches)[len(stages) - 1 - q]
        memory = costs.mem_stage[i, j, p, l] + held * costs.mem_act[i, j, p, l]
        assert stage.memory_per_device == pytest.approx(memory)
        assert memory <= device_memory
    times = [stage.t_intra for stage in stages]
    assert solution.t_max == max(times)
    c = float(ScheduleName(schedule).bubble_weight)
    assert solution.iteration_time == pytest.approx(c * sum(times) + (batches - c) * max(times), rel=1e-12)
    assign_devices(solution.submeshes, *cluster)  # Placeable (App. 3.11).


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(1, 5), cluster=st.sampled_from(SMALL_CLUSTERS),
       batches=st.integers(1, 12), schedule=st.sampled_from(["1f1b", "gpipe", "zb_h1", "zb_h2"]))
def test_dp_equals_brute_force(seed, num_layers, cluster, batches, schedule):
    costs = random_costs(seed, num_layers, cluster)
    expected = brute_force_stages(costs, cluster, batches, 10.0, schedule=schedule)
    event("no plan" if expected is None else f"{len(expected.stages)} stage(s)")
    if expected is None:
        with pytest.raises(ValueError, match="no pipeline plan"):
            solve_stages(costs, cluster, batches, 10.0, epsilon=0.0, schedule=schedule)
        return
    solution = solve_stages(costs, cluster, batches, 10.0, epsilon=0.0, schedule=schedule)
    assert solution.iteration_time == pytest.approx(expected.iteration_time, rel=1e-12)
    check_solution(solution, costs, cluster, batches, 10.0, schedule)
    check_solution(expected, costs, cluster, batches, 10.0, schedule)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(4, 5),
       cluster=st.sampled_from([(1, 8), (2, 4), (4, 2), (8, 1), (3, 2)]), batches=st.integers(8, 32),
       device_memory=st.sampled_from([10.0, 100.0]))
def test_dp_equals_brute_force_deep_pipelines(seed, num_layers, cluster, batches, device_memory):
    """Many devices, many micro-batches and (often) loose memory: pipelines of 3-5 stages are common."""
    costs = random_costs(seed, num_layers, cluster)
    expected = brute_force_stages(costs, cluster, batches, device_memory)
    event("no plan" if expected is None else f"{len(expected.stages)} stage(s)")
    if expected is None:
        with pytest.raises(ValueError, match="no pipeline plan"):
            solve_stages(costs, cluster, batches, device_memory, epsilon=0.0)
        return
    solution = solve_stages(costs, cluster, batches, device_memory, epsilon=0.0)
    assert solution.iteration_time == pytest.approx(expected.iteration_time, rel=1e-12)
    check_solution(solution, costs, cluster, batches, device_memory)


MULTI_NODE_CLUSTERS = [(2, 1), (2, 2), (4, 1), (2, 4), (4, 2), (3, 2), (2, 6)]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(2, 5), cluster=st.sampled_from(MULTI_NODE_CLUSTERS),
       batches=st.integers(1, 32), device_memory=st.sampled_from([10.0, 100.0]))
def test_dp_with_boundaries_inside_nodes_equals_brute_force(seed, num_layers, cluster, batches, device_memory):
    """With ``boundary_saving`` the DP prices the aligned contiguous layouts for their placement (and the
    others across nodes) and still finds the brute-force optimum; every stage's time is the one its real
    placement (``assign_devices``) gives."""
    costs = with_boundary_saving(random_costs(seed, num_layers, cluster), seed + 1)
    expected = brute_force_stages(costs, cluster, batches, device_memory)
    if expected is None:
        return
    solution = solve_stages(costs, cluster, batches, device_memory, epsilon=0.0)
    table = [costs.t_intra[s.layers[0], s.layers[1], s.submesh_index, s.view_index] for s in solution.stages]
    event(f"{sum(s.t_intra < t for s, t in zip(solution.stages, table))} stage(s) priced inside a node")
    assert solution.iteration_time == pytest.approx(expected.iteration_time, rel=1e-12)
    check_solution(solution, costs, cluster, batches, device_memory)
    check_solution(expected, costs, cluster, batches, device_memory)
    pruned = solve_stages(costs, cluster, batches, device_memory)
    assert pruned.iteration_time == pytest.approx(expected.iteration_time, rel=1e-12)


SHARING_CLUSTERS = [(3, 2), (4, 2), (3, 4), (2, 4), (4, 1)]


def small_mesh_costs(seed: int, num_layers: int, cluster: tuple[int, int]) -> StageCosts:
    """Random costs that favour many stages on small meshes (so that plans with two meshes on a middle node
    are often the best): ``layers / devices^0.3`` times the submesh's nodes times a random factor in
    [0.5, 1.5], on the 0.1 s grid; two logical views per submesh; memory never binds."""
    rng = np.random.default_rng(seed)
    submeshes = submesh_shapes(*cluster)
    views = [logical_shapes(n * m)[:2] for n, m in submeshes]
    shape = (num_layers, num_layers, len(submeshes), max(map(len, views)))
    layers = (np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1)[:, :, None, None]
    devices = np.array([n * m for n, m in submeshes])[None, None, :, None]
    nodes = np.array([n for n, _ in submeshes])[None, None, :, None]
    t = np.maximum(np.round(layers * rng.uniform(0.5, 1.5, shape) / devices**0.3 * nodes, 1), 0.1)
    for p, v in enumerate(views):
        t[:, :, p, len(v):] = np.inf
    return StageCosts(num_layers=num_layers, submeshes=submeshes, logical_shapes=views, t_intra=t,
                      mem_stage=np.zeros(shape), mem_act=np.zeros(shape))


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(2, 5), cluster=st.sampled_from(SHARING_CLUSTERS),
       batches=st.integers(1, 32), device_memory=st.sampled_from([10.0, 100.0]), saving=st.booleans(),
       small_meshes=st.booleans(), nic_high=st.sampled_from([0.05, 0.6]))
def test_dp_with_shared_nics_equals_brute_force(seed, num_layers, cluster, batches, device_memory, saving,
                                                small_meshes, nic_high):
    """With ``nic_wait`` an aligned plan pays for the shared NICs of its middle nodes (misaligned plans are
    not considered, see "Shared NICs"); the DP still finds the brute-force optimum, and
    every stage's time is the one its real placement (``assign_devices``) gives."""
    if small_meshes:  # a pipeline long enough to put two meshes on a middle node
        num_layers, cluster = 5, (4, 2) if cluster[0] == 4 else (3, 2)
    costs = (small_mesh_costs if small_meshes else random_costs)(seed, num_layers, cluster)
    costs = with_nic_wait(costs, seed + 3, nic_high)
    if saving:
        costs = with_boundary_saving(costs, seed + 1)
    expected = brute_force_stages(costs, cluster, batches, device_memory)
    if expected is None:
        return
    sizes = [n * m for n, m in expected.submeshes]
    event("best plan shares a node's NICs" if contiguous_offsets(sizes, cluster[1]) is not None
          and shared_nodes(sizes, cluster[1]) else "best plan shares no NIC")
    solution = solve_stages(costs, cluster, batches, device_memory, epsilon=0.0)
    assert solution.iteration_time == pytest.approx(expected.iteration_time, rel=1e-12)
    check_solution(solution, costs, cluster, batches, device_memory)
    check_solution(expected, costs, cluster, batches, device_memory)


def shared_middle_node_costs() -> StageCosts:
    """4 one-layer stages on 3 nodes of 2 devices: layers 0 and 3 on (1, 2), layers 1 and 2 on (1, 1) (the
    only finite entries), so the only plan puts two meshes on the middle node. Each layer computes 1 s and
    receives 0.6 s from each neighbour across nodes (0.1 s inside a node) and waits 0.5 s for each shared NIC
    on the way (``nic_wait``)."""
    def cost(i, j, sub, view):
        fits = i == j and sub == ((1, 2) if i in (0, 3) else (1, 1))
        return (1.0 + 0.6 * ((i > 0) + (j < 3)) if fits else math.inf), 0.0, 0.0
    costs = StageCosts.from_fn(4, [(1, 1), (1, 2)], cost, logical_shapes=[[(1, 1)], [(1, 2)]])
    return dataclasses.replace(costs, boundary_saving=np.full((4, 4, 2, 2), 0.5),
                               nic_wait=np.full((4, 4, 2, 2), 0.5))


def test_two_meshes_on_a_middle_node_pay_for_its_shared_nic():
    """Closed form (see :func:`shared_middle_node_costs`), B = 4. Node 1's inbound NIC carries stage 1's
    activations and stage 2's gradients, its outbound NIC stage 1's gradients to stage 0 and stage 2's
    activations to stage 3: each of these four receives waits 0.5 s. Stage 0: 1 + 0.6 + 0.5;
    stage 1: 1 + 0.6 + 0.1 + 0.5; stage 2 likewise; stage 3 like stage 0: 2.1 + 2.2 + 2.2 + 2.1 + 3 * 2.2 =
    15.2 s. Contention-free (no ``nic_wait``): 1.6 + 1.7 + 1.7 + 1.6 + 3 * 1.7 = 11.7 s."""
    costs = shared_middle_node_costs()
    solution = solve_stages(costs, (3, 2), num_micro_batches=4, device_memory=1.0)
    assert solution.submeshes == ((1, 2), (1, 1), (1, 1), (1, 2))
    assert [s.t_intra for s in solution.stages] == pytest.approx([2.1, 2.2, 2.2, 2.1])
    assert solution.iteration_time == pytest.approx(15.2)
    free = solve_stages(dataclasses.replace(costs, nic_wait=None), (3, 2), 4, 1.0)
    assert [s.t_intra for s in free.stages] == pytest.approx([1.6, 1.7, 1.7, 1.6])
    assert free.iteration_time == pytest.approx(11.7)
    table = [dataclasses.replace(s, t_intra=float(costs.t_intra[s.layers[0], s.layers[1], s.submesh_index, 0]))
             for s in solution.stages]
    assert price_placed_stages(costs, table, 2) == solution.stages


def test_a_shared_nic_can_change_the_plan():
    """The shared-node plan of :func:`shared_middle_node_costs` (2.2 s slowest stage) against one more
    choice: layers 1-2 on the whole middle node, (1, 2), in 2.2 s. Blind to contention the split middle node
    wins (1.7 s slowest: 11.7 s against 1.6 + 2.2 + 1.6 + 3 * 2.2 = 12.0 s); with shared NICs the whole-node
    stage does (12.0 s against 15.2 s)."""
    costs = shared_middle_node_costs()
    t = costs.t_intra.copy()
    t[1, 2, 1, 0] = 2.2
    costs = dataclasses.replace(costs, t_intra=t)
    blind = solve_stages(dataclasses.replace(costs, nic_wait=None), (3, 2), 4, 1.0)
    assert blind.submeshes == ((1, 2), (1, 1), (1, 1), (1, 2)) and blind.iteration_time == pytest.approx(11.7)
    aware = solve_stages(costs, (3, 2), 4, 1.0)
    assert aware.submeshes == ((1, 2), (1, 2), (1, 2)) and aware.iteration_time == pytest.approx(12.0)


def test_with_shared_nics_a_plan_that_only_fits_misaligned_is_reported():
    """On 3 nodes of 4 the only finite plan is (1, 1), (1, 2), (1, 1), (2, 4): its (1, 2) mesh starts at
    device 1 (misaligned). Without ``nic_wait`` the DP takes it at the table's price; with it the DP
    considers aligned plans only and says so."""
    layout = {(0, 1): 1.0, (1, 2): 1.0, (2, 1): 1.0, (3, 8): 1.0}
    def cost(i, j, sub, view):
        return (layout.get((i, sub[0] * sub[1]), math.inf) if i == j else math.inf), 0.0, 0.0
    costs = StageCosts.from_fn(4, [(1, 1), (1, 2), (2, 4)], cost, logical_shapes=[[(1, 1)], [(1, 2)], [(2, 4)]])
    assert solve_stages(costs, (3, 4), 1, 1.0).submeshes == ((1, 1), (1, 2), (1, 1), (2, 4))
    with pytest.raises(ValueError, match="no aligned contiguous plan .* only misaligned plans fit"):
        solve_stages(dataclasses.replace(costs, nic_wait=np.full((4, 4, 3, 2), 0.1)), (3, 4), 1, 1.0)
    assert brute_force_stages(dataclasses.replace(costs, nic_wait=np.full((4, 4, 3, 2), 0.1)), (3, 4), 1,
                              1.0) is None


def test_shared_nodes_are_the_middle_nodes_with_two_meshes():
    assert shared_nodes([8, 4, 4, 8, 8], 8) == {1}
    assert shared_nodes([4, 4, 8, 4, 4], 8) == set()  # first and last node: one crossing boundary each
    assert shared_nodes([8, 2, 2, 4, 4, 4, 8], 8) == {1, 2}
    assert shared_nodes([16, 8, 8], 8) == set()
    with pytest.raises(ValueError, match="not an aligned contiguous layout"):
        shared_nodes([2, 4, 2], 8)


def test_boundaries_inside_a_node_are_priced_at_the_intra_node_link():
    """Closed form: 4 one-layer stages on 2 nodes of 2 devices, B = 1. Each layer computes 1 s and receives
    0.6 s from each neighbour across nodes, 0.1 s inside a node (saving 0.5 s). Laid out in order, the
    boundaries after stages 0 and 2 stay inside a node, the one after stage 1 crosses: 1.1 + 1.7 + 1.7 + 1.1."""
    def cost(i, j, sub, view):
        return (1.0 + 0.6 * ((i > 0) + (j < 3)) if i == j else math.inf), 0.0, 0.0
    costs = StageCosts.from_fn(4, [(1, 1)], cost, logical_shapes=[[(1, 1)]])
    costs = dataclasses.replace(costs, boundary_saving=np.full((4, 4, 1, 2), 0.5))
    solution = solve_stages(costs, (2, 2), num_micro_batches=1, device_memory=1.0)
    assert [s.t_intra for s in solution.stages] == pytest.approx([1.1, 1.7, 1.7, 1.1])
    assert solution.iteration_time == pytest.approx(5.6)
    without = solve_stages(dataclasses.replace(costs, boundary_saving=None), (2, 2), 1, 1.0)
    assert without.iteration_time == pytest.approx(7.6)


def test_a_misaligned_layout_keeps_the_across_node_price():
    """(1, 2), (1, 4), (1, 2) on one node of 8 is placed by the covering construction (the 4-device mesh
    would start at offset 2): no saving is taken, though all three share the node."""
    def cost(i, j, sub, view):
        return ({(0, 0, 2): 1.0, (1, 1, 4): 1.0, (2, 2, 2): 1.0}.get((i, j, sub[1]), math.inf), 0.0, 0.0)
    costs = StageCosts.from_fn(3, [(1, 2), (1, 4)], cost, logical_shapes=[[(1, 2)], [(1, 4)]])
    costs = dataclasses.replace(costs, boundary_saving=np.full((3, 3, 2, 2), 0.4))
    solution = solve_stages(costs, (1, 8), num_micro_batches=1, device_memory=1.0)
    assert solution.submeshes == ((1, 2), (1, 4), (1, 2))
    assert [s.t_intra for s in solution.stages] == [1.0, 1.0, 1.0]


def test_contiguous_offsets():
    assert contiguous_offsets([1, 1, 2, 4, 8, 16], 8) == [0, 1, 2, 4, 8, 16]
    assert contiguous_offsets([1, 2, 1], 4) is None  # (1, 2) at offset 1.
    assert contiguous_offsets([4, 8], 8) is None  # A whole node at offset 4.
    assert contiguous_offsets([2, 6], 6) is None and contiguous_offsets([6, 2, 2, 2], 6) == [0, 6, 8, 10]


@settings(max_examples=200, deadline=None)
@given(cluster=st.sampled_from([(2, 2), (2, 4), (4, 2), (3, 4), (2, 8), (2, 6), (4, 4)]), data=st.data())
def test_assign_devices_keeps_an_aligned_layout_on_its_nodes(cluster, data):
    """What the DP's boundary pricing relies on: for an aligned contiguous layout, every stage lands on the
    nodes of that layout."""
    n_nodes, per_node = cluster
    shapes, left = [], n_nodes * per_node
    while left:
        shape = data.draw(st.sampled_from([s for s in submesh_shapes(*cluster) if s[0] * s[1] <= left]))
        shapes.append(shape)
        left -= shape[0] * shape[1]
    offsets = contiguous_offsets([n * m for n, m in shapes], per_node)
    event("aligned" if offsets is not None else "misaligned")
    if offsets is None:
        return
    for (n, m), offset, ids in zip(shapes, offsets, assign_devices(shapes, *cluster)):
        expected = set(range(offset // per_node, (offset + n * m - 1) // per_node + 1))
        assert {d // per_node for d in ids} == expected


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(1, 10),
       cluster=st.sampled_from([(1, 4), (2, 4), (4, 4), (2, 8)]), batches=st.integers(1, 32))
def test_pruned_enumeration_equals_full_enumeration(seed, num_layers, cluster, batches):
    """Bisection + ``B * t_max >= T*`` + interval bounds find what solving every t_max (epsilon = 0) finds."""
    costs = random_costs(seed, num_layers, cluster)
    try:
        full = solve_stages(costs, cluster, batches, 10.0, epsilon=0.0, prune=False)
    except ValueError:
        with pytest.raises(ValueError, match="no pipeline plan"):
            solve_stages(costs, cluster, batches, 10.0, epsilon=0.0)
        return
    pruned = solve_stages(costs, cluster, batches, 10.0, epsilon=0.0)
    assert pruned.iteration_time == pytest.approx(full.iteration_time, rel=1e-12)
    assert pruned.num_t_max_evaluated <= full.num_t_max_evaluated
    default = solve_stages(costs, cluster, batches, 10.0)  # epsilon = 1e-6 s on a 0.1 s grid: same answer.
    assert default.iteration_time == pytest.approx(full.iteration_time, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(1, 5), cluster=st.sampled_from(SMALL_CLUSTERS),
       batches=st.integers(1, 8), epsilon=st.sampled_from([0.05, 0.3, 1.0, 3.0]))
def test_epsilon_costs_at_most_b_minus_1_epsilon(seed, num_layers, cluster, batches, epsilon):
    costs = random_costs(seed, num_layers, cluster)
    exact = brute_force_stages(costs, cluster, batches, 10.0)
    if exact is None:
        return
    solution = solve_stages(costs, cluster, batches, 10.0, epsilon=epsilon)
    check_solution(solution, costs, cluster, batches, 10.0)
    assert exact.iteration_time - 1e-9 <= solution.iteration_time <= exact.iteration_time + (batches - 1) * epsilon


def test_epsilon_groups_are_solved_at_their_largest_value():
    """t_intra values 1.0, 1.3 and 5.0 with epsilon = 0.5. Skipping 1.3 because it is within epsilon of the
    last solved 1.0 (which is infeasible) would admit the two-stage plan only at t_max = 5.0."""
    costs = StageCosts.from_fn(2, [(1, 1), (1, 2)], lambda i, j, sub, view: (
        {(0, 0, 1): 1.0, (1, 1, 1): 1.3, (0, 1, 2): 5.0}.get((i, j, sub[1]), math.inf), 0.0, 0.0),
        logical_shapes=[[(1, 1)], [(1, 2)]])
    solution = solve_stages(costs, (1, 2), num_micro_batches=4, device_memory=1.0, epsilon=0.5)
    assert solution.layers_per_stage == (1, 1)
    assert solution.iteration_time == pytest.approx(1.0 + 1.3 + 3 * 1.3)


@pytest.mark.parametrize("num_layers, cluster, batches", [(8, (2, 4), 16), (16, (2, 8), 32), (24, (4, 8), 64),
                                                          (12, (1, 8), 16)])
def test_gpt_gets_equal_layers_per_stage(num_layers, cluster, batches):
    costs = uniform_layers(num_layers, cluster)
    solution = solve_stages(costs, cluster, batches, device_memory=GIB)
    assert len(solution.stages) > 1
    assert len(set(solution.layers_per_stage)) == 1, solution.layers_per_stage
    assert len(set(solution.submeshes)) == 1


@pytest.mark.parametrize("num_layers, cluster, batches, heavy", [(8, (2, 4), 16, 2), (16, (2, 8), 32, 5),
                                                                 (12, (1, 8), 16, 4)])
def test_a_heavy_layer_gets_uneven_stages(num_layers, cluster, batches, heavy):
    solution = solve_stages(uniform_layers(num_layers, cluster, heavy=heavy), cluster, batches, GIB)
    lengths = solution.layers_per_stage
    assert len(set(lengths)) > 1, lengths
    with_heavy = next(s for s in solution.stages if s.layers[0] <= heavy <= s.layers[1])
    assert with_heavy.num_layers == min(lengths) or with_heavy.submesh[0] * with_heavy.submesh[1] > min(
        n * m for n, m in solution.submeshes)


def _two_layer_costs(mem_stage_first, mem_act_first):
    """Two unit layers on a 1 x 2 cluster: two (1, 1) stages (t = 1 each) beat one (1, 2) stage (t = 2.5)
    unless layer 0, as the first of two 1F1B stages (2 micro-batches in flight), runs out of memory."""
    def cost(i, j, sub, view):
        if sub == (1, 2):
            return (2.5 if (i, j) == (0, 1) else math.inf), 1.0, 1.0
        if i == j == 0:
            return 1.0, mem_stage_first, mem_act_first
        return (1.0 if i == j else math.inf), 1.0, 1.0
    return StageCosts.from_fn(2, [(1, 1), (1, 2)], cost, logical_shapes=[[(1, 1)], [(1, 2)]])


def test_stage_over_memory_is_never_chosen():
    roomy = solve_stages(_two_layer_costs(4.0, 2.0), (1, 2), 4, device_memory=8.0)
    assert roomy.layers_per_stage == (1, 1)  # 4 + 2 * 2 = 8 <= 8 fits.
    tight = solve_stages(_two_layer_costs(4.0, 2.5), (1, 2), 4, device_memory=8.0)
    assert tight.layers_per_stage == (2,)  # 4 + 2 * 2.5 = 9 > 8: only the one-stage plan is left.
    assert tight.stages[0].memory_per_device == 2.0  # The last stage holds one micro-batch: 1 + 1 * 1.


def test_eq_3_5_counts_this_stage_and_caps_at_b():
    costs = _two_layer_costs(4.0, 2.5)
    # With B = 1 only one micro-batch exists: the first stage holds 4 + 1 * 2.5 <= 8.
    assert solve_stages(costs, (1, 2), 1, 8.0).layers_per_stage == (1, 1)
    # GPipe holds all B = 4 micro-batches on every stage: 4 + 4 * 1 = 8 fits, 4 + 4 * 1.5 does not.
    assert solve_stages(_two_layer_costs(4.0, 1.0), (1, 2), 4, 8.0, schedule="gpipe").layers_per_stage == (1, 1)
    assert solve_stages(_two_layer_costs(4.0, 1.5), (1, 2), 4, 8.0, schedule="gpipe").layers_per_stage == (2,)
    # 1F1B with 4 + 2 * 1.5 = 7 fits where GPipe did not.
    assert solve_stages(_two_layer_costs(4.0, 1.5), (1, 2), 4, 8.0).layers_per_stage == (1, 1)


@pytest.mark.parametrize("schedule", list(ScheduleName))
def test_every_pipeline_schedule_prices_memory_by_its_own_rule(schedule):
    """The DP takes any schedule name: breadth-first and TeraPipe hold every micro-batch as GPipe does,
    interleaved 1F1B holds 1F1B's ``min(s, B)`` (Eq. 3.5)."""
    in_flight = micro_batches_in_flight(schedule, 3, 8).tolist()
    zero_bubble = {ScheduleName.ZB_H1: [3, 3, 3], ScheduleName.ZB_H2: [5, 5, 5]}  # every stage: the depth's peak
    assert in_flight == zero_bubble.get(schedule, [8, 8, 8] if schedule.holds_every_micro_batch else [1, 2, 3])
    layers = solve_stages(_two_layer_costs(4.0, 1.5), (1, 2), 4, 8.0, schedule=schedule).layers_per_stage
    # ZB-H2 holds 2 * 2 - 1 = 3 micro-batches on both of two stages: 4 + 3 * 1.5 > 8.
    assert layers == ((2,) if schedule.holds_every_micro_batch or schedule == ScheduleName.ZB_H2 else (1, 1))


@pytest.mark.parametrize("schedule,num_stages,batches", [
    (name, s, b) for name in ("1f1b", "zb_h1", "zb_h2") for s in (1, 2, 3, 4) for b in (4, 5, 8)])
def test_zero_bubble_latency_is_the_simulated_step_of_its_schedule(schedule, num_stages, batches):
    """``S`` equal stages of time t = 3 (T_F = T_B = T_W = 1 under a split backward): the DP's objective is
    the schedule simulator's step, ``(B + S - 1) t`` for 1F1B and ``B t + (S - 1) t / 3`` for ZB-H1 and ZB-H2
    (the paper's ``(S - 1)(T_F + T_B - T_W)``); and the DP prices the plan it picks the same way."""
    costs = StageCosts.from_fn(num_stages, [(1, 1)], lambda i, j, sub, view: (3.0 * (j - i + 1), 0.0, 0.0),
                               logical_shapes=[[(1, 1)]])
    solution = solve_stages(costs, (1, num_stages), batches, 1.0, schedule=schedule)
    sched = make_schedule(schedule, num_stages, batches)
    durations = (1, 1, 1) if sched.splits_backward else (1, 2)
    assert solution.layers_per_stage == (1,) * num_stages
    assert solution.iteration_time == pytest.approx(float(sched.timeline(*durations).makespan), rel=1e-12)
    weight = 1 if schedule == "1f1b" else Fraction(1, 3)
    assert solution.iteration_time == pytest.approx(float(batches * 3 + (num_stages - 1) * 3 * weight), rel=1e-12)


def test_zero_bubble_prices_a_third_of_the_fill_and_drain():
    """Four 1 s layers on four (1, 1) meshes, B = 4: ZB-H1's fill and drain is a third of 1F1B's, 4 + 3 / 3
    = 5 against 4 + 3 = 7."""
    costs = StageCosts.from_fn(4, [(1, 1)], lambda i, j, sub, view: (float(j - i + 1), 0.0, 0.0),
                               logical_shapes=[[(1, 1)]])
    assert solve_stages(costs, (1, 4), 4, 1.0, schedule="zb_h1").iteration_time == pytest.approx(5.0)
    assert solve_stages(costs, (1, 4), 4, 1.0, schedule="1f1b").iteration_time == pytest.approx(7.0)


def test_a_memory_lean_variant_is_chosen_exactly_where_the_fastest_does_not_fit():
    """One layer on (1, 2): the fastest entry needs 10 GiB, its "params-sharded" twin 6 GiB but is slower."""
    def costs(fast_memory):
        t, mem = np.array([1.0, 1.5]).reshape(1, 1, 1, 2), np.array([fast_memory, 6.0]).reshape(1, 1, 1, 2) * GIB
        return StageCosts(num_layers=1, submeshes=[(1, 2)], logical_shapes=[[(1, 2), (1, 2)]],
                          variants=[["", "params-sharded"]], t_intra=t, mem_stage=mem, mem_act=np.zeros_like(t))
    roomy = solve_stages(costs(7.0), (1, 2), 4, device_memory=8 * GIB).stages[0]
    assert (roomy.view_index, roomy.variant, roomy.t_intra) == (0, "", 1.0)
    tight = solve_stages(costs(10.0), (1, 2), 4, device_memory=8 * GIB).stages[0]
    assert (tight.view_index, tight.variant, tight.t_intra) == (1, "params-sharded", 1.5)
    assert "as (1, 2) (params-sharded)" in str(tight)
    with pytest.raises(ValueError, match=r"distinct \(per variant\)"):
        StageCosts(num_layers=1, submeshes=[(1, 2)], logical_shapes=[[(1, 2), (1, 2)]],
                   t_intra=np.ones((1, 1, 1, 2)), mem_stage=np.zeros((1, 1, 1, 2)), mem_act=np.zeros((1, 1, 1, 2)))
    with pytest.raises(ValueError, match="variants needs one label per logical shape entry"):
        StageCosts(num_layers=1, submeshes=[(1, 2)], logical_shapes=[[(1, 2)]], variants=[["", "x"]],
                   t_intra=np.ones((1, 1, 1, 1)), mem_stage=np.zeros((1, 1, 1, 1)), mem_act=np.zeros((1, 1, 1, 1)))


def test_memory_shortfall_is_reported_in_gib():
    one = StageCosts.from_fn(1, [(1, 1)], lambda i, j, sub, view: (1.0, 15 * GIB, 2 * GIB))
    with pytest.raises(ValueError, match=r"still needs 1 GiB more per device .*more devices, more micro-batches"
                                         r".*remat"):
        solve_stages(one, (1, 1), 8, device_memory=16 * GIB)
    with pytest.raises(ValueError, match=r"needs 15 GiB more per device.*or the 1F1B schedule"):
        solve_stages(one, (1, 1), 8, device_memory=16 * GIB, schedule="gpipe")  # 15 + 8 * 2 = 31.


def test_memory_shortfall_is_the_best_plan_over_its_worst_stage():
    """Plan A: two (1, 1) stages, excess 3 GiB (first) and 0.5 GiB (last). Plan B: one (1, 2) stage, 2 GiB.
    The shortfall is min over plans of max over stages: 2 GiB."""
    def cost(i, j, sub, view):
        if sub == (1, 2):
            return (1.0 if (i, j) == (0, 1) else math.inf), 10 * GIB, 0.0
        if i == j == 0:
            return 1.0, 9 * GIB, 1 * GIB  # First of two 1F1B stages: 9 + 2 * 1 = 11 GiB.
        return (1.0 if i == j == 1 else math.inf), 8.5 * GIB, 0.0
    costs = StageCosts.from_fn(2, [(1, 1), (1, 2)], cost, logical_shapes=[[(1, 1)], [(1, 2)]])
    with pytest.raises(ValueError, match=r"needs 2 GiB more per device \(2147483648 bytes\)"):
        solve_stages(costs, (1, 2), 4, device_memory=8 * GIB)


def test_no_plan_covers_the_cluster():
    costs = StageCosts.from_fn(2, [(1, 1)], lambda i, j, sub, view: (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"no pipeline plan with finite t_intra covers all 4 devices of the 1 x 4"):
        solve_stages(costs, (1, 4), 4, GIB)  # Two layers cannot make four one-device stages.


def test_bad_inputs_are_rejected_with_their_values():
    good = uniform_layers(2, (1, 2))
    with pytest.raises(ValueError, match=r"submeshes \[\(2, 2\)\] are not submesh shapes of the 1 x 4 cluster"):
        solve_stages(StageCosts.from_fn(1, [(2, 2)], lambda *a: (1.0, 0, 0)), (1, 4), 1, GIB)
    with pytest.raises(ValueError, match=r"unknown schedule 'zb'; valid: "
                                         r"\['1f1b', 'breadth_first', 'gpipe', 'interleaved_1f1b', 'terapipe', "
                                         r"'zb_h1', 'zb_h2'\]"):
        solve_stages(good, (1, 2), 4, GIB, schedule="zb")
    with pytest.raises(ValueError, match="num_micro_batches must be an int >= 1, got 0"):
        solve_stages(good, (1, 2), 0, GIB)
    with pytest.raises(ValueError, match="device_memory must be a number of bytes > 0, got -1"):
        solve_stages(good, (1, 2), 4, -1)
    with pytest.raises(ValueError, match="epsilon must be a finite number of seconds >= 0, got -0.1"):
        solve_stages(good, (1, 2), 4, GIB, epsilon=-0.1)
    with pytest.raises(ValueError, match=r"cluster_shape must be a pair of ints >= 1, got \(0, 2\)"):
        solve_stages(good, (0, 2), 4, GIB)
    arrays = dict(t_intra=np.ones((1, 1, 1, 1)), mem_stage=np.zeros((1, 1, 1, 1)), mem_act=np.zeros((1, 1, 1, 1)))
    with pytest.raises(ValueError, match=r"t_intra must have shape \(K, K, P, L\) = \(2, 2, 1, 1\)"):
        StageCosts(num_layers=2, submeshes=[(1, 1)], logical_shapes=[[(1, 1)]], **arrays)
    with pytest.raises(ValueError, match=r"logical shapes of submesh \(1, 2\) must .* have 2 devices"):
        StageCosts(num_layers=1, submeshes=[(1, 2)], logical_shapes=[[(1, 1)]], **arrays)
    with pytest.raises(ValueError, match="mem_act must hold numbers >= 0"):
        StageCosts(num_layers=1, submeshes=[(1, 1)], logical_shapes=[[(1, 1)]],
                   **{**arrays, "mem_act": np.full((1, 1, 1, 1), np.nan)})
    with pytest.raises(ValueError, match=r"t_intra\[..., 0, l\] must be inf for l >= 1"):
        StageCosts(num_layers=1, submeshes=[(1, 1), (1, 2)], logical_shapes=[[(1, 1)], [(1, 2), (2, 1)]],
                   t_intra=np.ones((1, 1, 2, 2)), mem_stage=np.zeros((1, 1, 2, 2)), mem_act=np.zeros((1, 1, 2, 2)))
    with pytest.raises(ValueError, match=r"submeshes must be non-empty and distinct"):
        StageCosts(num_layers=1, submeshes=[(1, 1), (1, 1)], logical_shapes=[[(1, 1)], [(1, 1)]],
                   t_intra=np.ones((1, 1, 2, 1)), mem_stage=np.zeros((1, 1, 2, 1)), mem_act=np.zeros((1, 1, 2, 1)))
    assert not good.t_intra.flags.writeable


def test_solution_prints_a_stage_table():
    solution = solve_stages(uniform_layers(8, (2, 4)), (2, 4), 16, GIB)
    text = str(solution)
    assert text.splitlines()[0].startswith("2 stage(s), B = 16: iteration")
    assert "stage 1: layers 4-7 on (1, 4) as (2, 2)" in text
    assert [solution.stage_of_layer(layer) for layer in (0, 3, 4, 7)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"layer 8 is not in any stage; stages hold layers 0..7"):
        solution.stage_of_layer(8)


def test_benchmark_gpt_48_layers_64_devices():
    """Alpa Table 3.5 reports 1.65 s for the DP of GPT-39B on 64 GPUs (48 layers, B = 64). Noise makes every
    t_intra distinct (16,800 candidate t_max values), as profiled costs would be."""
    costs = gpt_like_costs(48, (8, 8), noise=0.05)
    assert sum(len(v) for v in costs.logical_shapes) == 21
    start = time.perf_counter()
    solution = solve_stages(costs, (8, 8), num_micro_batches=64, device_memory=16 * GIB)
    elapsed = time.perf_counter() - start
    print(f"\nK=48, 8x8, 21 (submesh, logical) pairs, B=64: {elapsed:.2f} s, "
          f"{solution.num_t_max_evaluated} t_max solved\n{solution}")
    check_solution(solution, costs, (8, 8), 64, 16 * GIB)
    assert elapsed < 10.0
    assert len(solution.stages) > 1


def test_doctests():
    for module in (stage_dp_module, stage_costs, stage_placement):
        assert doctest.testmod(module).failed == 0, module.__name__


def with_step_seconds(costs: StageCosts, seed: int) -> StageCosts:
    """``costs`` with a random per-step term (0-3 s on the 0.1 s grid) for every (layers, submesh)."""
    rng = np.random.default_rng(seed)
    shape = costs.t_intra.shape[:3]
    return dataclasses.replace(costs, step_seconds=np.round(rng.uniform(0.0, 3.0, shape), 1))


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(1, 5), cluster=st.sampled_from(SMALL_CLUSTERS),
       batches=st.integers(1, 16), saving=st.booleans())
def test_dp_with_per_step_terms_equals_brute_force(seed, num_layers, cluster, batches, saving):
    """With ``step_seconds`` the objective is Eq. 3.2 plus the largest of the stages' per-step terms (they run
    at the same time on their own meshes), which do not enter the t_max test; the DP (pruned and full), which
    enumerates that largest term, still finds the brute-force optimum."""
    costs = with_step_seconds(random_costs(seed, num_layers, cluster), seed + 2)
    if saving:
        costs = with_boundary_saving(costs, seed + 1)
    expected = brute_force_stages(costs, cluster, batches, 10.0)
    if expected is None:
        return
    for prune in (True, False):
        solution = solve_stages(costs, cluster, batches, 10.0, epsilon=0.0, prune=prune)
        assert solution.iteration_time == pytest.approx(expected.iteration_time, rel=1e-12)
    times = [s.t_intra for s in solution.stages]
    steps = [float(costs.step_seconds[s.layers[0], s.layers[1], s.submesh_index]) for s in solution.stages]
    assert [s.step_seconds for s in solution.stages] == steps
    assert solution.t_max == max(times)
    assert solution.iteration_time == pytest.approx(sum(times) + (batches - 1) * max(times) + max(steps), rel=1e-12)


def test_a_per_step_term_can_change_the_plan():
    """Two layers of 1 s per micro-batch on one device each, or both on (1, 2) in 1.4 s; B = 4. Without
    per-step terms two stages win (1 + 1 + 3 * 1 = 5 s against 4 * 1.4 = 5.6 s); a per-step term of 1 s on a
    stage holding layer 1 without layer 0 (a tied parameter's gradient received after the pipeline) makes the
    one-stage plan win (6 s against 5.6 s)."""
    def cost(i, j, sub, view):
        return (1.0 if sub == (1, 1) and i == j else 1.4 if sub == (1, 2) and (i, j) == (0, 1) else math.inf), 0, 0
    costs = StageCosts.from_fn(2, [(1, 1), (1, 2)], cost, logical_shapes=[[(1, 1)], [(1, 2)]])
    plain = solve_stages(costs, (1, 2), 4, 1.0)
    assert plain.layers_per_stage == (1, 1) and plain.iteration_time == pytest.approx(5.0)
    step = np.zeros((2, 2, 2))
    step[1, 1, :] = 1.0
    tied = solve_stages(dataclasses.replace(costs, step_seconds=step), (1, 2), 4, 1.0)
    assert tied.layers_per_stage == (2,) and tied.iteration_time == pytest.approx(5.6)
    step[1, 1, :] = 0.5
    assert solve_stages(dataclasses.replace(costs, step_seconds=step), (1, 2), 4, 1.0).iteration_time == \
        pytest.approx(5.5)


def test_per_step_terms_of_two_stages_overlap():
    """The tied stages' per-step receives run at the same time on their meshes: the slower counts, not the
    sum. Two layers, B = 4: one stage on (1, 2) in 1.55 s per micro-batch (4 * 1.55 = 6.2 s), or one layer per
    device in 1 s with a 1 s per-step term on each stage (5 s + 1 s = 6 s). Summing the terms (7 s) would
    pick the one-stage plan."""
    def cost(i, j, sub, view):
        return (1.0 if sub == (1, 1) and i == j else 1.55 if sub == (1, 2) and (i, j) == (0, 1) else math.inf), 0, 0
    costs = StageCosts.from_fn(2, [(1, 1), (1, 2)], cost, logical_shapes=[[(1, 1)], [(1, 2)]])
    step = np.zeros((2, 2, 2))
    step[0, 0, :] = step[1, 1, :] = 1.0
    solution = solve_stages(dataclasses.replace(costs, step_seconds=step), (1, 2), 4, 1.0)
    assert solution.layers_per_stage == (1, 1) and solution.iteration_time == pytest.approx(6.0)
    step[1, 1, :] = 1.5  # the slower receive: 5 + 1.5 = 6.5 > 6.2
    solution = solve_stages(dataclasses.replace(costs, step_seconds=step), (1, 2), 4, 1.0)
    assert solution.layers_per_stage == (2,) and solution.iteration_time == pytest.approx(6.2)


def test_step_seconds_are_checked():
    costs = StageCosts.from_fn(2, [(1, 1)], lambda i, j, sub, view: (1.0, 0, 0))
    with pytest.raises(ValueError, match=r"step_seconds must have shape \(K, K, P\)"):
        dataclasses.replace(costs, step_seconds=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="step_seconds must hold finite numbers >= 0"):
        dataclasses.replace(costs, step_seconds=-np.ones((2, 2, 1)))


def test_a_zero_bubble_schedule_is_planned_and_run():
    """``al.plan`` plans a zero-bubble schedule with its own pricing (AutoStageOption), and the step runs
    the plan with jax.jit's result."""
    import jax

    import alpa_like as al
    from tests.helpers import assert_trees_close, make_train_step, mlp_batch, mlp_loss, mlp_state

    sizes = (16, 32, 16)
    state, batch = mlp_state(sizes=sizes), mlp_batch(np.random.default_rng(0), sizes=sizes)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.AutoStageOption(), pipeline_schedule="zb_h1")
    cluster = al.ClusterSpec.preset("p3.16xlarge")
    plan = al.plan(make_train_step(mlp_loss), state, batch, method=method, cluster=cluster)
    assert plan.pipeline_schedule == ScheduleName.ZB_H1 and plan.estimated_iteration_time > 0
    step = al.parallelize(make_train_step(mlp_loss), method=method)
    assert_trees_close(step(state, batch), jax.jit(make_train_step(mlp_loss))(state, batch), rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(2, 6), cluster=st.sampled_from(SHARING_CLUSTERS),
       nic=st.booleans(), block=st.sampled_from([1, 7, 1 << 20]), t_max=st.sampled_from([0.3, 1.0, 3.0, 100.0]))
def test_placed_dp_without_choices_equals_the_tracked_loop(seed, num_layers, cluster, nic, block, t_max):
    """The placed DP's levels computed for every first layer at once, in blocks of any size
    (``_placed_level``), give the same table, bit for bit, as the loop over first layers that records the
    choices."""
    costs = with_boundary_saving(random_costs(seed, num_layers, cluster), seed + 1)
    if nic:
        costs = with_nic_wait(costs, seed + 3, 0.6)
    num_devices = cluster[0] * cluster[1]
    placement = AlignedLayouts.of(costs, num_devices, cluster[1])
    in_flight = micro_batches_in_flight("1f1b", min(num_layers, num_devices), 4)
    eff, _ = stage_dp_module._effective_costs(costs, in_flight, 10.0)
    tracked, _ = stage_dp_module._placed_dp(eff, costs.sizes, num_devices, placement, t_max, track=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage_dp_module, "_LEVEL_BLOCK", block)
        untracked, _ = stage_dp_module._placed_dp(eff, costs.sizes, num_devices, placement, t_max)
    np.testing.assert_array_equal(untracked, tracked)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(1, 6), cluster=st.sampled_from(SHARING_CLUSTERS),
       saving=st.booleans(), nic=st.booleans())
def test_least_t_max_is_where_the_dp_first_has_a_plan(seed, num_layers, cluster, saving, nic):
    """The bottleneck DP run gives the least t_max at which the DP's tables have a plan: at it the DP is
    finite, just below it (the next smaller float) infinite, so the first feasible t_max group is found in
    one run instead of a bisection."""
    costs = random_costs(seed, num_layers, cluster)
    if saving:
        costs = with_boundary_saving(costs, seed + 1)
    if nic:
        costs = with_nic_wait(costs, seed + 3, 0.6)
    num_devices = cluster[0] * cluster[1]
    placement = AlignedLayouts.of(costs, num_devices, cluster[1])
    eff, _ = stage_dp_module._effective_costs(costs, micro_batches_in_flight("1f1b", min(num_layers, num_devices), 4),
                                              10.0)
    least = stage_dp_module._least_t_max(eff, costs.sizes, num_devices, placement)

    def has_plan(t_max):
        return np.isfinite(stage_dp_module._best_finals(eff, t_max, costs.sizes, num_devices, placement)[0]).any()

    event("a plan exists" if math.isfinite(least) else "no plan")
    if math.isfinite(least):
        assert has_plan(least) and not has_plan(np.nextafter(least, -np.inf))
    else:
        assert not has_plan(1e30)
