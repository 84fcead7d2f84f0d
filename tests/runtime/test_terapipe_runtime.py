"""TeraPipe token slicing at run time: tiny GPT trained with pipeline_schedule="terapipe" equals jax.jit."""
import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like import models
from alpa_like.models import gpt
from alpa_like.runtime.mesh import named_sharding
from alpa_like.compiler.schedule_tables import make_schedule
from alpa_like.compiler.schedules import Phase, Schedule, Task, ticks_from_orders
from alpa_like.runtime.terapipe_runtime import TerapipeContractError, slice_starts
from tests.helpers import assert_trees_close, reference_on_one_device, run_steps
from tests.runtime.test_pipeshard_runtime import stages, train_step_for

SGD = optax.sgd(0.1, momentum=0.9)  # linear in the gradient: see tests/alpa_like/test_methods.py


def gpt_case(num_layers=4, batch_size=4, position_ids=True):
    config = dataclasses.replace(models.get_config("gpt-tiny"), num_layers=num_layers)
    model = gpt.GPTModel(config)
    batches = [gpt.gpt_batch(config, batch_size, jax.random.PRNGKey(10 + i), position_ids=position_ids)
               for i in range(3)]
    params = model.init(jax.random.PRNGKey(0), batches[0]["input_ids"])["params"]
    return gpt.gpt_loss(model), train_state.TrainState.create(apply_fn=None, params=params, tx=SGD), batches


TWO = stages(((0,), (1,)), ((1, 4), (1, 4)), ((1, 4), (1, 4)))  # one layer a stage: half the compiling
FOUR = stages(((0,), (1,), (2,), (3,)), ((1, 2),) * 4, ((1, 2),) * 4)
SLOW = pytest.mark.slow  # one XLA compile per (slice shape, stage) forward and backward: ~15-60 s each on 2 cores
FOUR_ROW_SLICES = pytest.mark.xdist_group("terapipe_four_row_slices")
"""Tests that cut ``gpt_case(num_layers=2)`` into token slices of 4 rows on the two 4-device meshes of ``TWO``:
one xdist worker runs them one after another, so that the stage pieces they have in common (slices of one
shape, the contract check's whole sequences) compile once and the later tests read them from the session's
persistent compilation cache (tests/conftest.py)."""
UNEVEN_BATCH_SLICES = ((1, (9, 7)), (1, (9, 7)), (2, (16,)))  # batch 4: 1 + 1 + 2 rows, 3 slice shapes
CASES = [  # (stage option, micro-batches, token slices: per micro-batch, or the whole batch + token scheme)
    # (two stages with two micro-batches of equal slices is the four-stage case on fewer meshes: left out, ~40 s)
    pytest.param(TWO, 1, UNEVEN_BATCH_SLICES, id="two_stages_uneven_batch_slices", marks=SLOW),
    pytest.param(TWO, 1, (8, 5, 3), id="two_stages_three_uneven_slices", marks=[SLOW, FOUR_ROW_SLICES]),
    pytest.param(FOUR, 4, (10, 6), id="four_stages_four_batch_slices", marks=SLOW),
]
SHARDS_PARAMETERS = {"four_stages_four_batch_slices"}
"""Cases whose plan on the ``fixed_cluster`` fixture (tests/conftest.py) splits some parameter (the ILP
keeps the others data parallel)."""


@pytest.mark.parametrize("stage_option,num_micro_batches,slices", CASES)
def test_terapipe_matches_single_device_jit(stage_option, num_micro_batches, slices, fixed_cluster, request):
    num_layers = sum(len(layers) for layers in stage_option.forward_stage_layer_ids)
    loss_fn, state, batches = gpt_case(num_layers=num_layers)
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=num_micro_batches,
                                  layer_option=al.AutoLayerOption(layer_num=num_layers),
                                  stage_option=stage_option, pipeline_schedule="terapipe", token_slices=slices)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    parallel = al.parallelize(step, method=method)
    got_state, got_losses = run_steps(parallel, state, batches)
    exe = parallel.get_executable(state, batches[0])
    expected = slices if isinstance(slices[0], tuple) else ((4 // num_micro_batches, slices),) * num_micro_batches
    assert exe.batch_slices == expected
    assert len(exe.units) == sum(len(lengths) for _, lengths in expected)
    shapes = {(rows, start, length) for rows, lengths in expected
              for start, length in zip(slice_starts(lengths), lengths)}
    assert exe.num_executables == len(shapes) * exe.num_stages  # slices of one shape share executables
    # Slices and micro-batches reassociate float32 sums (attention softmax over concatenated keys, gradient
    # sums over slices): same tolerance as the other pipeline schedules.
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
    sharded = assert_updated_where_the_plan_puts_parameters(exe, got_state)
    assert (sharded > 0) == (request.node.callspec.id in SHARDS_PARAMETERS)


def assert_updated_where_the_plan_puts_parameters(exe, new_state) -> int:
    """The update ran on the stage owning each parameter, which stays in the plan's (ILP's) layout there;
    returns how many parameters are split over their mesh."""
    specs = {(q, t.path): t.spec for q, s in enumerate(exe.plan.stages) for t in s.inputs if t.role == "param"}
    sharded = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(new_state.params):
        name = "state.params" + "".join(f".{k.key}" for k in path)
        on = [q for q, mesh in enumerate(exe.meshes) if leaf.sharding.device_set == set(mesh.devices.flat)]
        assert len(on) == 1 and (on[0], name) in specs, (name, leaf.sharding)  # a stage that reads it
        spec = specs[(on[0], name)]
        if spec is not None:
            wanted = named_sharding(exe.meshes[on[0]], spec)
            assert leaf.sharding.is_equivalent_to(wanted, leaf.ndim), (name, leaf.sharding, wanted)
            sharded += not leaf.sharding.is_fully_replicated
    return sharded


@SLOW
@FOUR_ROW_SLICES
def test_runs_the_scheme_the_plan_chose(fixed_cluster):
    """token_slices=None: the runtime runs the plan's batch + token slicing (or whole sequences). Planned for
    ``fixed_cluster``, whose scheme does not move with this machine's load."""
    loss_fn, state, batches = gpt_case(num_layers=2)
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=stages(((0,), (1,)), ((1, 4),) * 2, ((1, 4),) * 2),
                                  pipeline_schedule="terapipe")
    ref_state, ref_losses = reference_on_one_device(step, state, batches[:2])
    parallel = al.parallelize(step, method=method)
    got_state, got_losses = run_steps(parallel, state, batches[:2])
    exe = parallel.get_executable(state, batches[0])
    assert exe.batch_slices == (exe.plan.token_slicing or ((2, (16,)),) * 2)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)


@SLOW
def test_positions_from_arange_break_the_contract():
    loss_fn, state, batches = gpt_case(num_layers=2, position_ids=False)
    method = al.PipeshardParallel(layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=stages(((0,), (1,)), ((1, 4),) * 2, ((1, 4),) * 2),
                                  pipeline_schedule="terapipe", token_slices=(8, 8))
    with pytest.raises(TerapipeContractError, match="Positions must come from the inputs"):
        al.parallelize(train_step_for(loss_fn), method=method)(state, batches[0])


def test_a_batch_the_loss_reads_from_its_closure_is_rejected():
    loss_fn, state, batches = gpt_case(num_layers=2)

    def step(state, batch):
        loss, grads = al.value_and_grad(lambda params: loss_fn(params, batch))(state.params)
        return state.apply_gradients(grads=grads), loss
    method = al.PipeshardParallel(layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=stages(((0,), (1,)), ((1, 4),) * 2, ((1, 4),) * 2),
                                  pipeline_schedule="terapipe", token_slices=(8, 8))
    with pytest.raises(TerapipeContractError, match="among the arguments of the function al.grad differentiates"):
        al.parallelize(step, method=method)(state, batches[0])


def test_a_model_without_causal_attention_is_rejected():
    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"]) ** 2)
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones((4, 4))}, tx=SGD)
    batch = {"x": jnp.ones((2, 8, 4))}
    method = al.PipeshardParallel(layer_option=al.AutoLayerOption(layer_num=1),
                                  stage_option=stages(((0,),), ((1, 8),), ((1, 8),)),
                                  pipeline_schedule="terapipe", token_slices=(4, 4))
    with pytest.raises(TerapipeContractError, match="causal_self_attention"):
        al.parallelize(train_step_for(loss_fn), method=method)(state, batch)


def test_dropout_from_a_per_step_key_is_a_warning():
    """TeraPipe folds each token slice's unit index into the step's keys: a warning says so when the step is
    built (tests/runtime/test_terapipe_random.py checks the masks), before this attention-less loss is
    refused."""
    def loss_fn(params, batch, key):
        x = jnp.where(jax.random.bernoulli(key, 0.5, batch["x"].shape), batch["x"], 0.0)
        return jnp.mean((x @ params["w"]) ** 2)

    def step(state, batch, key):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch, key)
        return state.apply_gradients(grads=grads), loss
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones((4, 4))}, tx=SGD)
    method = al.PipeshardParallel(layer_option=al.AutoLayerOption(layer_num=1),
                                  stage_option=stages(((0,),), ((1, 8),), ((1, 8),)),
                                  pipeline_schedule="terapipe", token_slices=(4, 4))
    with pytest.warns(UserWarning, match="folds each unit's index"), pytest.raises(TerapipeContractError):
        al.parallelize(step, method=method)(state, {"x": jnp.ones((2, 8, 4))}, jax.random.key(0))


def test_token_slices_option_is_checked():
    with pytest.raises(ValueError, match="token_slices needs pipeline_schedule='terapipe'"):
        al.PipeshardParallel(token_slices=(4, 4))
    with pytest.raises(ValueError, match="token_slices must be"):
        al.PipeshardParallel(pipeline_schedule="terapipe", token_slices=(4, 0))
    with pytest.raises(ValueError, match="token_slices must be"):
        al.PipeshardParallel(pipeline_schedule="terapipe", token_slices=((2, (4, 4)), (0, (8,))))


def test_batch_slices_must_cover_the_batch():
    loss_fn, state, batches = gpt_case(num_layers=2)
    method = al.PipeshardParallel(layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=stages(((0,), (1,)), ((1, 4),) * 2, ((1, 4),) * 2),
                                  pipeline_schedule="terapipe", token_slices=((2, (8, 8)), (1, (16,))))
    with pytest.raises(ValueError, match="rows >= 1 summing to the batch size 4"):
        al.parallelize(train_step_for(loss_fn), method=method)(state, batches[0])


def one_f_one_b_over_slices(num_meshes, num_micro_batches, num_slices):
    """A TeraPipe order other than the default: each mesh finishes a micro-batch (forwards in slice order,
    backwards in reverse) before starting the next."""
    orders = [[Task(q, k, phase, i) for k in range(num_micro_batches)
               for phase, slices in ((Phase.F, range(num_slices)), (Phase.B, reversed(range(num_slices))))
               for i in slices] for q in range(num_meshes)]
    return Schedule(name="terapipe_1f1b", num_meshes=num_meshes, num_stages=num_meshes,
                    num_micro_batches=num_micro_batches, stage_to_mesh=tuple(range(num_meshes)),
                    ticks=ticks_from_orders(orders, num_meshes, num_slices), num_slices=num_slices)


@SLOW
@FOUR_ROW_SLICES
def test_the_runtime_runs_the_schedule_it_is_given():
    """The step's order is runtime.schedules data: the default is terapipe(...) of the scheme; another valid
    schedule of the same units (here one micro-batch at a time) runs in its order and still equals jax.jit.
    The contract check of the first step runs (the model follows the contract) and the next steps skip it."""
    loss_fn, state, batches = gpt_case(num_layers=2, batch_size=8)
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=stages(((0,), (1,)), ((1, 4),) * 2, ((1, 4),) * 2),
                                  pipeline_schedule="terapipe", token_slices=(10, 6))
    parallel = al.parallelize(step, method=method)
    exe = parallel.get_executable(state, batches[0])
    assert exe.schedule == make_schedule("terapipe", 2, 2, num_slices=2)
    exe.schedule = one_f_one_b_over_slices(2, 2, 2)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    got_state, got_losses = run_steps(parallel, state, batches)
    issued = [t for row in exe.schedule.ticks for t in row if t is not None]
    assert list(exe.last_tasks) == issued and str(issued[:5]) == "[0F0.0, 0F0.1, 1F0.0, 1F0.1, 1B0.1]"
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)


@SLOW
def test_equal_length_slices_share_executables_when_asked():
    """share_slice_executables=True: four 4-token slices at contexts 0, 4, 8, 12 run one executable per stage
    (their prefixes left-padded to 12 tokens, the padding masked) and the step still equals jax.jit; two
    batch slices of different rows keep separate shapes; the contract check still runs on the first step."""
    loss_fn, state, batches = gpt_case(num_layers=2)
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=stages(((0,), (1,)), ((1, 4),) * 2, ((1, 4),) * 2),
                                  pipeline_schedule="terapipe", share_slice_executables=True,
                                  token_slices=((3, (4, 4, 4, 4)), (1, (8, 4, 4))))
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    parallel = al.parallelize(step, method=method)
    got_state, got_losses = run_steps(parallel, state, batches)
    exe = parallel.get_executable(state, batches[0])
    assert sorted({u.key for u in exe.units}) == [(1, 0, 8), (1, 12, 4), (3, 12, 4)]
    assert exe.num_executables == 3 * exe.num_stages  # without sharing: 4 + 3 shapes
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_share_slice_executables_is_checked():
    with pytest.raises(ValueError, match="share_slice_executables needs pipeline_schedule='terapipe'"):
        al.PipeshardParallel(share_slice_executables=True)
    with pytest.raises(ValueError, match="share_slice_executables must be a bool"):
        al.PipeshardParallel(pipeline_schedule="terapipe", share_slice_executables="yes")
