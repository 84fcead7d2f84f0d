"""The compiler's two paths: plan_spmd and plan_pipeline return plain data, the plan al.plan gives."""
import dataclasses

import numpy as np

import alpa_like as al
from alpa_like.compiler.pipeline import PipelinePlanned, SpmdPlanned, plan_pipeline, plan_spmd
from alpa_like.methods import spmd_layout
from tests.helpers import make_train_step, mlp_batch, mlp_loss, mlp_state

CLUSTER = al.ClusterSpec.preset("p3.16xlarge", num_nodes=1)
STEP_ARGS = dict(static_argnums=(), batch_argnums=(1,), cluster=CLUSTER)


def _without_times(plan):
    return dataclasses.replace(plan, compile_times=())


def test_plan_spmd_traces_lays_out_and_plans_as_al_plan_does():
    step, state, batch = make_train_step(mlp_loss), mlp_state(), mlp_batch(np.random.default_rng(0))
    method = al.Zero2Parallel(num_micro_batches=2)
    planned = plan_spmd(method, step, (state, batch), layout=lambda traced: spmd_layout(method, traced, CLUSTER),
                        **STEP_ARGS)
    assert isinstance(planned, SpmdPlanned) and planned.layout.shard_grads
    assert planned.plan == al.plan(step, state, batch, method=method, cluster=CLUSTER)


def test_plan_pipeline_returns_the_plan_and_what_code_generation_needs():
    step, state, batch = make_train_step(mlp_loss), mlp_state(), mlp_batch(np.random.default_rng(0))
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.AutoStageOption(show_progress=False))
    planned = plan_pipeline(method, step, (state, batch), **STEP_ARGS)
    assert isinstance(planned, PipelinePlanned) and planned.method == method
    assert len(planned.solution.stages) == len(planned.plan.stages)
    assert [name for name, _ in planned.plan.compile_times] == ["trace and layers", "intra-op solves", "stage DP",
                                                                "other"]
    assert _without_times(planned.plan) == _without_times(al.plan(step, state, batch, method=method,
                                                                  cluster=CLUSTER))


def test_planning_with_progress_prints_its_breakdown(capsys, monkeypatch):
    """With progress on, planning ends with one line: the seconds of every pass, the intra-op pass's solves,
    problems, entries and reused entries, and the stage DP's runs; without progress it prints that line only
    when planning takes longer than LONG_PLANNING_SECONDS."""
    from alpa_like.compiler import pipeline

    step, state, batch = make_train_step(mlp_loss), mlp_state(), mlp_batch(np.random.default_rng(0))
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.AutoStageOption(show_progress=True))
    planned = plan_pipeline(method, step, (state, batch), **STEP_ARGS)
    lines = [line for line in capsys.readouterr().err.splitlines() if "planning took" in line]
    assert len(lines) == 1, lines
    profile = planned.profile
    for text in ("trace and layers", "intra-op solves", "stage DP", f"{profile.num_solves} ILP solves of "
                 f"{profile.num_jobs} distinct", f"for {profile.num_pairs} (layer, submesh, logical mesh) entries "
                 f"({profile.cache_hits} reused)", f"{planned.solution.num_t_max_evaluated} stage DP runs"):
        assert text in lines[0], (text, lines[0])
    quiet = dataclasses.replace(method, stage_option=al.AutoStageOption(show_progress=False))
    plan_pipeline(quiet, step, (state, batch), **STEP_ARGS)
    assert "planning took" not in capsys.readouterr().err
    monkeypatch.setattr(pipeline, "LONG_PLANNING_SECONDS", 0.0)
    plan_pipeline(quiet, step, (state, batch), **STEP_ARGS)
    assert "planning took" in capsys.readouterr().err


def test_a_large_cluster_is_planned_in_the_power_of_two_space_and_says_so(capsys):
    """On more than ALL_SHAPES_MAX_NODES nodes the default space profiles the power-of-two whole-node meshes
    only, the progress names the space, and the plan's submeshes come from it."""
    from alpa_like.compiler.options import ALL_SHAPES_MAX_NODES
    from alpa_like.compiler.submesh import submesh_shapes

    nodes = 2 * ALL_SHAPES_MAX_NODES
    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=nodes)
    step, state, batch = make_train_step(mlp_loss), mlp_state(), mlp_batch(np.random.default_rng(0))
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.AutoStageOption(show_progress=True))
    planned = plan_pipeline(method, step, (state, batch), **{**STEP_ARGS, "cluster": cluster})
    err = capsys.readouterr().err
    assert f"submesh shape space 'power_of_two' (submesh_shape_space='auto' on more than {ALL_SHAPES_MAX_NODES} " \
           f"nodes" in err, err
    space = submesh_shapes(nodes, 8, "power_of_two")
    assert planned.profile.costs.submeshes == space
    assert all(tuple(s.submesh_shape) in space for s in planned.plan.stages)
    assert sum(s.submesh_shape[0] * s.submesh_shape[1] for s in planned.plan.stages) == nodes * 8
