"""Strategy rules: Table 3.3 on a 2x2 mesh, convolution / gather / scatter loops, propagation through
trivial operators, and one invariant table over every registered rule."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_like.compiler import jax_compat
from alpa_like.compiler.flops import ComputeRates
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.propagation import FOLLOW_RULES, follow_forward
from alpa_like.compiler.sharding_spec import ShardingSpec, enumerate_specs
from alpa_like.compiler.strategies import ROOT_RULES, StrategyContext, divides

S = ShardingSpec.from_str
# Distinct alpha and beta per axis, so that a cost on the wrong axis shows.
MESH = LogicalMesh(shape=(2, 2), alpha=(0.5, 0.25), beta=(1.0, 3.0))
CTX = StrategyContext(mesh=MESH)


def eqn_of(fn, *shapes, dtype=jnp.float32, primitive=None):
    """The first equation (of ``primitive`` if given) of ``fn`` traced on zeros of ``shapes``."""
    jaxpr = jax_compat.inline_calls(jax.make_jaxpr(fn)(*[jnp.zeros(s, dtype) for s in shapes])).jaxpr
    return next(e for e in jaxpr.eqns if primitive is None or e.primitive.name == primitive)


def by_name(strategies):
    return {s.name: s for s in strategies}


B, I, K, J = 4, 8, 12, 10
M = B * I * J * 4  # bytes of the float32 output C[b, i, j]


def all_reduce(num_bytes, axis):
    return MESH.all_reduce_cost(num_bytes, axis)


# Table 3.3: (mapping, output spec, input specs, cost).
TABLE_3_3 = [
    ("i->0, j->1", "RS0S1", ("RS0R", "RRS1"), 0.0),
    ("i->0, k->1", "RS0R", ("RS0S1", "RS1R"), all_reduce(M / 2, 1)),
    ("j->0, k->1", "RRS0", ("RRS1", "RS1S0"), all_reduce(M / 2, 1)),
    ("b->0, i->1", "S0S1R", ("S0S1R", "S0RR"), 0.0),
    ("b->0, k->1", "S0RR", ("S0RS1", "S0S1R"), all_reduce(M / 2, 1)),
    ("i->01", "RS01R", ("RS01R", "RRR"), 0.0),
    ("k->01", "RRR", ("RRS01", "RS01R"), all_reduce(M, (0, 1))),
]


@pytest.mark.parametrize("mapping, out, ins, cost", TABLE_3_3, ids=[row[0] for row in TABLE_3_3])
def test_batched_matmul_matches_table_3_3(mapping, out, ins, cost):
    eqn = eqn_of(lambda a, b: jnp.einsum("bik,bkj->bij", a, b), (B, I, K), (B, K, J))
    s = by_name(ROOT_RULES["dot_general"](eqn, CTX))[mapping]
    assert s.out_specs == (S(out),)
    assert s.in_specs == tuple(S(x) for x in ins)
    assert s.comm_seconds == pytest.approx(cost, rel=1e-12)
    assert s.compute_seconds == 0.0


def test_matmul_uses_every_device_when_it_can():
    eqn = eqn_of(lambda a, b: a @ b, (8, 8), (8, 8))
    strategies = ROOT_RULES["dot_general"](eqn, CTX)
    # 4 loops (i, j, k + none is excluded): each axis on one loop, both axes used: 3 * 3 = 9 mappings.
    assert len(strategies) == 9
    assert all(s.compute_seconds == 0.0 for s in strategies)


def test_matmul_falls_back_to_partial_strategies_with_their_redundant_compute():
    eqn = eqn_of(lambda a, b: a @ b, (3, 3), (3, 2))  # only j (size 2) divides: one axis at most
    ctx = StrategyContext(mesh=MESH, rates=ComputeRates(1e9))
    strategies = by_name(ROOT_RULES["dot_general"](eqn, ctx))
    flops = 2 * 3 * 2 * 3
    assert strategies["replicated"].compute_seconds == pytest.approx(flops / 1e9 * (1 - 1 / 4))
    assert strategies["j->0"].compute_seconds == pytest.approx(flops / 1e9 * (1 / 2 - 1 / 4))


def test_convolution_splits_batch_output_and_input_channels():
    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    eqn = eqn_of(conv, (4, 5, 5, 6), (3, 3, 6, 8))
    s = by_name(ROOT_RULES["conv_general_dilated"](eqn, CTX))
    assert s["b->0, o->1"].out_specs == (S("S0RRS1"),)
    assert s["b->0, o->1"].in_specs == (S("S0RRR"), S("RRRS1"))
    out_bytes = 4 * 5 * 5 * 8 * 4
    assert s["b->0, c->1"].in_specs == (S("S0RRS1"), S("RRS1R"))
    assert s["b->0, c->1"].comm_seconds == pytest.approx(all_reduce(out_bytes / 2, 1))


def test_embedding_lookup_is_batch_feature_or_vocabulary_parallel():
    table, ids = jnp.zeros((16, 8)), jnp.zeros((4, 6), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda t, i: t[i])(table, ids).jaxpr
    eqn = next(e for e in jaxpr.eqns if e.primitive.name == "gather")
    s = by_name(ROOT_RULES["gather"](eqn, CTX))
    # n0/n1: the index dims (batch, seq); d1: the feature dim; v0: the vocabulary dim.
    assert s["n0->0, d1->1"].out_specs == (S("S0RS1"),)
    assert s["n0->0, d1->1"].in_specs == (S("RS1"), S("S0RR"))
    vocab = s["n0->0, v0->1"]
    assert vocab.in_specs[0] == S("S1R")
    assert vocab.out_specs == (S("S0RR"),)
    assert vocab.comm_seconds == pytest.approx(all_reduce(4 * 6 * 8 * 4 / 2, 1))


def test_embedding_gradient_scatter_add_all_reduces_partial_sums():
    def f(t, i):
        return jax.grad(lambda t: jnp.sum(t[i]))(t)
    jaxpr = jax.make_jaxpr(f)(jnp.zeros((16, 8)), jnp.zeros((4, 6), jnp.int32)).jaxpr
    eqn = next(e for e in jaxpr.eqns if e.primitive.name == "scatter-add")
    s = by_name(ROOT_RULES["scatter-add"](eqn, CTX))
    data_parallel = s["n0->01"]
    assert data_parallel.out_specs == (S("RR"),)
    assert data_parallel.comm_seconds == pytest.approx(all_reduce(16 * 8 * 4, (0, 1)))
    split = s["d1->1, v0->0"]  # each device applies the updates landing in its rows and columns
    assert split.out_specs == (S("S0S1"),) and split.comm_seconds == 0.0


# ----------------------------------------------------------------------------------------- propagation

def derive(fn, spec, *shapes, pos=0, primitive=None, dtype=jnp.float32):
    eqn = eqn_of(fn, *shapes, primitive=primitive, dtype=dtype)
    return FOLLOW_RULES[eqn.primitive.name].derive(eqn, pos, S(spec), CTX)


def test_reduction_over_a_sharded_dim_all_reduces_the_result():
    s = derive(lambda x: jnp.sum(x, axis=1), "S0S1", (4, 6))
    assert s.out_specs == (S("S0"),)
    assert s.comm_seconds == pytest.approx(all_reduce(4 * 4 / 2, 1))


def test_argmax_needs_the_reduced_dim_whole():
    s = derive(lambda x: jnp.argmax(x, axis=1), "S0S1", (4, 6), primitive="argmax")
    assert s.in_specs == (S("S0R"),) and s.out_specs == (S("S0"),) and s.comm_seconds == 0.0


@pytest.mark.parametrize("in_shape, out_shape, spec, expect_in, expect_out", [
    ((4, 6), (24,), "S0R", "S0R", "S0"),           # merge: the major dim keeps its split
    ((4, 6), (24,), "RS1", "RR", "R"),             # merge: a minor split would be strided: gathered
    ((24,), (4, 6), "S0", "S0", "S0R"),            # split: 24/2 chunks are 2 rows of 6
    ((12, 8), (4, 3, 8), "S01R", "S01R", "S01RR"),  # split dim of 12 over 4 devices: 4 | 4
    ((12, 8), (3, 4, 8), "S01R", "RR", "RRR"),     # neither 4 nor 2 divides the new major dim 3: gathered
])
def test_reshape_moves_splits_that_stay_contiguous(in_shape, out_shape, spec, expect_in, expect_out):
    s = derive(lambda x: x.reshape(out_shape), spec, in_shape)
    assert s.in_specs == (S(expect_in),)
    assert s.out_specs == (S(expect_out),)


def test_broadcast_keeps_operand_splits_and_replicates_new_dims():
    s = derive(lambda b: jnp.broadcast_to(b, (4, 6)), "S1", (6,))
    assert s.out_specs == (S("RS1"),)


def test_elementwise_with_a_size_one_operand_replicates_its_broadcast_dims():
    eqn = eqn_of(lambda x, b: jax.lax.add(x, b), (4, 6), (1, 6))
    s = FOLLOW_RULES["add"].derive(eqn, 0, S("S0S1"), CTX)
    assert s.in_specs == (S("S0S1"), S("RS1")) and s.out_specs == (S("S0S1"),)


def test_elementwise_of_two_broadcasting_operands_follows_one_of_them():
    # LayerNorm's rsqrt(var)[b, s, 1] * scale[1, 1, h]: no operand has the output's shape, yet the product is
    # merged into the [b, s, 1] operand and keeps its split (it used to fall back to replicated).
    eqn = eqn_of(lambda v, g: jax.lax.mul(v, g), (4, 6, 1), (1, 1, 8), primitive="mul")
    rule = FOLLOW_RULES["mul"]
    assert rule.candidates(eqn) == (0, 1)
    s = rule.derive(eqn, 0, S("S0S1R"), CTX)
    assert s.out_specs == (S("S0S1R"),) and s.in_specs == (S("S0S1R"), S("RRR"))
    assert s.collectives == ()


def test_transpose_permutes_the_spec():
    s = derive(lambda x: x.T, "S0S1", (4, 6))
    assert s.out_specs == (S("S1S0"),)


def test_slice_and_concatenate_need_their_dim_whole():
    assert derive(lambda x: x[:, 1:3], "S0S1", (4, 6)).in_specs == (S("S0R"),)
    s = derive(lambda x, y: jnp.concatenate([x, y], axis=0), "S0S1", (4, 6), (4, 6))
    assert s.in_specs == (S("RS1"), S("RS1")) and s.out_specs == (S("RS1"),)


def test_data_parallel_layouts_follow_the_batch_split_and_stop_at_contractions_over_it():
    def step(x, w, dy):
        h = jnp.tanh(x @ w) + 1.0  # the batch rows stay split; the replicated w is read whole
        return h, h.T @ dy, jnp.sum(h), jnp.sort(h, axis=0)
    jaxpr = jax.make_jaxpr(step)(jnp.zeros((8, 4)), jnp.zeros((4, 6)), jnp.zeros((8, 3))).jaxpr
    x, w, dy = jaxpr.invars
    specs = follow_forward(jaxpr.eqns, {x: S("S0R"), dy: S("S0R")}, CTX)  # mesh axis 1 stays idle
    h, weight_grad, total, ordered = jaxpr.outvars
    assert specs[h] == S("S0R") and w not in specs
    # a contraction over the split rows is all-reduced, and a sort needs them whole: no layout follows
    assert weight_grad not in specs and total not in specs and ordered not in specs


# ----------------------------------------------------------------------------------- invariant table

def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


# Every registered root rule, with the arguments to trace it; one row per rule (optax alias_test style).
ROOT_CASES = {
    "dot_general": (lambda a, b: jnp.einsum("bik,bkj->bij", a, b), [(4, 8, 6), (4, 6, 8)], jnp.float32),
    "conv_general_dilated": (_conv, [(4, 6, 6, 4), (3, 3, 4, 8)], jnp.float32),
    "gather": (lambda t: t[jnp.array([1, 3])], [(8, 4)], jnp.float32),
    "scatter-add": (lambda t: t.at[jnp.array([1, 3])].add(1.0), [(8, 4)], jnp.float32),
    "scatter": (lambda t: t.at[jnp.array([1, 3])].set(1.0), [(8, 4)], jnp.float32),
}


@pytest.mark.parametrize("primitive", sorted(ROOT_RULES))
def test_every_root_strategy_is_valid(primitive):
    fn, shapes, dtype = ROOT_CASES[primitive]
    eqn = eqn_of(fn, *shapes, primitive=primitive, dtype=dtype)
    strategies = ROOT_RULES[primitive](eqn, CTX)
    assert strategies
    for s in strategies:
        assert len(s.in_specs) == len(eqn.invars) and len(s.out_specs) == len(eqn.outvars)
        for spec, v in zip((*s.in_specs, *s.out_specs), (*eqn.invars, *eqn.outvars)):
            if spec is not None:
                assert spec.ndim == len(v.aval.shape) and divides(v.aval.shape, spec, MESH.shape), (s.name, spec)
        assert np.isfinite(s.cost) and s.cost >= 0


FOLLOW_CASES = [
    (lambda x: jnp.tanh(x) * x, [(4, 6)]),
    (lambda x: jnp.sum(x, axis=0), [(4, 6)]),
    (lambda x: jnp.max(x, axis=1), [(4, 6)]),
    (lambda x: jnp.cumsum(x, axis=1), [(4, 6)]),
    (lambda x: jnp.sort(x, axis=0), [(4, 6)]),
    (lambda x: jax.lax.top_k(x, 2), [(4, 6)]),
    (lambda x: jnp.pad(x, ((1, 1), (0, 0))), [(4, 6)]),
    (lambda x: x[::-1], [(4, 6)]),
    (lambda x: jax.lax.dynamic_slice(x, (1, 0), (2, 6)), [(4, 6)]),
    (lambda x, u: jax.lax.dynamic_update_slice(x, u, (1, 0)), [(4, 6), (2, 6)]),
    (lambda x: x.reshape(2, 12).T, [(4, 6)]),
    (lambda x: jnp.squeeze(x[:, :1], axis=1), [(4, 6)]),
    (lambda x: jnp.where(x > 0, x, 0.0).astype(jnp.float16), [(4, 6)]),
    (lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (2, 1), (2, 1), "VALID"), [(4, 6)]),
]


@pytest.mark.parametrize("case", range(len(FOLLOW_CASES)))
def test_every_follow_rule_gives_valid_specs_for_every_operand_spec(case):
    fn, shapes = FOLLOW_CASES[case]
    jaxpr = jax_compat.inline_calls(jax.make_jaxpr(fn)(*[jnp.ones(s) for s in shapes])).jaxpr
    checked = 0
    for eqn in jaxpr.eqns:
        rule = FOLLOW_RULES.get(eqn.primitive.name)
        if rule is None:
            continue
        for pos in rule.candidates(eqn):
            for spec in enumerate_specs(eqn.invars[pos].aval.shape, MESH.shape):
                s = rule.derive(eqn, pos, spec, CTX)
                for out, v in zip(s.out_specs, eqn.outvars):
                    assert out.ndim == len(v.aval.shape) and divides(v.aval.shape, out, MESH.shape)
                for sp, v in zip(s.in_specs, eqn.invars):
                    if sp is not None:
                        assert sp.ndim == len(v.aval.shape) and divides(v.aval.shape, sp, MESH.shape)
                checked += 1
    assert checked
