"""Textbook answers of the intra-op pass under the alpha-beta model, with closed-form costs.

Every mesh here has alpha = 0 and beta = 1 s/B (unless stated), so a ring all-reduce of ``M`` bytes over
``n`` devices costs ``2 (n - 1) / n * M`` and the objective is a byte count.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_like as al
from alpa_like.compiler.auto_sharding import (PassOptions, alias_pairs, auto_shard, prepare, price_on, solve_prepared,
                                             without_latency)
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.op_graph import build_op_graph, merged_groups
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.trace import trace_step
from alpa_like.compiler.input_roles import match_outputs_to_inputs
from tests.helpers import mlp_loss

S = ShardingSpec.from_str


def mesh(shape, beta=(1.0, 1.0)):
    return LogicalMesh(shape=shape, alpha=(0.0, 0.0), beta=beta)


def all_reduce(num_bytes, n):
    return 2 * (n - 1) / n * num_bytes


def solve_step(step, args, logical_mesh, options=PassOptions()):
    traced = trace_step(step, args, batch_argnums=(1,))
    graph = build_op_graph(traced.closed_jaxpr, [leaf.path for leaf in traced.in_leaves])
    solution = auto_shard(graph, logical_mesh, options, aliases=alias_pairs(graph, match_outputs_to_inputs(traced)))
    specs = {leaf.path: spec for leaf, spec in zip(traced.in_leaves, solution.input_specs())}
    return solution, specs, graph


def mlp_args(batch, sizes):
    """Shapes only: the pass never runs the step."""
    params = {f"dense_{i}": {"kernel": jax.ShapeDtypeStruct((a, b), jnp.float32),
                             "bias": jax.ShapeDtypeStruct((b,), jnp.float32)}
              for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
    data = {"x": jax.ShapeDtypeStruct((batch, sizes[0]), jnp.float32),
            "y": jax.ShapeDtypeStruct((batch, sizes[-1]), jnp.float32)}
    return params, data


def sgd_step(loss):
    def step(params, batch):
        value, grads = al.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value
    return step


def param_bytes(sizes):
    return sum(4 * (a * b + b) for a, b in zip(sizes[:-1], sizes[1:]))


def test_activations_dominate_gives_data_parallelism():
    sizes, batch = (16, 32, 8), 512
    solution, specs, _ = solve_step(sgd_step(mlp_loss), mlp_args(batch, sizes), mesh((1, 8)))
    # Batch split over the 8 devices, weights replicated; every gradient and the scalar loss all-reduced.
    assert specs["batch.x"] == S("S1R") and specs["batch.y"] == S("S1R")
    assert all(str(specs[f"params.dense_{i}.kernel"]) == "RR" for i in range(2))
    assert solution.objective == pytest.approx(all_reduce(param_bytes(sizes) + 4, 8))


def test_weights_dominate_gives_the_megatron_pattern():
    sizes, batch = (256, 1024, 256), 8
    solution, specs, graph = solve_step(sgd_step(mlp_loss), mlp_args(batch, sizes), mesh((1, 8)))
    # First weight column-split, second row-split (Megatron-LM's MLP), biases follow the columns.
    assert specs["params.dense_0.kernel"] == S("RS1") and specs["params.dense_0.bias"] == S("S1")
    assert specs["params.dense_1.kernel"] == S("S1R") and specs["params.dense_1.bias"] == S("R")
    # One all-reduce per MLP block: the partial sums of the second matmul, [batch, 256] floats.
    collectives = [c for s in solution.strategies for c in s.collectives]
    assert [c.kind for c in collectives] == ["all-reduce"] and not solution.reshards
    assert solution.objective == pytest.approx(all_reduce(batch * 256 * 4, 8))


def test_two_dimensional_mesh_mixes_data_and_operator_parallelism():
    # With batch = 4 h on a 2x4 mesh, data parallelism on axis 0 and Megatron on axis 1 (3BH + 8h^2 byte-units)
    # beats Megatron over 8 (7BH), data parallelism over 8 (56h^2) and the transposed mix (BH + 24h^2).
    h, batch = 32, 128
    sizes = (h, 4 * h, h)
    solution, specs, _ = solve_step(sgd_step(mlp_loss), mlp_args(batch, sizes), mesh((2, 4)))
    assert specs["batch.x"] == S("S0R")
    assert specs["params.dense_0.kernel"] == S("RS1") and specs["params.dense_1.kernel"] == S("S1R")
    forward = all_reduce(batch // 2 * h * 4, 4)                        # second matmul's partial sums, axis 1
    grads = all_reduce(4 * (h * 4 * h // 4 * 2 + 4 * h // 4 + h), 2)  # kernels and b1 split 4 ways, b2 whole
    loss = all_reduce(4, 2)
    assert solution.objective == pytest.approx(forward + grads + loss)


def moe_step():
    def loss(p, b):
        expert_in = jnp.einsum("gsec,gsm->egcm", b["dispatch"], b["x"])
        hidden = jax.nn.relu(jnp.einsum("egcm,emf->egcf", expert_in, p["wi"]))
        expert_out = jnp.einsum("egcf,efm->egcm", hidden, p["wo"])
        y = jnp.einsum("gsec,egcm->gsm", b["dispatch"], expert_out)
        return jnp.mean((y - b["y"]) ** 2)
    return sgd_step(loss)


def test_moe_expert_weights_get_expert_parallelism():
    groups, seq, experts, capacity, model, ffn = 8, 16, 8, 4, 64, 256
    params = {"wi": jax.ShapeDtypeStruct((experts, model, ffn), jnp.float32),
              "wo": jax.ShapeDtypeStruct((experts, ffn, model), jnp.float32)}
    batch = {"dispatch": jax.ShapeDtypeStruct((groups, seq, experts, capacity), jnp.float32),
             "x": jax.ShapeDtypeStruct((groups, seq, model), jnp.float32),
             "y": jax.ShapeDtypeStruct((groups, seq, model), jnp.float32)}
    solution, specs, _ = solve_step(moe_step(), (params, batch), mesh((1, 8)))
    assert specs["params.wi"] == S("S1RR") and specs["params.wo"] == S("S1RR")
    # The experts' tokens [e, g, c, m] move between the expert-split and the model-split layout with
    # all-to-alls (Table 3.2 #4): once into the combine, twice in its backward (one per consumer).
    tokens = experts * groups * capacity * model * 4
    all_to_all = 7 / 8**2 * tokens
    assert {step.kind for r in solution.reshards for step in r.steps} == {"all-to-all"}
    assert solution.objective == pytest.approx(3 * all_to_all + all_reduce(4, 8))
    data_parallel = all_reduce(2 * experts * model * ffn * 4, 8)
    assert solution.objective < data_parallel / 50


def test_memory_budget_trades_communication_for_memory():
    sizes, batch = (64, 256, 64), 64
    args = mlp_args(batch, sizes)
    free, specs, _ = solve_step(sgd_step(mlp_loss), args, mesh((1, 8)), PassOptions(memory_budget=1e12))
    assert free.ilp.status == "optimal"
    budget = 0.8 * free.peak_memory
    tight, tight_specs, _ = solve_step(sgd_step(mlp_loss), args, mesh((1, 8)), PassOptions(memory_budget=budget))
    assert tight.ilp.status == "optimal"
    assert tight.peak_memory <= budget < free.peak_memory
    assert tight.objective > free.objective
    assert tight_specs != specs
    with pytest.warns(UserWarning, match="no sharding plan fits memory_budget=1000"):
        impossible, _, _ = solve_step(sgd_step(mlp_loss), args, mesh((1, 8)), PassOptions(memory_budget=1000))
    assert impossible.ilp.status == "infeasible"


def test_merging_keeps_the_ilp_small():
    sizes, batch = (16, 32, 8), 64
    traced = trace_step(sgd_step(mlp_loss), mlp_args(batch, sizes), batch_argnums=(1,))
    graph = build_op_graph(traced.closed_jaxpr)
    groups = set(merged_groups(graph).tolist())
    # 5 matmuls + 6 input leaves + a handful of constants: a few dozen nodes for ~80 equations.
    assert len(graph.nodes) > 3 * len(groups)
    assert sum(graph.nodes[g].primitive == "dot_general" for g in groups) == 5


def test_costs_scale_with_the_slower_axis():
    sizes, batch = (16, 32, 8), 512
    slow0, _, _ = solve_step(sgd_step(mlp_loss), mlp_args(batch, sizes), mesh((2, 4), beta=(10.0, 1.0)))
    fast, _, _ = solve_step(sgd_step(mlp_loss), mlp_args(batch, sizes), mesh((2, 4)))
    assert fast.objective == pytest.approx(all_reduce(param_bytes(sizes) + 4, 8))
    assert slow0.objective > fast.objective
    assert np.isfinite(slow0.objective)


def _block(h, w1, w2):
    return h + jnp.tanh(h @ w1) @ w2


def scanned_mlp_loss(params, batch):
    h, _ = jax.lax.scan(lambda h, w: (_block(h, w["w1"], w["w2"]), None), batch["x"], params)
    return jnp.mean((h - batch["y"]) ** 2)


def unrolled_mlp_loss(params, batch):
    h = batch["x"]
    for p in params:
        h = _block(h, p["w1"], p["w2"])
    return jnp.mean((h - batch["y"]) ** 2)


def _scan_args(layers, hidden, batch, stacked):
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    data = {"x": f32(batch, hidden), "y": f32(batch, hidden)}
    if stacked:
        return {"w1": f32(layers, hidden, 4 * hidden), "w2": f32(layers, 4 * hidden, hidden)}, data
    return [{"w1": f32(hidden, 4 * hidden), "w2": f32(4 * hidden, hidden)} for _ in range(layers)], data


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)])
def test_a_scanned_model_costs_what_its_unrolled_loop_costs_when_data_parallel(shape):
    # Gradient all-reduces priced one by one (a scan's run inside the loop, one per iteration).
    options = PassOptions(combine_gradient_all_reduces=False)
    scanned, specs, _ = solve_step(sgd_step(scanned_mlp_loss), _scan_args(2, 16, 512, True), mesh(shape), options)
    unrolled, _, _ = solve_step(sgd_step(unrolled_mlp_loss), _scan_args(2, 16, 512, False), mesh(shape), options)
    assert str(specs["params.w1"]) == "RRR" and specs["batch.x"].axes[0] == tuple(a for a in (0, 1) if shape[a] > 1)
    assert scanned.objective == pytest.approx(unrolled.objective)


def test_a_scanned_transformer_mlp_gets_the_megatron_pattern_in_every_iteration():
    layers, hidden, batch = 3, 256, 8
    solution, specs, _ = solve_step(sgd_step(scanned_mlp_loss), _scan_args(layers, hidden, batch, True), mesh((1, 8)),
                                    PassOptions(combine_gradient_all_reduces=False))
    # The layer axis stays whole; inside, w1 column-split and w2 row-split.
    assert specs["params.w1"] == S("RRS1") and specs["params.w2"] == S("RS1R")
    # Per iteration one all-reduce of [batch, hidden] in the forward and one in the backward (the carry's
    # gradient is computed on every iteration, the first one included).
    assert solution.objective == pytest.approx(layers * 2 * all_reduce(batch * hidden * 4, 8))


def test_a_prepared_pass_restricted_to_some_input_specs_equals_the_pass_built_with_them():
    # The stage profiler's "params-sharded" twin: solving the prepared ILP with the weights limited to fully
    # sharded specs must give what a pass built with those candidates gives (same optimum).
    sizes, batch = (16, 32, 8), 512  # activations dominate: replicated weights are the free optimum
    traced = trace_step(sgd_step(mlp_loss), mlp_args(batch, sizes), batch_argnums=(1,))
    graph = build_op_graph(traced.closed_jaxpr, [leaf.path for leaf in traced.in_leaves])
    m = mesh((2, 4))
    kernels = [i for i, leaf in enumerate(traced.in_leaves) if "kernel" in str(leaf.path)]
    candidates = {i: (S("S0S1"), S("S1S0"), S("S01R"), S("RS01")) for i in kernels}
    prepared = prepare(graph, m)
    restricted = solve_prepared(prepared, candidates)
    rebuilt = auto_shard(graph, m, PassOptions(input_candidates=candidates))
    assert restricted.objective == pytest.approx(rebuilt.objective, rel=1e-9)
    assert restricted.ilp.objective == pytest.approx(rebuilt.ilp.objective, rel=1e-9)
    assert all(restricted.input_specs()[i] in candidates[i] for i in kernels)
    assert restricted.objective > solve_prepared(prepared).objective  # the restriction costs something here
    with pytest.raises(ValueError, match="input_candidates must name specs among the prepared inputs"):
        solve_prepared(prepare(graph, m, PassOptions(input_candidates={kernels[0]: (S("RR"),)})),
                       {kernels[0]: (S("S0S1"),)})


def test_a_plan_solved_without_latency_is_priced_on_the_mesh_with_latency():
    # Weights dominate: without latency the ILP picks Megatron's split (one all-reduce of the second matmul's
    # [batch, 256] partial sums). Priced on the same view with alpha = 1e5 s per collective, the same
    # strategies pay that alpha once: the objective in closed form.
    sizes, batch, alpha = (256, 1024, 256), 8, 1e5
    traced = trace_step(sgd_step(mlp_loss), mlp_args(batch, sizes), batch_argnums=(1,))
    graph = build_op_graph(traced.closed_jaxpr, [leaf.path for leaf in traced.in_leaves])
    aliases = alias_pairs(graph, match_outputs_to_inputs(traced))
    slow = LogicalMesh(shape=(1, 8), alpha=(alpha, alpha), beta=(1.0, 1.0))
    assert without_latency(slow) == mesh((1, 8))
    prepared = prepare(graph, slow, aliases=aliases)
    megatron = auto_shard(graph, without_latency(slow), aliases=aliases)
    assert megatron.objective == pytest.approx(all_reduce(batch * 256 * 4, 8))
    priced = price_on(prepared, megatron)
    assert priced.mesh == slow and priced.graph is graph
    assert [(s.name, s.out_specs, s.in_specs) for s in priced.strategies] == \
        [(s.name, s.out_specs, s.in_specs) for s in megatron.strategies]
    assert [c.seconds(slow) for s in priced.strategies for c in s.collectives] == \
        [pytest.approx(alpha + all_reduce(batch * 256 * 4, 8))]
    assert priced.objective == pytest.approx(alpha + all_reduce(batch * 256 * 4, 8))
    assert priced.ilp.objective == pytest.approx(prepared.problem.objective(priced.ilp.choice))
    # Pricing the mesh's own solution gives it back.
    best = solve_prepared(prepared)
    again = price_on(prepared, best)
    assert again.strategies == best.strategies and again.objective == pytest.approx(best.objective)
    with pytest.raises(ValueError, match=r"same graph on a mesh of shape \(1, 8\), got mesh \(2, 4\)"):
        price_on(prepared, auto_shard(graph, mesh((2, 4)), aliases=aliases))


def test_strategies_memoised_across_equations_equal_the_rules_run_on_every_node(monkeypatch):
    # The rule cache keys an equation's strategies by its signature (primitive, params, shapes, dtypes,
    # literals) and the mesh; two layers of a GPT repeat every signature. Building the table with the cache
    # shared over a whole training step must give exactly what running the rules on every node gives.
    import optax
    from flax.training import train_state

    from alpa_like import models
    from alpa_like.compiler import auto_sharding
    from alpa_like.compiler.strategies import StrategyContext
    from alpa_like.models import gpt

    config = dataclasses.replace(models.get_config("gpt-tiny"), num_layers=2)
    params = gpt.gpt_param_shapes(config)
    state = jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(1e-3)),
                           params)
    loss = gpt.gpt_loss(gpt.GPTModel(config))

    def step(state, batch):
        grads = al.grad(loss)(state.params, batch)
        return state.apply_gradients(grads=grads)
    traced = trace_step(step, (state, gpt.gpt_batch_shapes(config, 8)), batch_argnums=(1,))
    graph = build_op_graph(traced.closed_jaxpr)
    ctx = StrategyContext(mesh=mesh((2, 4)))
    monkeypatch.setattr(auto_sharding, "_RULE_CACHE", {})
    cached = auto_sharding.strategy_table(graph, ctx)
    assert len(auto_sharding._RULE_CACHE) < sum(len(row) for row in cached) / 2  # the layers did share entries
    monkeypatch.setattr(auto_sharding, "eqn_signature", lambda eqn: None)
    assert auto_sharding.strategy_table(graph, ctx) == cached


def test_vocabulary_parallel_cross_entropy_needs_only_per_token_all_reduces():
    """Megatron-LM's vocabulary-parallel logits: the tied embedding ``w`` split over the vocabulary, the
    hidden states replicated. Logits, softmax and their gradients stay split over the vocabulary; what
    crosses devices is one float per token for each reduction over it: the label's logit (a gather), the
    max and the sum of the log-softmax: 3 all-reduces of ``B * S`` floats (the max's tie count for its
    derivative is dead code, since optax stops the max's gradient: the trace drops it, as XLA does). The
    softmax's ``broadcast_in_dim`` of a per-token scale to the logits' shape must be sliced to the split
    logits, not make them whole (it once all-gathered the ``B * S * V`` gradient)."""
    vocab, hidden, batch, seq = 256, 32, 2, 16

    def step(params, data):
        def loss(p):
            logits = jnp.einsum("bsh,vh->bsv", data["x"], p["w"])
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, data["y"]))
        value, grads = al.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    args = ({"w": jax.ShapeDtypeStruct((vocab, hidden), jnp.float32)},
            {"x": jax.ShapeDtypeStruct((batch, seq, hidden), jnp.float32),
             "y": jax.ShapeDtypeStruct((batch, seq), jnp.int32)})
    vocab_split = PassOptions(input_candidates={0: (S("S1R"),), 1: (S("RRR"),), 2: (S("RR"),)})
    solution, specs, _ = solve_step(step, args, mesh((1, 2)), vocab_split)
    assert specs["params.w"] == S("S1R")
    assert solution.objective == pytest.approx(3 * all_reduce(batch * seq * 4, 2))
    assert not solution.reshards or max(r.seconds for r in solution.reshards) < batch * seq * vocab


def test_rule_keys_of_solves_on_threads_are_distinct(monkeypatch):
    """The stage profiler solves on threads in a process connected to Ray: two signatures looked up at once
    must not get the same key (they did, and a layer took another equation's strategies, of another rank).
    The key table yields the GIL whenever it is measured, so that the threads interleave there."""
    import threading
    import time
    from alpa_like.compiler import auto_sharding

    class Yielding(dict):
        def __len__(self):
            size = super().__len__()
            time.sleep(0.0002)
            return size
    monkeypatch.setattr(auto_sharding, "_RULE_KEYS", Yielding())
    keys: dict = {}

    def look_up(thread: int):
        for k in range(50):
            parts = ("test-signature", thread, k)
            keys[parts] = auto_sharding._rule_key(*parts)
    threads = [threading.Thread(target=look_up, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys.values())) == len(keys) == 200
