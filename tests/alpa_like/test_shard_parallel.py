"""ShardParallel: numerical equality with single-device jax.jit on 1-D and 2-D meshes, the plan it prints,
the collectives XLA compiled against the ones the ILP predicted, and bad input."""
import collections
import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like import models
from alpa_like.compiler.communication import COMBINED
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.models import gpt, moe, wide_resnet
from alpa_like.runtime import hlo_stats
from tests.helpers import (assert_trees_close, make_train_step, mlp_apply, mlp_batch, mlp_loss, mlp_state,
                           reference_on_one_device, run_steps, wresnet_tiny)

MESHES = {"1d": (1, 8), "2d": (2, 4)}
S = al.ShardingSpec.from_str


def shard_parallel(mesh: str, **kw) -> al.ShardParallel:
    return al.ShardParallel(auto_sharding_option=al.AutoShardingOption(logical_mesh_shape=MESHES[mesh], **kw))


def _mlp_case():
    rng = np.random.default_rng(1)
    return make_train_step(mlp_loss), mlp_state(), [mlp_batch(rng) for _ in range(3)]


def _gpt_like_case(name, model_cls, loss):
    config = models.get_config(name)
    model = model_cls(config)
    params = model.init(jax.random.PRNGKey(0), gpt.gpt_batch(config, 2, jax.random.PRNGKey(1))["input_ids"])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params["params"], tx=optax.adam(1e-3))
    batches = [gpt.gpt_batch(config, 16, jax.random.PRNGKey(10 + i)) for i in range(3)]
    return make_train_step(loss(model)), state, batches


def _wresnet_case():
    config, variables, loss_fn = wresnet_tiny()
    tx = optax.adam(1e-3)

    def step(state, batch):
        params, stats, opt_state = state
        (loss, stats), grads = al.value_and_grad(loss_fn, has_aux=True)(params, stats, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), stats, opt_state), {"loss": loss}

    state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
    batches = [wide_resnet.wresnet_batch(config, 16, jax.random.PRNGKey(10 + i)) for i in range(3)]
    return step, state, batches


# (case builder, atol). Everything is float32 and compared at rtol 1e-5 after 3 Adam steps. Adam divides
# the update by sqrt(nu): a weight whose gradient is only float32 rounding noise gets an update of ~lr times
# that noise's sign, which changes with the summation order of the sharded reductions. GPT's key bias
# (softmax ignores a per-row shift, so its gradient is exactly 0 up to rounding) and MoE experts that
# receive few tokens have such weights: atol 5e-6 and 2e-5 absolute on lr = 1e-3.
CASES = {
    "mlp": (_mlp_case, 1e-6),
    "gpt": (lambda: _gpt_like_case("gpt-tiny", gpt.GPTModel, gpt.gpt_loss), 5e-6),
    "moe": (lambda: _gpt_like_case("moe-tiny", moe.MoEModel, moe.moe_loss), 2e-5),
    "wresnet": (_wresnet_case, 1e-6),
}


def _params_and_state(state):
    if isinstance(state, tuple):  # the Wide-ResNet step's (params, batch_stats, opt_state)
        return state[0], state[1:]
    return state.params, state.opt_state


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("model", sorted(CASES))
def test_shard_parallel_matches_single_device_jit(model, mesh):
    build, atol = CASES[model]
    step, state, batches = build()
    ref_state, ref_metrics = reference_on_one_device(step, state, batches)
    par_state, par_metrics = run_steps(al.parallelize(step, method=shard_parallel(mesh)), state, batches)
    for actual, expected in zip(_params_and_state(par_state), _params_and_state(ref_state)):
        assert_trees_close(actual, expected, rtol=1e-5, atol=atol)
    assert_trees_close(par_metrics, ref_metrics, rtol=1e-5, atol=atol)


def test_mlp_with_gradient_accumulation_matches_single_device_jit(fixed_cluster):
    step, state, batches = _mlp_case()
    ref_state, _ = reference_on_one_device(step, state, batches[:2])
    method = al.ShardParallel(num_micro_batches=2,
                              auto_sharding_option=al.AutoShardingOption(logical_mesh_shape=(2, 4)))
    parallel = al.parallelize(step, method=method)
    par_state, _ = run_steps(parallel, state, batches[:2])
    assert_trees_close(par_state.params, ref_state.params)
    assert_trees_close(par_state.opt_state, ref_state.opt_state)
    # the micro-batch loop keeps per-shard partial sums of the gradients: their all-reduce runs once, after it
    exe = parallel.get_executable(state, batches[0])
    compiled = hlo_stats.collectives(exe.get_hlo_text())
    assert [c.kind for c in compiled if c.in_loop_body] == [] and "all-reduce" in {c.kind for c in compiled}
    # and the plan prices that synchronisation once per step, as for one micro-batch
    one = al.parallelize(step, method=dataclasses.replace(method, num_micro_batches=1)).get_executable(
        state, batches[0])

    def synchronised(e):
        return {(c.kind, c.num_bytes) for c in e.plan.stages[0].communication if c.what.startswith("gradient")}
    assert synchronised(exe) and synchronised(exe) == synchronised(one)


# ------------------------------------------------------------------------------------------- the plan

def test_a_discarded_metric_changes_neither_the_plan_nor_its_price():
    def step(state, batch):
        grads = al.grad(mlp_loss)(state.params, batch)
        unused_error = jnp.mean(jnp.abs(mlp_apply(state.params, batch["x"]) - batch["y"]))
        return state.apply_gradients(grads=grads)
    _, state, batches = _mlp_case()
    exe = al.parallelize(step, method=al.ShardParallel()).get_executable(state, batches[0])
    planned = sorted(c.num_bytes for c in exe.plan.stages[0].communication)
    assert planned == sorted(c.result_bytes for c in exe.collectives())  # one all-reduce of the gradients



@pytest.fixture(scope="module")
def mlp_exe():
    step, state, batches = _mlp_case()
    return al.parallelize(step, method=al.ShardParallel()).get_executable(state, batches[0])


def test_every_logical_view_is_tried_and_the_cheapest_kept(mlp_exe):
    solver = mlp_exe.plan.stages[0].solver
    assert [shape for shape, _ in solver.views] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    best = min(objective for _, objective in solver.views)
    assert solver.objective == best
    assert mlp_exe.plan.stages[0].logical_mesh_shape in [shape for shape, o in solver.views if o == best]
    assert solver.status == "optimal" and solver.num_nodes > 0


def test_plan_shows_each_parameter_and_heavy_op_with_its_spec_and_cost(mlp_exe):
    stage = mlp_exe.plan.stages[0]
    params = {o.name: o for o in stage.ops if o.kind == "param"}
    assert set(params) == {f"state.params.dense_{i}.{w}" for i in range(2) for w in ("kernel", "bias")}
    dots = [o for o in stage.ops if o.kind == "dot_general"]
    assert len(dots) == 5 and all(o.strategy and o.seconds >= 0 for o in dots)
    text = str(mlp_exe.plan)
    assert "intra-op ILP: optimal" in text and "chosen strategies" in text
    assert "state.params.dense_0.kernel" in text and "dot_general" in text
    # The modelled communication is the ILP's (after weight-update sharding), not data parallelism's.
    assert stage.communication_seconds == pytest.approx(
        sum(c.seconds for c in stage.communication))
    assert al.ParallelPlan.from_json(mlp_exe.plan.to_json()) == mlp_exe.plan


def test_weight_update_sharding_shards_optimizer_state_on_the_data_axes():
    # Batch 4096 and narrow layers on links without latency: data parallelism on the 2x4 mesh, gradients
    # all-reduced; the post-ILP pass turns each into reduce-scatter + all-gather and shards the Adam moments
    # 8 ways, as Zero2Parallel does.
    step = make_train_step(mlp_loss)
    state, batch = mlp_state(), mlp_batch(np.random.default_rng(0), batch_size=4096)
    cluster = dataclasses.replace(al.ClusterSpec.preset("p3.16xlarge"), intra_node_latency=0.0)
    plan = al.plan(step, state, batch, method=shard_parallel("2d"), cluster=cluster)
    kernel = plan.tensor("state.params.dense_0.kernel")
    mu = plan.tensor("state.opt_state.0.mu.dense_0.kernel")
    assert str(kernel.spec) == "RR" and mu.bytes_per_device == kernel.bytes_per_device // 8
    kinds = {c.kind for c in plan.stages[0].communication}
    assert {"reduce-scatter", "all-gather"} <= kinds and "all-reduce" in kinds  # the loss stays all-reduced
    off = al.plan(step, state, batch, method=shard_parallel("2d", prefer_reduce_scatter=False), cluster=cluster)
    assert str(off.tensor("state.opt_state.0.mu.dense_0.kernel").spec) == "RR"
    assert off.stages[0].solver.objective == pytest.approx(plan.stages[0].solver.objective)


# --------------------------------------------------------------------------- compiled vs predicted HLO

def _compiled_all_reduces(exe) -> list[tuple[int, list[str]]]:
    """(bytes, operator names) of every all-reduce XLA compiled; a combined all-reduce names all its parts."""
    # hlo_stats' tuple-shape pattern stops at the '=' of "/*index=5*/" comments: strip them first.
    text = re.sub(r"/\*.*?\*/", "", exe.get_hlo_text())
    out = []
    for c in hlo_stats.collectives(text):
        if c.kind != "all-reduce":
            continue
        op = re.search(r'op_name="jit\(step\)/([^"]*)"', c.line).group(1)
        if op.endswith(")") and (op.startswith("(") or "/(" in op):  # "prefix/(a:b:c)": a combined op
            cut = 0 if op.startswith("(") else op.rfind("/(") + 1
            out.append((c.result_bytes, [op[:cut] + item for item in op[cut + 1:-1].split(":")]))
        else:
            out.append((c.result_bytes, [op]))
    return out


def _predicted_all_reduces(exe) -> dict[str, list[int]]:
    """Operator name -> bytes of each all-reduce the plan's strategy for it performs."""
    out: dict[str, list[int]] = {}
    for o in exe.plan.stages[0].ops:
        for num_bytes in re.findall(r"all-reduce\((\d+) B", o.communication):
            out.setdefault(o.name, []).append(int(num_bytes))
    return out


def test_compiled_collectives_match_the_ilp_for_mlp(fixed_cluster):
    # On the 8 CPU devices (measured latency; XLA combines the gradients' all-reduces into one, which the ILP
    # prices) the ILP keeps the MLP data parallel: XLA compiles exactly the predicted all-reduce bytes, as one
    # combined all-reduce that names every matmul the plan all-reduces.
    step, state, batches = _mlp_case()
    exe = al.parallelize(step, method=shard_parallel("1d", prefer_reduce_scatter=False)).get_executable(
        state, batches[0])
    predicted = exe.plan.stages[0].communication
    assert {c.kind for c in predicted} == {"all-reduce"}
    compiled = hlo_stats.collectives(exe.get_hlo_text())
    assert [c.kind for c in compiled] == ["all-reduce"]
    assert compiled[0].result_bytes == sum(c.num_bytes for c in predicted)
    (_, parts), = _compiled_all_reduces(exe)
    heavy = _predicted_all_reduces(exe)
    assert heavy and collections.Counter({n: len(b) for n, b in heavy.items()}) <= collections.Counter(parts)
    # the plan prices that one all-reduce as the ILP does: every gradient's bytes, one latency
    (combined,) = [c for c in predicted if c.what == COMBINED]
    mesh = LogicalMesh.from_cluster(exe.plan.cluster, exe.plan.stages[0].submesh_shape,
                                    exe.plan.stages[0].logical_mesh_shape)
    axis = combined.mesh_axes[0] if len(combined.mesh_axes) == 1 else combined.mesh_axes
    assert combined.seconds == pytest.approx(mesh.all_reduce_cost(combined.num_bytes, axis), rel=1e-6)


def _compiled_by_kind(exe) -> dict[str, int]:
    """Bytes per collective kind in the compiled HLO (async pairs once)."""
    out: dict[str, int] = {}
    for c in hlo_stats.collectives(exe.get_hlo_text()):
        out[c.kind] = out.get(c.kind, 0) + c.result_bytes
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_compiled_collectives_are_exactly_the_ones_the_ilp_predicted_for_tiny_gpt(mesh, fixed_cluster):
    """XLA compiles for tiny GPT exactly the all-reduces the plan predicts: the same operators (a combined
    all-reduce names each of its parts), the same bytes, and no collective the plan does not predict.

    Every operand of a matmul / gather / scatter is pinned as that operator reads it (per-reader pins), so
    XLA cannot replace the chosen algorithm by its own (e.g. all-gather an operand and compute replicated).
    """
    step, state, batches = CASES["gpt"][0]()
    exe = al.parallelize(step, method=shard_parallel(mesh, prefer_reduce_scatter=False)).get_executable(
        state, batches[0])
    predicted = {kind: 0 for kind in hlo_stats.COLLECTIVE_KINDS}
    for c in exe.plan.stages[0].communication:
        predicted[c.kind] += c.num_bytes
    compiled = _compiled_by_kind(exe)
    assert {k: b for k, b in predicted.items() if b} == compiled
    # Heavy operators' all-reduces by name (the plan lists those; reductions' all-reduces count in the bytes).
    compiled_names = collections.Counter(name for _, parts in _compiled_all_reduces(exe) for name in parts)
    predicted_names = collections.Counter({name: len(sizes) for name, sizes in _predicted_all_reduces(exe).items()})
    assert predicted_names and predicted_names <= compiled_names


# ------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, error, match", [
    ({"memory_budget_per_device": -1}, ValueError, "memory_budget_per_device must be a number of bytes > 0"),
    ({"allow_all_to_all": "yes"}, TypeError, "allow_all_to_all must be a bool"),
    ({"force_batch_dim_to_mesh_axis": 2}, ValueError, "force_batch_dim_to_mesh_axis must be 0, 1 or None"),
    ({"solver_time_limit": 0}, ValueError, "solver_time_limit must be a number of seconds > 0"),
    ({"logical_mesh_shape": (8,)}, ValueError, r"logical_mesh_shape must be a tuple \(n0, n1\)"),
    ({"solver": "gurobi"}, ValueError, r"solver must be one of \('cbc', 'highs'\), got 'gurobi'"),
    ({"plan_selection": "fastest"}, ValueError,
     r"plan_selection must be one of \('objective', 'measured'\), got 'fastest'"),
    ({"measure_rounds": 0}, ValueError, "measure_rounds must be an int >= 1, got 0"),
    ({"measure_rounds": True}, ValueError, "measure_rounds must be an int >= 1, got True"),
])
def test_bad_options_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        al.AutoShardingOption(**kwargs)


def test_bad_method_arguments_name_the_argument():
    with pytest.raises(ValueError, match="num_micro_batches must be a positive int"):
        al.ShardParallel(num_micro_batches=0)
    with pytest.raises(TypeError, match="auto_sharding_option must be an al.AutoShardingOption"):
        al.ShardParallel(auto_sharding_option={"solver": "cbc"})
    step, state, batches = _mlp_case()
    method = al.ShardParallel(auto_sharding_option=al.AutoShardingOption(logical_mesh_shape=(3, 3)))
    with pytest.raises(ValueError, match=r"logical_mesh_shape \(3, 3\) has 9 devices, but the cluster has 8"):
        al.parallelize(step, method=method)(state, batches[0])
    forced = al.ShardParallel(auto_sharding_option=al.AutoShardingOption(logical_mesh_shape=(2, 4),
                                                                         force_batch_dim_to_mesh_axis=1))
    with pytest.raises(ValueError, match="batch leaf batch.x has 6 rows per micro-batch, not divisible by the 4"):
        al.plan(step, state, mlp_batch(np.random.default_rng(0), batch_size=6), method=forced)


def test_force_batch_dim_to_mesh_axis_pins_the_batch():
    step, state, batches = _mlp_case()
    method = al.ShardParallel(auto_sharding_option=al.AutoShardingOption(logical_mesh_shape=(2, 4),
                                                                         force_batch_dim_to_mesh_axis=1))
    plan = al.plan(step, state, batches[0], method=method)
    assert plan.tensor("batch.x").spec.axes[0] == (1,)


def test_unsupported_primitive_warns_and_is_computed_replicated():
    def loss(params, batch):
        y = batch["x"] @ params["w"]
        return jnp.mean(jnp.linalg.eigvalsh(y.T @ y))  # eigh has no sharding rule
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones((4, 4))}, tx=optax.sgd(0.1))
    batch = {"x": jnp.ones((8, 4))}
    with pytest.warns(UserWarning, match="no sharding rule for primitive\\(s\\) eigh"):
        plan = al.plan(make_train_step(loss), state, batch, method=shard_parallel("1d"))
    assert any("eigh" in w for w in plan.warnings)


# ------------------------------------------------------------------------------------------ scan models

def _scanned_mlp_case(layers=2, hidden=256, batch=64):
    """A residual MLP whose layers are one ``lax.scan`` over stacked weights (as ``nn.scan`` builds them);
    SGD with momentum (Adam would amplify the float32 noise of sharded reductions, see CASES)."""
    rng = np.random.default_rng(3)

    def loss(params, data):
        def body(h, w):
            return h + jnp.tanh(h @ w["w1"]) @ w["w2"], None
        h, _ = jax.lax.scan(body, data["x"], params)
        return jnp.mean((h - data["y"]) ** 2)

    params = {"w1": jnp.asarray(rng.normal(size=(layers, hidden, 4 * hidden)) / 16, jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(layers, 4 * hidden, hidden)) / 32, jnp.float32)}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(1e-2, momentum=0.9))
    batches = [{k: jnp.asarray(rng.normal(size=(batch, hidden)), jnp.float32) for k in ("x", "y")}
               for _ in range(3)]
    return make_train_step(loss), state, batches


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_a_scanned_model_is_sharded_inside_the_loop_and_matches_single_device_jit(mesh):
    step, state, batches = _scanned_mlp_case()
    exe = al.parallelize(step, method=shard_parallel(mesh)).get_executable(state, batches[0])
    # Weights dominate: Megatron's split of every stacked layer, the layer axis whole.
    w1, w2 = (o.spec for o in exe.plan.stages[0].ops if o.name in ("state.params.w1", "state.params.w2"))
    assert not w1.axes[0] and not w2.axes[0] and w1.axes[2] and w2.axes[1]
    # XLA runs the plan inside the loop: per iteration one all-reduce of [batch, hidden] in the forward and
    # one in the backward, which is what the plan predicts per step divided by the 2 iterations.
    compiled = [c for c in hlo_stats.collectives(exe.get_hlo_text()) if c.kind == "all-reduce"]
    assert [c.result_bytes for c in compiled] == [64 * 256 * 4] * 2 and all("while/body" in c.line for c in compiled)
    assert sum(c.num_bytes for c in exe.plan.stages[0].communication) == 2 * 2 * 64 * 256 * 4
    ref_state, ref_metrics = reference_on_one_device(step, state, batches)
    par_state, par_metrics = run_steps(exe, state, batches)
    assert_trees_close(par_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(par_metrics, ref_metrics, rtol=1e-5, atol=1e-6)


def test_a_flax_model_with_nn_scan_remat_dropout_and_cond_matches_single_device_jit():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            y = nn.Dropout(0.1, deterministic=False)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(h))))
            return h + nn.Dense(16)(y), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                            split_rngs={"params": True, "dropout": True}, length=3)
            h, _ = stack()(nn.Dense(16)(x), None)
            h = jax.lax.cond(jnp.all(jnp.isfinite(h)), lambda z: z * 2.0, lambda z: z, h)
            return nn.Dense(4)(h)

    model = Net()
    params = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, jnp.ones((32, 8)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params["params"],
                                          tx=optax.sgd(1e-2, momentum=0.9))
    rng = np.random.default_rng(0)
    batches = [{"x": jnp.asarray(rng.normal(size=(32, 8)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)} for _ in range(2)]

    def step(state, batch):
        def loss_fn(p):  # typed PRNG keys flow through the scan (split_rngs), raw ones in the step
            dropout = jax.random.fold_in(jax.random.PRNGKey(0), state.step)
            out = model.apply({"params": p}, batch["x"], rngs={"dropout": dropout})
            return jnp.mean((out - batch["y"]) ** 2)
        loss, grads = al.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    ref_state, ref_metrics = reference_on_one_device(step, state, batches)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no sharding rule")  # every primitive has a rule
        par_state, par_metrics = run_steps(al.parallelize(step, method=shard_parallel("2d")), state, batches)
    assert_trees_close(par_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(par_metrics, ref_metrics, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", [al.DataParallel(), al.ShardParallel()], ids=["data", "shard"])
def test_a_typed_prng_key_argument_is_accepted(method):
    def step(state, batch, key):
        def loss(p, b):
            return mlp_loss(p, {"x": b["x"] + 0.01 * jax.random.normal(key, b["x"].shape), "y": b["y"]})
        value, grads = al.value_and_grad(loss)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": value}

    state, batch, key = mlp_state(), mlp_batch(np.random.default_rng(0)), jax.random.key(3)
    expected = jax.jit(step)(state, batch, key)
    actual = al.parallelize(step, method=method)(state, batch, key)
    assert_trees_close(actual[0].params, expected[0].params)
    assert_trees_close(actual[1], expected[1])


# ------------------------------------------------------------------------------ measured plan selection

def test_device_layout_is_equal_exactly_when_jax_puts_the_same_block_on_every_device():
    from alpa_like.compiler.sharding_spec import enumerate_specs
    from alpa_like.runtime.mesh import make_mesh, named_sharding
    from alpa_like.shard_parallel import device_layout

    shape = (8, 8)
    cases = []
    for view in [(1, 8), (8, 1), (2, 4), (4, 2)]:
        mesh = make_mesh(jax.devices()[:8], view, ("x", "y"))
        for spec in enumerate_specs(shape, view):
            blocks = named_sharding(mesh, spec).devices_indices_map(shape)
            placement = tuple(tuple((s.start, s.stop) for s in blocks[d]) for d in jax.devices()[:8])
            cases.append((device_layout(spec, view), placement))
    same = 0
    for key_a, placed_a in cases:
        for key_b, placed_b in cases:
            assert (key_a == key_b) == (placed_a == placed_b)
            same += placed_a == placed_b
    assert same > len(cases)  # some specs on different views do place alike (S01 on 2x4 and S1 on 1x8)


def test_duplicates_names_the_first_layout_with_the_same_device_layouts():
    from alpa_like.compiler.spmd_layout import SpmdLayout
    from alpa_like.shard_parallel import duplicates

    def layout(view, batch, pins=()):
        return SpmdLayout(mesh_shape=view, axis_names=("x", "y"), roles=("batch",), in_specs=(S(batch),),
                          out_specs=(S("R"),), eqn_constraints=tuple((3, 0, S(p)) for p in pins))
    layouts = [layout((1, 8), "S1R"), layout((2, 4), "S01R"), layout((2, 4), "S0R"), layout((8, 1), "S0R"),
               layout((2, 4), "S01R", pins=("RS01",)), layout((4, 2), "S01R", pins=("RS01",)),
               layout((4, 2), "S01R", pins=("RS0",))]
    # S01 on 2x4 or 4x2, S1 on 1x8 and S0 on 8x1 split a dim over the 8 devices alike; S0 on 2x4 splits it
    # over devices {0..3} | {4..7}, S0 on 4x2 over {0, 1} | {2, 3} | ...
    assert duplicates(layouts) == [None, 0, None, 0, None, 4, None]


def _fixed_cluster(monkeypatch, latency):
    """Makes compilation plan for a fixed cluster of the 8 CPU devices: the measured selection still times
    on the devices, but its candidates no longer depend on ClusterSpec.local()'s measurements."""
    import alpa_like.api
    cluster = dataclasses.replace(al.ClusterSpec.preset("p3.16xlarge"), intra_node_latency=latency,
                                  inter_node_latency=latency, name="fixed")
    monkeypatch.setattr(alpa_like.api.ClusterSpec, "local", classmethod(lambda cls, devices=None: cluster))


def test_measured_selection_times_every_distinct_candidate_and_matches_single_device_jit(monkeypatch):
    # With 1 ms per collective every view's alpha-beta plan is data parallel (one combined gradient
    # all-reduce); without latency the MLP's weights (3 kB) are cheaper to keep split than its activations
    # (4 kB): the bandwidth-only plans are other programs, and not the same on every view.
    _fixed_cluster(monkeypatch, latency=1e-3)
    step, state, batches = _mlp_case()
    method = al.ShardParallel(auto_sharding_option=al.AutoShardingOption(plan_selection="measured",
                                                                         measure_rounds=2))
    train_step = al.parallelize(step, method=method, donate_argnums=(0,))
    exe = train_step.get_executable(state, batches[0])
    assert not any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))  # not timed on
    solver = exe.plan.stages[0].solver
    assert solver.selection == "measured" and solver.selection_seconds > 0
    candidates = solver.candidates
    assert [(c.logical_mesh_shape, c.cost_model, c.weight_update_sharding) for c in candidates] == [
        (view, model, rewrite) for view in [(1, 8), (2, 4), (4, 2), (8, 1)]
        for model in ("alpha-beta", "bandwidth only", "no all-to-all") for rewrite in (True, False)]
    timed = [i for i, c in enumerate(candidates) if c.measured_seconds is not None]
    assert len(timed) >= 3  # distinct programs, each timed once
    for i, c in enumerate(candidates):
        assert (c.measured_seconds is None) == (c.same_as is not None)
        assert c.same_as is None or (c.same_as < i and candidates[c.same_as].measured_seconds > 0)
    assert len({candidates[i].logical_mesh_shape for i in timed}) >= 2  # two views gave different programs
    (chosen,) = [c for c in candidates if c.chosen]
    assert chosen.measured_seconds == min(candidates[i].measured_seconds for i in timed)
    assert exe.plan.stages[0].logical_mesh_shape == chosen.logical_mesh_shape
    assert solver.objective == chosen.objective
    assert [v for v, _ in solver.views] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert "plan selection: measured, 24 candidates" in str(exe.plan)
    assert al.ParallelPlan.from_json(exe.plan.to_json()) == exe.plan
    ref_state, ref_metrics = reference_on_one_device(step, state, batches)
    par_state, par_metrics = run_steps(train_step, state, batches)
    assert_trees_close(par_state.params, ref_state.params, rtol=1e-5)
    assert_trees_close(par_state.opt_state, ref_state.opt_state, rtol=1e-5)
    assert_trees_close(par_metrics, ref_metrics, rtol=1e-5)


def test_pipeshard_parallel_rejects_the_measured_selection():
    measured = al.AutoShardingOption(plan_selection="measured")
    with pytest.raises(ValueError, match="plan_selection='measured' is ShardParallel's"):
        al.PipeshardParallel(auto_sharding_option=measured)


def test_measured_selection_without_devices_falls_back_to_the_objective_with_a_warning():
    # al.plan on shapes for a simulated cluster: nothing can be timed.
    step = make_train_step(mlp_loss)
    state = jax.eval_shape(lambda: mlp_state())
    batch = jax.eval_shape(lambda: mlp_batch(np.random.default_rng(0)))
    cluster = al.ClusterSpec.preset("p3.16xlarge")
    measured = al.ShardParallel(auto_sharding_option=al.AutoShardingOption(plan_selection="measured"))
    with pytest.warns(UserWarning, match="plan_selection='measured' needs the devices to time plans on"):
        plan = al.plan(step, state, batch, method=measured, cluster=cluster)
    assert any("the view with the lowest objective is used" in w for w in plan.warnings)
    solver = plan.stages[0].solver
    assert solver.selection == "objective" and solver.candidates == () and solver.selection_seconds == 0.0
    by_objective = al.plan(step, state, batch, method=al.ShardParallel(), cluster=cluster)
    assert plan.stages[0].inputs == by_objective.stages[0].inputs
    assert plan.stages[0].ops == by_objective.stages[0].ops


def test_zero_inputs_have_the_steps_shapes_dtypes_and_shardings_typed_keys_included():
    from alpa_like.compiler.trace import trace_step
    from alpa_like.runtime.mesh import make_mesh, named_sharding
    from alpa_like.shard_parallel import zero_inputs

    def step(state, batch, key):
        return state + jnp.sum(batch) + jax.random.normal(key, ())

    args = (jnp.ones((4,), jnp.float32), jnp.ones((8, 2), jnp.int32), jax.random.key(0))
    traced = trace_step(step, args, batch_argnums=(1,))
    mesh = make_mesh(jax.devices()[:8], (2, 4), ("x", "y"))
    shardings = [named_sharding(mesh, S(t)) for t in ("S1", "S01R", "")]
    zeros = zero_inputs(traced, shardings)
    for z, arg, sharding in zip(zeros, args, shardings, strict=True):
        assert z.shape == arg.shape and z.dtype == arg.dtype and z.sharding == sharding
    assert not np.any(np.asarray(zeros[0])) and not np.any(np.asarray(zeros[1]))
    assert jax.random.key_data(zeros[2]).shape == jax.random.key_data(args[2]).shape
