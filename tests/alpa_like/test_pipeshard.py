"""PipeshardParallel planning: layers, stage DP on ILP costs, device assignment, memory, options."""
import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like import models, pipeshard
from alpa_like.compiler import pipeline, stage_choice
from alpa_like.compiler.sliced_step import slice_step
from alpa_like.models import gpt

QUIET = al.AutoStageOption(show_progress=False)


def state_shapes(params):
    return jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(1e-3)),
                          params)


def train_step_for(loss_fn):
    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss
    return train_step


def gpt_case(num_layers=4, hidden=1024, seq=256, batch=64):
    """A GPT whose compute dominates on V100s (planned from shapes only: the ILP graph stays tiny)."""
    config = dataclasses.replace(models.get_config("gpt-tiny"), num_layers=num_layers, hidden_size=hidden,
                                 num_heads=16, seq_len=seq, vocab_size=1024)
    step = train_step_for(gpt.gpt_loss(gpt.GPTModel(config)))
    return step, state_shapes(gpt.gpt_param_shapes(config)), gpt.gpt_batch_shapes(config, batch)


def uneven_mlp_loss(params, batch):
    x = batch["x"]
    for i, name in enumerate(sorted(params)):
        x = jnp.tanh(x @ params[name])
        if i < len(params) - 1:
            al.mark_pipeline_boundary()
    return jnp.mean(x ** 2)


def uneven_case():
    """Four manual layers; the first is 16x as heavy as each of the others."""
    widths = [(4096, 4096), (4096, 1024), (1024, 1024), (1024, 1024)]
    params = {f"w{i}": jax.ShapeDtypeStruct(shape, jnp.float32) for i, shape in enumerate(widths)}
    batch = {"x": jax.ShapeDtypeStruct((2048, 4096), jnp.float32)}
    return train_step_for(uneven_mlp_loss), state_shapes(params), batch


@pytest.fixture(scope="module")
def gpt_plan():
    step, state, batch = gpt_case()
    method = al.PipeshardParallel(num_micro_batches=16, layer_option=al.AutoLayerOption(layer_num=4),
                                  stage_option=QUIET)
    return al.plan(step, state, batch, method=method, cluster=al.ClusterSpec.preset("p3.16xlarge", num_nodes=1))


def test_gpt_gets_equal_layers_per_stage(gpt_plan):
    sizes = [len(s.layer_ids) for s in gpt_plan.stages]
    assert len(set(sizes)) == 1, gpt_plan
    assert sorted(d for s in gpt_plan.stages for d in s.device_ids) == list(range(8))
    assert [s.layer_ids[0] for s in gpt_plan.stages] == sorted(s.layer_ids[0] for s in gpt_plan.stages)


def test_plan_reports_stages_and_compile_time_breakdown(gpt_plan):
    names = [name for name, _ in gpt_plan.compile_times]
    assert names == ["trace and layers", "intra-op solves", "stage DP", "other"]
    text = str(gpt_plan)
    assert "planning time" in text and "Stage 0: layers" in text and "state.params.block_" in text
    assert gpt_plan.estimated_iteration_time > 0
    assert al.ParallelPlan.from_json(gpt_plan.to_json()) == gpt_plan


def repeated_first_layer_loss(params, batch):
    x = batch["x"]
    for i, name in enumerate(sorted(params)):
        for _ in range(4 if i == 0 else 1):
            x = jnp.tanh(x @ params[name])
        if i < len(params) - 1:
            al.mark_pipeline_boundary()
    return jnp.mean(x ** 2)


def uneven_equal_boundaries_case():
    """Four manual layers, the first 4x as heavy as each other one, every boundary carrying the same
    (2048, 4096) activation: only compute is uneven (the stage DP also prices what crosses a boundary)."""
    params = {f"w{i}": jax.ShapeDtypeStruct((4096, 4096), jnp.float32) for i in range(4)}
    batch = {"x": jax.ShapeDtypeStruct((2048, 4096), jnp.float32)}
    return train_step_for(repeated_first_layer_loss), state_shapes(params), batch


def test_uneven_layers_get_uneven_stages():
    step, state, batch = uneven_equal_boundaries_case()
    method = al.PipeshardParallel(num_micro_batches=8, layer_option=al.ManualLayerOption(), stage_option=QUIET)
    # Two DGX A100 nodes: pipelining across nodes pays off, and the node boundary's receive (priced at the
    # node's whole NIC) does not dwarf the layers' compute. On p3.16xlarge's 25 Gb/s NIC it takes 1.34 ms per
    # micro-batch, many times a layer's compute, so every placement of the heavy layer costs about the same.
    plan = al.plan(step, state, batch, method=method, cluster=al.ClusterSpec.preset("dgx-a100", num_nodes=2))
    assert len(plan.stages) > 1, plan
    devices_of_first_layer = next(len(s.device_ids) for s in plan.stages if 0 in s.layer_ids)
    layers_per_stage = [len(s.layer_ids) for s in plan.stages]
    devices_per_stage = [len(s.device_ids) for s in plan.stages]
    assert len(set(layers_per_stage)) > 1 or len(set(devices_per_stage)) > 1, plan
    assert devices_of_first_layer == max(devices_per_stage)


def test_a_model_that_fits_nowhere_says_how_much_memory_is_missing():
    step, state, batch = uneven_case()
    cluster = dataclasses.replace(al.ClusterSpec.preset("p3.16xlarge", num_nodes=1), device_memory=2**20)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(), stage_option=QUIET)
    with pytest.raises(ValueError, match=r"GiB"):
        al.plan(step, state, batch, method=method, cluster=cluster)


def test_memory_limit_is_respected():
    step, state, batch = gpt_case()
    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=1)
    method = al.PipeshardParallel(num_micro_batches=16, layer_option=al.AutoLayerOption(layer_num=4),
                                  stage_option=QUIET)
    roomy = al.plan(step, state, batch, method=method, cluster=cluster)
    peak = max(s.peak_memory_per_device for s in roomy.stages)
    tight = al.plan(step, state, batch, method=method,
                    cluster=dataclasses.replace(cluster, device_memory=int(peak * 0.9)))
    assert max(s.peak_memory_per_device for s in tight.stages) <= int(peak * 0.9)


def test_manual_and_uniform_stage_options():
    step, state, batch = gpt_case()
    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=1)
    manual = al.ManualStageOption(forward_stage_layer_ids=((0, 1), (2, 3)), submesh_physical_shapes=((1, 4), (1, 4)),
                                  submesh_logical_shapes=((2, 2), (1, 4)), show_progress=False)
    plan = al.plan(step, state, batch, cluster=cluster, method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4), stage_option=manual))
    assert [s.layer_ids for s in plan.stages] == [(0, 1), (2, 3)]
    assert [s.logical_mesh_shape for s in plan.stages] == [(2, 2), (1, 4)]
    # Eq. 3.5 for stages given by hand, as the DP counts it: GPipe holds all 4 micro-batches' activations on
    # each stage, 1F1B two on the first and one on the last (the memory was once counted for one everywhere)
    gpipe = al.plan(step, state, batch, cluster=cluster, method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4), stage_option=manual,
        pipeline_schedule="gpipe"))
    one_f_one_b = [s.peak_memory_per_device for s in plan.stages]
    all_four = [s.peak_memory_per_device for s in gpipe.stages]
    assert all_four[0] > one_f_one_b[0] and all_four[1] > one_f_one_b[1]
    uniform = al.UniformStageOption(num_stages=4, show_progress=False)
    plan = al.plan(step, state, batch, cluster=cluster, method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4), stage_option=uniform))
    assert [s.submesh_shape for s in plan.stages] == [(1, 2)] * 4
    with pytest.raises(ValueError, match="forward_stage_layer_ids must list layers 0..3"):
        al.plan(step, state, batch, cluster=cluster, method=al.PipeshardParallel(
            layer_option=al.AutoLayerOption(layer_num=4),
            stage_option=dataclasses.replace(manual, forward_stage_layer_ids=((0,), (2, 3)))))
    for stage_option in (manual, uniform):  # a step without boundaries is one layer under ManualLayerOption
        with pytest.raises(ValueError, match="ManualLayerOption found no al.mark_pipeline_boundary.. call in the "
                                             f"step, so the step is one layer, but {type(stage_option).__name__} "
                                             r"asks for \d stages"):
            al.plan(step, state, batch, cluster=cluster, method=al.PipeshardParallel(
                layer_option=al.ManualLayerOption(), stage_option=stage_option))
    with pytest.raises(ValueError, match=r"submesh_logical_shapes\[1\] = \(1, 2\) must view the 4 devices"):
        dataclasses.replace(manual, submesh_logical_shapes=((2, 2), (1, 2)))
    with pytest.raises(ValueError, match=r"submesh_physical_shapes\[0\] must be a pair of ints >= 1, got \(4,\)"):
        dataclasses.replace(manual, submesh_physical_shapes=((4,), (1, 4)))


def test_a_saved_plan_is_reused_through_manual_stages(gpt_plan):
    """``ParallelPlan.from_json`` then ``ManualStageOption.from_plan``: the same stages, without the stage DP."""
    step, state, batch = gpt_case()
    saved = al.ParallelPlan.from_json(gpt_plan.to_json())
    option = al.ManualStageOption.from_plan(saved, show_progress=False)
    again = al.plan(step, state, batch, cluster=saved.cluster, method=al.PipeshardParallel(
        num_micro_batches=saved.num_micro_batches, layer_option=al.AutoLayerOption(layer_num=4), stage_option=option))
    assert [(s.layer_ids, s.submesh_shape, s.logical_mesh_shape) for s in again.stages] == [
        (s.layer_ids, s.submesh_shape, s.logical_mesh_shape) for s in gpt_plan.stages]
    assert again.estimated_iteration_time == pytest.approx(gpt_plan.estimated_iteration_time, rel=1e-6)
    with pytest.raises(ValueError, match="from_plan needs a PipeshardParallel plan"):
        al.ManualStageOption.from_plan(al.plan(step, state, batch, method=al.DataParallel(), cluster=saved.cluster))


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="pipeline_schedule must be one of"):
        al.PipeshardParallel(pipeline_schedule="zigzag")
    with pytest.raises(ValueError, match="layer_num must be an int >= 1"):
        al.AutoLayerOption(layer_num=0)
    with pytest.raises(ValueError, match="recompute_aware=True needs remat_layer=True"):
        al.AutoLayerOption(layer_num=4, recompute_aware=True)
    with pytest.raises(ValueError, match="recompute_aware='auto' needs remat_layer=True"):
        al.AutoLayerOption(layer_num=4, recompute_aware="auto")
    with pytest.raises(ValueError, match="recompute_aware must be False, True or 'auto', got 'yes'"):
        al.AutoLayerOption(layer_num=4, remat_layer=True, recompute_aware="yes")
    for bad in (0, "2", True):
        with pytest.raises(ValueError, match=f"UniformStageOption.num_stages must be an int >= 1, got {bad!r}"):
            al.UniformStageOption(num_stages=bad)
    with pytest.raises(ValueError, match="submesh_physical_shape must be None or a pair of ints >= 1"):
        al.UniformStageOption(num_stages=2, submesh_physical_shape=(1, 0))
    assert al.UniformStageOption(num_stages=2, submesh_logical_shape=[2, 2]).submesh_logical_shape == (2, 2)


def test_debug_callbacks_run_on_the_local_backend_and_the_ray_backend_drops_them_with_a_warning():
    """The local backend's stage pieces run effects (tests/alpa_like/test_methods.py checks that they fire);
    pieces shipped to Ray workers as jax.export StableHLO cannot hold host callbacks: they leave them out,
    and a warning names them."""
    step, state, batch = uneven_case()

    def printing(state, batch):
        new_state, loss = step(state, batch)
        jax.debug.print("loss {}", loss)
        return new_state, loss
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  stage_option=al.UniformStageOption(num_stages=2, show_progress=False))
    built = {}

    def capture(**parts):  # stands in for the Ray executable: what it would be given
        built.update(parts)
    compile_args = dict(static_argnums=(), batch_argnums=(1,), devices=jax.devices())
    with pytest.warns(UserWarning, match="does not run the step's debug_print .* on the Ray backend"):
        pipeshard.compile_pipeshard(method, printing, (state, batch), make_executable=capture, **compile_args)
    assert not any(piece.jaxpr.effects for piece in built["program"].pieces.values())
    local = pipeshard.compile_pipeshard(method, printing, (state, batch), **compile_args)
    assert [key for key, piece in local.program.pieces.items() if piece.jaxpr.effects] == [(1, "apply")]


def test_steps_a_pipeline_cannot_run_are_named_errors():
    step, state, batch = uneven_case()
    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=1)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(), stage_option=QUIET)

    def two_grads(state, batch):  # e.g. a GAN's discriminator and generator updates
        g1 = al.grad(uneven_mlp_loss)(state.params, batch)
        g2 = al.grad(uneven_mlp_loss)(state.params, batch)
        return jax.tree.map(jnp.add, g1, g2)

    def metric_after_grad(state, batch):  # the full batch's mean
        new_state, loss = step(state, batch)
        return new_state, {"loss": loss, "x_mean": jnp.mean(batch["x"])}

    def scaled_batch_after_grad(state, batch):  # computed per micro-batch for al.grad from the batch and the state
        x = batch["x"] * (1.0 + state.step)
        loss, grads = al.value_and_grad(uneven_mlp_loss)(state.params, {"x": x})
        return state.apply_gradients(grads=grads), {"loss": loss, "x_mean": jnp.mean(x)}
    def boundary_outside_the_loss(state, batch):
        al.mark_pipeline_boundary()
        return step(state, batch)
    with pytest.raises(ValueError, match="needs exactly one al.grad / al.value_and_grad call in the step .* found 2"):
        al.plan(two_grads, state, batch, method=method, cluster=cluster)
    with pytest.raises(ValueError, match=r"mark_pipeline_boundary\(\) was called outside the function al.grad"):
        al.plan(boundary_outside_the_loss, state, batch, method=method, cluster=cluster)
    with pytest.raises(ValueError, match="`reduce_sum` outside al.grad uses the batch through a value computed per "
                                         "micro-batch"):
        al.plan(scaled_batch_after_grad, state, batch, method=method, cluster=cluster)
    al.plan(scaled_batch_after_grad, state, batch, method=dataclasses.replace(method, num_micro_batches=1),
            cluster=cluster)
    al.plan(metric_after_grad, state, batch, method=method, cluster=cluster)


def test_a_clustering_the_slack_forbids_names_the_option():
    def vocabulary_loss(params, batch):  # the last matmul (the logits) holds most of the FLOPs
        h = batch["x"]
        for name in ("w0", "w1", "w2"):
            h = jnp.tanh(h @ params[name])
        return jnp.mean(h @ params["logits"])
    params = {f"w{i}": jax.ShapeDtypeStruct((64, 64), jnp.float32) for i in range(3)}
    params["logits"] = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
    batch = {"x": jax.ShapeDtypeStruct((32, 64), jnp.float32)}
    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=1)

    def plan(**eps):
        return al.plan(train_step_for(vocabulary_loss), state_shapes(params), batch, cluster=cluster,
                       method=al.PipeshardParallel(layer_option=al.AutoLayerOption(layer_num=4, **eps),
                                                   stage_option=QUIET))
    with pytest.raises(ValueError, match=r"AutoLayerOption\(layer_num=4, eps=0.6\): no clustering .* eps=None takes"):
        plan(eps=0.6)
    assert len(plan().stages) >= 1  # the default slack is the least that works here


def conv_chain_loss(params, batch):
    x = batch["x"]
    for i, k in enumerate(params["k"]):
        x = jax.lax.conv_general_dilated(jnp.tanh(x) if i else x, k, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.mean(x ** 2)


def test_recompute_aware_auto_keeps_the_faster_of_both_layerings():
    """Six 16-channel convolutions of kernel sizes 5, 1, 3, 3, 3, 5 in three rematerialized layers: every cut
    carries the same bytes, so the tie-break alone places them; on one V100 the recompute-aware cuts recompute
    less (found by trying kernel sizes; most give both tie-breaks the same layers)."""
    params = {"k": [jax.ShapeDtypeStruct((k, k, 16, 16), jnp.float32) for k in (5, 1, 3, 3, 3, 5)]}
    batch = {"x": jax.ShapeDtypeStruct((64, 16, 16, 16), jnp.float32)}
    one_gpu = dataclasses.replace(al.ClusterSpec.preset("p3.16xlarge"), num_devices_per_node=1)

    def plan(recompute_aware):
        layers = al.AutoLayerOption(layer_num=3, remat_layer=True, recompute_aware=recompute_aware)
        return al.plan(train_step_for(conv_chain_loss), state_shapes(params), batch, cluster=one_gpu,
                       method=al.PipeshardParallel(num_micro_batches=2, layer_option=layers, stage_option=QUIET))
    by_flag = {flag: plan(flag) for flag in (False, True, "auto")}
    eq36, aware = by_flag[False].estimated_iteration_time, by_flag[True].estimated_iteration_time
    assert aware < eq36
    assert by_flag["auto"].estimated_iteration_time == aware
    assert "recompute_aware=True" in by_flag["auto"].method  # the plan names the layering it was cut with


def test_remat_layers_keep_only_their_non_parameter_inputs_for_the_backward():
    """With per-layer remat the backward recomputes the layer from its inputs: the activation bytes of a
    micro-batch are at most the layer's non-parameter inputs (the weights are per-step memory, counted once
    in the stage's weights, not once per micro-batch in flight)."""
    from alpa_like.compiler.markers import is_marker

    step, state, batch = gpt_case(num_layers=4, hidden=64, seq=16, batch=8)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=4, remat_layer=True),
                                  stage_option=QUIET)
    sliced = slice_step(method, step, (state, batch), static_argnums=(), batch_argnums=(1,))
    jaxpr = sliced.jaxpr
    param_vars = {v for v, role in zip(jaxpr.invars, sliced.roles) if role == "param"}
    for eqn in jaxpr.eqns:  # parameters seen through markers
        if is_marker(eqn):
            param_vars |= {out for inp, out in zip(eqn.invars, eqn.outvars) if not hasattr(inp, 'val') and inp in param_vars}
    for summary in sliced.summaries[1:]:
        start = next(e for e in jaxpr.eqns if is_marker(e, "fwd_start") and e.params["layer"] == summary.layer)
        inputs = sum(v.aval.size * v.aval.dtype.itemsize for v in start.invars
                     if not hasattr(v, 'val') and v not in param_vars)
        assert 0 < summary.activation_bytes <= inputs, (summary, inputs)


def _layout(plan):
    return tuple((s.layer_ids, s.submesh_shape, s.logical_mesh_shape) for s in plan.stages)


@pytest.mark.slow
@pytest.mark.parametrize("num_layers,devices_per_node,num_nodes", [(8, 4, 3)])  # both estimates in play
def test_estimated_costs_are_settled_by_simulating_the_plans(monkeypatch, num_layers, devices_per_node, num_nodes):
    """Where the stage DP's table can only estimate (``StageCosts.nic_wait`` for NICs that two meshes of a node
    share; a multi-node stage's receive from a neighbour inside one node, ``StageProfile.sender_limited``),
    the planner also solves the tables of ``stage_choice.estimate_tables`` and keeps the plan the simulated backend
    runs fastest: the chosen plan is one of the tables' plans and simulates no slower than any of them."""
    step, state, batch = gpt_case(num_layers=num_layers)
    # The tiny GPT is float32: priced at the FP16 rate (no fp32_peak_flops), as a GPT in FP16 would be, its
    # transfers weigh enough against its compute for both estimates to matter.
    cluster = dataclasses.replace(al.ClusterSpec.preset("p3.16xlarge", num_nodes=num_nodes),
                                  num_devices_per_node=devices_per_node, fp32_peak_flops=None)
    method = al.PipeshardParallel(num_micro_batches=16, layer_option=al.AutoLayerOption(layer_num=num_layers),
                                  stage_option=QUIET)
    sliced = slice_step(method, step, (state, batch), static_argnums=(), batch_argnums=(1,))
    chosen, profile, _ = pipeshard.plan_and_profile(method, sliced, cluster)
    assert "simulated choice" in dict(chosen.compile_times)
    monkeypatch.setattr(pipeline, "settles_estimates", lambda method: False)
    main = pipeshard.plan_sliced(method, sliced, cluster)
    tables = [table for table, _ in stage_choice.estimate_tables(
        method, profile, cluster, stage_choice.choose_stages(method, profile.costs, cluster))]
    assert len(tables) >= 3  # both estimates are in play
    solve = stage_choice.choose_stages
    seconds = {_layout(main): pipeshard.simulate_plan(main, sliced).step_seconds}
    for table in tables[1:]:
        monkeypatch.setattr(pipeline, "choose_stages",
                            lambda method, costs, cluster, table=table: solve(method, table, cluster))
        plan = pipeshard.plan_sliced(method, sliced, cluster)
        seconds[_layout(plan)] = pipeshard.simulate_plan(plan, sliced).step_seconds
    assert len(seconds) > 1  # the case exercises the choice
    assert _layout(chosen) in seconds
    assert seconds[_layout(chosen)] == min(seconds.values())
