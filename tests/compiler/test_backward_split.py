"""B/W split of a stage's backward: B then W compute exactly the backward, with exactly its FLOPs."""
import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like import models
from alpa_like.compiler import backward_split, jax_compat
from alpa_like.compiler.backward_split import (PHASES_SPLIT, WEIGHT, input_gradient_outputs, pins_after_split,
                                               split_backward, split_backwards, without_dead_positions)
from alpa_like.compiler.flops import jaxpr_flops
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.sliced_step import slice_step
from alpa_like.compiler.stage_construction import apply_order, build_stage_program
from alpa_like.models import moe
from tests.compiler.test_stage_construction import tiny_gpt
from tests.helpers import make_train_step, mlp_batch, mlp_loss, mlp_state

MLP_SIZES = (16, 32, 32, 8)


def mlp_case():
    state = mlp_state(sizes=MLP_SIZES)
    return make_train_step(mlp_loss), state, mlp_batch(np.random.default_rng(0), sizes=MLP_SIZES), 2


def gpt_case():
    step, state, batch = tiny_gpt(num_layers=2)
    return step, state, batch, 4


def moe_case():
    config = models.get_config("moe-tiny")
    model = moe.MoEModel(config)
    batch = moe.moe_batch(config, 8, jax.random.PRNGKey(1))
    params = model.init(jax.random.PRNGKey(0), batch["input_ids"])["params"]
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    return make_train_step(moe.moe_loss(model)), state, batch, 4


CASES = {"mlp": mlp_case, "gpt": gpt_case, "moe": moe_case}


@functools.cache
def one_stage_per_layer(case):
    """The case's stage program as the pipeline builds it (one micro-batch, one stage per layer) and its
    values after forward and backward."""
    step, state, batch, layer_num = CASES[case]()
    method = al.PipeshardParallel(num_micro_batches=1, layer_option=al.AutoLayerOption(layer_num=layer_num))
    sliced = slice_step(method, step, (state, batch), static_argnums=(), batch_argnums=(1,))
    program = build_stage_program(sliced.closed_jaxpr, sliced.pieces, [[l] for l in range(layer_num)],
                                  [r == "batch" for r in sliced.roles])
    env = values_after_backward(program, jax.tree.leaves((state, batch)))
    return program, env


def evaluate(closed, *args):
    """``closed`` on ``args`` as one compiled program (op by op, every equation would compile on its own)."""
    return jax.jit(functools.partial(jax_compat.eval_closed_jaxpr, closed))(*args)


def run_piece(piece, env):
    outs = evaluate(piece.jaxpr, *[env[i] for i in piece.inputs])
    env.update(zip(piece.outputs, outs, strict=True))


def values_after_backward(program, flat_inputs, phases=(FORWARD, BACKWARD)):
    """Every value of one micro-batch (the whole batch) after the pieces of ``phases``: forwards in stage
    order, then each backward phase in reverse stage order."""
    env = dict(program.constants)
    env.update(zip(program.step_inputs, flat_inputs, strict=True))
    for q in range(program.num_stages):
        run_piece(program.piece(q, FORWARD), env)
    for phase in phases[1:]:
        for q in reversed(range(program.num_stages)):
            run_piece(program.piece(q, phase), env)
    return env


def defined(closed):
    return {v for e in closed.jaxpr.eqns for v in e.outvars}


@pytest.mark.parametrize("case", sorted(CASES))
def test_b_then_w_is_the_backward(case):
    program, env = one_stage_per_layer(case)
    for q in range(program.num_stages):
        piece = program.piece(q, BACKWARD)
        args = [env[i] for i in piece.inputs]
        split = split_backward(piece.jaxpr, input_gradient_outputs(program, q))
        want = evaluate(piece.jaxpr, *args)
        b_out = evaluate(split.b, *[args[k] for k in split.b_inputs])
        saved = [b_out[i] for i in split.saved_from]
        w_out = evaluate(split.w, *[args[k] for k in split.w_inputs], *saved)
        got = dict(zip(split.b_outputs, b_out)) | dict(zip(split.w_outputs, w_out, strict=True))
        assert sorted(got) == list(range(len(want)))
        for k, value in enumerate(want):  # the same equations on the same operands: bitwise equal
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(value), err_msg=f"stage {q} output {k}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_b_and_w_share_no_work_and_add_no_flops(case):
    program, _ = one_stage_per_layer(case)
    split_somewhere = False
    for q in range(program.num_stages):
        closed = program.piece(q, BACKWARD).jaxpr
        split = split_backward(closed, input_gradient_outputs(program, q))
        live = without_dead_positions(closed)
        assert jaxpr_flops(split.b) + jaxpr_flops(split.w) == jaxpr_flops(live)
        # Only the first and last stages may compute cotangents of batch leaves (the MLP's inputs and
        # targets), which their bwd_end markers drop.
        if 0 < q < program.num_stages - 1:
            assert jaxpr_flops(live) == jaxpr_flops(closed)
        # No value computed twice, none computed that the backward does not compute.
        assert not defined(split.b) & defined(split.w)
        assert defined(split.b) | defined(split.w) <= defined(closed)
        non_markers = [e for e in (*split.b.jaxpr.eqns, *split.w.jaxpr.eqns) if not is_marker(e)]
        assert len({id(e) for e in non_markers}) == len(non_markers)
        # W reads the backward's inputs and values B made, each of those read by W: nothing recomputed.
        saved = set(split.saved)
        assert saved <= defined(split.b)
        assert set(split.w.jaxpr.invars) - saved <= set(closed.jaxpr.invars)
        w_reads = set(jax_compat.free_vars(split.w.jaxpr.eqns)) | set(split.w.jaxpr.outvars)
        assert saved <= w_reads
        split_somewhere |= jaxpr_flops(split.b) > 0 and jaxpr_flops(split.w) > 0
    assert split_somewhere


def test_weight_gradient_contractions_go_to_w():
    """Each stage of the MLP that has an input cotangent: its B does the ``dy @ W^T`` products, its W the
    ``x^T @ dy`` ones (one per kernel) and the bias sums."""
    program, _ = one_stage_per_layer("mlp")
    for q in range(1, program.num_stages):
        piece = program.piece(q, BACKWARD)
        split = split_backward(piece.jaxpr, input_gradient_outputs(program, q))
        kernels = [v for v in split.w.jaxpr.outvars if v.aval.ndim == 2]
        w_dots = [e for e in split.w.jaxpr.eqns if e.primitive.name == "dot_general"]
        assert len(w_dots) == len(kernels) >= 1
        assert [v.aval.ndim for v in split.b.jaxpr.outvars[:len(split.b_outputs)]] == [2]
        assert all(e.primitive.name != "reduce_sum" for e in split.b.jaxpr.eqns)


def test_the_first_stage_has_an_empty_b():
    program, env = one_stage_per_layer("mlp")
    assert input_gradient_outputs(program, 0) == ()
    split = split_backward(program.piece(0, BACKWARD).jaxpr, ())
    assert jaxpr_flops(split.b) == 0 and split.saved == () and split.b.jaxpr.outvars == []
    assert jaxpr_flops(split.w) == jaxpr_flops(without_dead_positions(program.piece(0, BACKWARD).jaxpr)) > 0


def test_a_gradient_b_computes_anyway_is_returned_by_b():
    """A parameter whose gradient is a value B needs (db = dx here) costs W nothing: B returns it; a
    literal gradient and a pass-through input stay with W, which reads the input."""
    def bwd(dy, x):
        dz = jnp.tanh(dy) * 2.0
        return dz, dz, 0.0, x, jnp.sum(x * dz)
    closed = jax.make_jaxpr(bwd)(jnp.ones(3), jnp.ones(3))
    assert type(closed.jaxpr.outvars[2]).__name__ == "Literal"
    split = split_backward(closed, [0])
    assert (split.b_outputs, split.w_outputs) == ((0, 1), (2, 3, 4))
    assert (split.b_inputs, split.w_inputs, split.saved_from) == ((0,), (1,), (0,))
    dy, x = jnp.arange(3.0), jnp.full(3, 3.0)
    want = jax_compat.eval_closed_jaxpr(closed, dy, x)
    b_out = jax_compat.eval_closed_jaxpr(split.b, dy)
    w_out = jax_compat.eval_closed_jaxpr(split.w, x, *[b_out[i] for i in split.saved_from])
    for got, value in zip([*b_out, *w_out], want, strict=True):
        np.testing.assert_array_equal(got, value)


def test_constants_and_effects():
    """Constants go to the part that reads them; an equation with effects runs in B, with what it reads."""
    table = np.arange(3.0, dtype=np.float32)

    def bwd(dy, x):
        dx = dy * jnp.asarray(table)
        jax.debug.print("{}", jnp.sum(x))
        return dx, jnp.sum(x * dx) + jnp.asarray(table)[0]
    closed = jax.make_jaxpr(bwd)(jnp.ones(3), jnp.ones(3))
    split = split_backward(closed, [0])
    assert any(e.effects for e in split.b.jaxpr.eqns) and not any(e.effects for e in split.w.jaxpr.eqns)
    args = (jnp.arange(3.0), jnp.full(3, 2.0))
    want = jax_compat.eval_closed_jaxpr(closed, *args)
    b_out = jax_compat.eval_closed_jaxpr(split.b, *[args[k] for k in split.b_inputs])
    w_out = jax_compat.eval_closed_jaxpr(split.w, *[args[k] for k in split.w_inputs],
                                         *[b_out[i] for i in split.saved_from])
    np.testing.assert_array_equal(b_out[0], want[0])
    np.testing.assert_array_equal(w_out[0], want[1])


def test_bad_positions_are_rejected():
    closed = jax.make_jaxpr(lambda x: (x, x))(1.0)
    with pytest.raises(ValueError, match=r"input_gradients must be positions of the backward's 2 outputs; got \[2\]"):
        split_backward(closed, [2])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_program_with_split_backwards_computes_the_step(case):
    """Forwards, then every B, then every W (W's per-micro-batch inputs kept until it runs) give the
    original program's gradients bitwise, and the same applied step."""
    program, env = one_stage_per_layer(case)
    env = dict(env)
    split = split_backwards(program)
    assert {phase for _, phase in split.pieces} == set(PHASES_SPLIT)
    made = [v for piece in split.pieces.values() for v in piece.outputs]
    assert len(made) == len(set(made))  # one writer per value: each gradient is accumulated once
    assert all(split.home[v] == q for q in range(split.num_stages) for v in split.piece(q, WEIGHT).inputs
               if v >= len(program.values))
    flat = [env[i] for i in program.step_inputs]
    got = values_after_backward(split, flat, phases=(FORWARD, BACKWARD, WEIGHT))
    for src, dst in program.accumulated:  # one micro-batch: the mean is the value
        np.testing.assert_array_equal(np.asarray(got[src]), np.asarray(env[src]))
        got[dst], env[dst] = got[src], env[src]
    for q in apply_order(split):
        run_piece(split.piece(q, APPLY), got)
    for q in apply_order(program):
        run_piece(program.piece(q, APPLY), env)
    for v in program.step_outputs:
        if v is not None:
            np.testing.assert_array_equal(np.asarray(got[v]), np.asarray(env[v]))


def test_pins_follow_the_cut_markers():
    """A pin on a bwd_end marker's weight-gradient position moves to W's marker, at its new index; pins on
    kept equations stay; a pin on a dropped position is dropped."""
    program, _ = one_stage_per_layer("mlp")
    closed = program.piece(1, BACKWARD).jaxpr
    split = split_backward(closed, input_gradient_outputs(program, 1))
    end = closed.jaxpr.eqns[-1]
    assert is_marker(end, "bwd_end")
    dot = next(e for e in split.w.jaxpr.eqns if e.primitive.name == "dot_general")
    pins = [(end, k, f"spec{k}") for k in range(len(end.outvars))] + [(dot, 0, "dot")]
    eqns = [*split.b.jaxpr.eqns, *split.w.jaxpr.eqns]
    moved = pins_after_split(pins, eqns)
    assert (dot, 0, "dot") in moved
    for eqn, k, spec in moved[:-1]:
        assert any(eqn is e for e in eqns) and is_marker(eqn, "bwd_end")
        assert eqn.outvars[k] is end.outvars[int(spec[4:])]
    live = {v for v in end.outvars if v in set(closed.jaxpr.outvars)}
    assert len(moved) - 1 == len(live)


def test_a_checkpointed_block_runs_in_b_unless_inlined():
    """A ``jax.checkpoint`` block's backward is one equation: B runs it whole. Inlined as JAX lowers it
    (:func:`~alpa_like.compiler.jax_compat.inline_remat`), W gets its weight gradient."""
    def f(w, x):
        return jnp.sum(jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x))
    w, x = jnp.ones((4, 4)), jnp.ones((3, 4))
    closed = jax.make_jaxpr(jax.vjp(f, w, x)[1])(1.0)  # outputs (dw, dx)
    whole = split_backward(closed, [1])
    assert jaxpr_flops(whole.w) == 0 and jaxpr_flops(whole.b) == jaxpr_flops(closed)
    inlined = closed.replace(jaxpr=jax_compat.inline_remat(closed.jaxpr))
    split = split_backward(inlined, [1])
    assert [e.primitive.name for e in split.w.jaxpr.eqns] == ["dot_general", "transpose"]
    assert jaxpr_flops(split.b) + jaxpr_flops(split.w) == jaxpr_flops(inlined)
    assert split.b_inputs == (0,) and split.w_inputs == ()  # W reads the saved cotangent and the residual x
    b_out = jax_compat.eval_closed_jaxpr(split.b, 1.0)
    dw, = jax_compat.eval_closed_jaxpr(split.w, *[b_out[i] for i in split.saved_from])
    np.testing.assert_array_equal(dw, jax_compat.eval_closed_jaxpr(closed, 1.0)[0])


def test_doctests():
    assert doctest.testmod(backward_split).failed == 0
