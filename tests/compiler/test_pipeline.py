"""The compiler's two paths: plan_spmd and plan_pipeline return plain data, the plan al.plan gives."""
import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like.compiler.pipeline import PipelinePlanned, SpmdPlanned, plan_pipeline, plan_spmd
from alpa_like.methods import spmd_layout
from alpa_like.models import GPT_CONFIGS, GPTModel, gpt_batch_shapes, gpt_loss, gpt_param_shapes
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


def test_a_small_cluster_is_planned_in_the_space_of_every_shape_and_says_so(capsys):
    """Up to ALL_SHAPES_MAX_NODES nodes the default space is every whole-node shape, and the progress says why."""
    from alpa_like.compiler.options import ALL_SHAPES_MAX_NODES

    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=2)
    step, state, batch = make_train_step(mlp_loss), mlp_state(), mlp_batch(np.random.default_rng(0))
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.AutoStageOption(show_progress=True))
    plan_pipeline(method, step, (state, batch), **{**STEP_ARGS, "cluster": cluster})
    err = capsys.readouterr().err
    assert f"submesh shape space 'all' (submesh_shape_space='auto' on at most {ALL_SHAPES_MAX_NODES} nodes" in err, err


def test_a_stage_lists_its_collectives_per_step_and_the_rest_of_its_objective():
    """:func:`stage_communication`: the layers' rows (per micro-batch) summed per (kind, axes, why) over the
    micro-batches, and an ``other`` row with the rest of the objective, so the rows add up to it."""
    from alpa_like.compiler.pipeline_plan import OTHER_COMMUNICATION, stage_communication
    from alpa_like.compiler.plan import CommEstimate
    from alpa_like.compiler.stage_profiling import LayerCost

    def layer(*rows, comm_seconds):
        return LayerCost(compute_seconds=1.0, comm_seconds=comm_seconds, param_bytes_per_device=0.0,
                         input_specs=(), communication=tuple(CommEstimate(kind=k, mesh_axes=a, num_bytes=b,
                                                                          seconds=t, what=w)
                                                             for k, a, b, t, w in rows))

    ops = ("all-reduce", (1,), 100, 1e-3, "operator collectives")
    sync = ("all-reduce", (0, 1), 10, 2e-4, "gradient synchronisation")
    layers = [layer(ops, sync, comm_seconds=1.5e-3), layer(ops, comm_seconds=1e-3)]
    rows = stage_communication(layers, 4, seconds=4 * 2.5e-3)
    assert [(c.kind, c.mesh_axes, c.num_bytes, c.what) for c in rows] == [
        ("all-reduce", (1,), 800, "operator collectives"), ("all-reduce", (0, 1), 40, "gradient synchronisation"),
        ("other", (), 0, OTHER_COMMUNICATION)]
    assert [c.seconds for c in rows] == pytest.approx([8e-3, 8e-4, 1.2e-3])
    assert [c.kind for c in stage_communication(layers, 4, seconds=4 * 2.2e-3)] == ["all-reduce", "all-reduce"]


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "every micro-batch"])
def test_a_stage_plans_communication_rows_add_up_to_what_the_stage_dp_priced(defer):
    """Each stage's rows (what the simulator reads) sum to its layers' Eq. 3.1 objectives over the step: the
    rows price combined gradient all-reduces as the objective does. gpt-tiny on 2 stages of 4 devices viewed
    as (2, 2), so gradients are synchronised over both axes or one."""
    config = dataclasses.replace(GPT_CONFIGS["gpt-tiny"], pipeline_boundaries="block")
    state = jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.sgd(0.1)),
                           gpt_param_shapes(config))
    stages = al.ManualStageOption(forward_stage_layer_ids=((0, 1), (2,)), submesh_physical_shapes=((1, 4), (1, 4)),
                                  submesh_logical_shapes=((2, 2), (2, 2)), show_progress=False)
    method = al.PipeshardParallel(num_micro_batches=4, layer_option=al.ManualLayerOption(), stage_option=stages,
                                  defer_gradient_sync=defer)
    planned = plan_pipeline(method, make_train_step(gpt_loss(GPTModel(config))), (state, gpt_batch_shapes(config, 16)),
                            **STEP_ARGS)
    for stage, choice in zip(planned.plan.stages, planned.solution.stages, strict=True):
        first, last = choice.layers
        objective = sum(planned.profile.layer_costs[(l, choice.submesh_index, choice.view_index)].comm_seconds
                        for l in range(first, last + 1)) * method.num_micro_batches
        assert stage.communication_seconds == pytest.approx(objective, rel=1e-9)
        assert all(c.seconds >= 0 for c in stage.communication)


def _one_device_memory(step, state, batch, layer_option, num_layers):
    """``mem_stage[i, j]`` of every layer range on a one-device submesh (a cluster of ``num_layers`` devices,
    so the stage DP can give each layer its own)."""
    cluster = dataclasses.replace(CLUSTER, num_devices_per_node=num_layers)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=layer_option,
                                  stage_option=al.AutoStageOption(submesh_shapes=((1, 1),), show_progress=False,
                                                                  max_workers=1))
    planned = plan_pipeline(method, step, (state, batch), **{**STEP_ARGS, "cluster": cluster})
    assert len(planned.sliced.summaries) == num_layers
    return planned.profile.costs.mem_stage[:, :, 0, 0]


def _nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def test_a_tied_embedding_is_held_with_its_gradient_by_both_layers_and_its_state_counted_once():
    """gpt-tiny cut after every block: layer 0 the embeddings and block 0, layer 1 block 1, layer 2 the final
    LayerNorm and the logits, which read the tied word embedding ``wte`` again and run its Adam update. On one
    device each layer holds its parameters and their gradients (``wte`` in layers 0 and 2) and the Adam
    moments its update reads (``wte``'s in layer 2, and in layer 0 for the copy of the update it runs when
    it is a stage of its own); TrainState's step and Adam's count are two int32 scalars of layer 0."""
    config = dataclasses.replace(GPT_CONFIGS["gpt-tiny"], pipeline_boundaries="block")
    params = gpt_param_shapes(config)
    state = jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p,
                                                                   tx=optax.adam(1e-3)), params)
    step = make_train_step(gpt_loss(GPTModel(config)))
    memory = _one_device_memory(step, state, gpt_batch_shapes(config, 4), al.ManualLayerOption(), 3)
    wte, wpe, ln_f = _nbytes(params["wte"]), _nbytes(params["wpe"]), _nbytes(params["ln_f"])
    block_0, block_1 = _nbytes(params["block_0"]), _nbytes(params["block_1"])
    assert (wte, wpe, ln_f, block_0) == (64 * 32 * 4, 16 * 32 * 4, 2 * 32 * 4, 50816)
    counts = 2 * 4
    first = 2 * (wte + wpe + block_0) + 2 * (wpe + block_0) + counts
    last = 4 * (wte + ln_f)
    assert memory[0, 0] == first + 2 * wte
    assert memory[1, 1] == 4 * block_1
    assert memory[2, 2] == last
    assert memory[1, 2] == 4 * block_1 + last


def test_an_untied_model_holds_its_parameters_gradients_and_adam_moments_per_layer():
    """The MLP cut into [w0] and [b0, w1, b1]: four bytes per parameter byte per layer (values, gradients,
    Adam's two moments), and TrainState's step and Adam's count (two int32 scalars) with the first layer."""
    step, state, batch = make_train_step(mlp_loss), mlp_state(), mlp_batch(np.random.default_rng(0))
    memory = _one_device_memory(step, state, batch, al.AutoLayerOption(layer_num=2), 2)
    first, second = 16 * 32 * 4, (32 + 32 * 8 + 8) * 4
    assert memory[0, 0] == 4 * first + 2 * 4
    assert memory[1, 1] == 4 * second
    assert memory[0, 1] == 4 * (first + second) + 2 * 4
