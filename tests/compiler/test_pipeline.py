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
