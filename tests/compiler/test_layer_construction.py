"""Layer construction keeps values and gradients and delimits every layer in forward and backward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_like.compiler.layer_construction import construct_layers, manual_layers
from alpa_like.compiler.markers import is_marker, mark_pipeline_boundary


def mlp3(params, x):
    for i, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if i < len(params) - 1:
            mark_pipeline_boundary()
    return jnp.mean(x ** 2)


@pytest.fixture
def args():
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=(4, 4)), jnp.float32) for _ in range(3)]
    return params, jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)


@pytest.mark.parametrize("remat", [False, True])
def test_same_value_and_gradient(args, remat):
    layered = construct_layers(mlp3, manual_layers, remat=remat)
    np.testing.assert_allclose(jax.jit(layered)(*args), jax.jit(mlp3)(*args), rtol=1e-6)
    # rtol 1e-5 as elsewhere: with remat the backward recomputes the forward inside another fusion, which can
    # round differently in float32's last bits (2.6e-6 seen at LLVM optimisation level 0)
    for a, b in zip(jax.jit(jax.grad(layered))(*args), jax.jit(jax.grad(mlp3))(*args), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_each_manual_layer_is_delimited_forward_and_backward(args):
    eqns = jax.make_jaxpr(jax.grad(construct_layers(mlp3, manual_layers)))(*args).jaxpr.eqns
    kinds = [(e.params["kind"], e.params["layer"]) for e in eqns if is_marker(e)]
    forward = [k for k in kinds if k[0].startswith("fwd")]
    backward = [k for k in kinds if k[0].startswith("bwd")]
    assert forward == [(k, l) for l in range(3) for k in ("fwd_start", "fwd_end")]
    assert backward == [(k, l) for l in (2, 1, 0) for k in ("bwd_start", "bwd_end")]
    assert not any(is_marker(e, "boundary") for e in eqns)


def test_auto_layers_cut_a_gpt_into_equal_blocks():
    from alpa_like import models
    from alpa_like.compiler.layer_construction import auto_layers
    from alpa_like.models import gpt

    config = models.get_config("gpt-tiny")
    config = type(config)(**{**config.__dict__, "num_layers": 4})
    loss = gpt.gpt_loss(gpt.GPTModel(config))
    params = gpt.gpt_param_shapes(config)
    batch = gpt.gpt_batch_shapes(config, 8)
    jaxpr = jax.make_jaxpr(loss)(params, batch).jaxpr
    layers = auto_layers(4, delta=0.6)(jaxpr)
    assert sorted(set(layers)) == [0, 1, 2, 3]
    flops = np.zeros(4)
    from alpa_like.compiler.flops import eqn_flops
    for eqn, layer in zip(jaxpr.eqns, layers):
        flops[layer] += eqn_flops(eqn)
    assert flops.max() <= 1.6 * flops.mean()
    with pytest.raises(ValueError, match="use a smaller layer_num"):
        auto_layers(1000, delta=0.6)(jaxpr)


def test_auto_layers_can_find_the_least_slack():
    from alpa_like.compiler.layer_clustering import least_delta

    assert least_delta([1.0, 1.0, 1.0, 1.0], 2) == 0.0
    assert least_delta([1.0, 1.0, 1.0, 5.0], 2) == pytest.approx(5 / 4 - 1)  # the heavy op alone: 5 of 8


def test_layers_stacked_in_a_scan_or_one_checkpoint_are_a_clear_error_naming_it():
    from alpa_like.compiler.layer_construction import auto_layers

    def loss(ws, x):
        return jnp.mean(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0] ** 2)
    jaxpr = jax.make_jaxpr(loss)(jnp.ones((4, 8, 8)), jnp.ones((2, 8))).jaxpr
    with pytest.raises(ValueError, match="its scan loop counts as one operator"):
        auto_layers(2, delta=0.6)(jaxpr)

    def loss_with_head(ws, head, x):  # enough operators, but the scan holds nearly every FLOP
        h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
        return jnp.mean((h @ head) ** 2)
    jaxpr = jax.make_jaxpr(loss_with_head)(jnp.ones((4, 8, 8)), jnp.ones((8, 1)), jnp.ones((2, 8))).jaxpr
    with pytest.raises(ValueError, match="needs delta >= .*its scan loop counts as one operator"):
        auto_layers(2, delta=0.1)(jaxpr)

    checkpointed = jax.checkpoint(lambda w, x: jnp.mean(jnp.tanh(x @ w) @ w))  # the whole loss: one operator
    jaxpr = jax.make_jaxpr(checkpointed)(jnp.ones((8, 8)), jnp.ones((2, 8))).jaxpr
    with pytest.raises(ValueError, match="a jax.checkpoint / nn.remat block counts as one operator"):
        auto_layers(2, delta=0.6)(jaxpr)


def test_a_checkpointed_block_or_a_scan_is_one_operator():
    """Blocks the user wrapped in jax.checkpoint (what nn.remat emits) are one operator each, not zero: their
    matmuls are inside the call. The step's gradient later differentiates through them as usual."""
    from alpa_like.compiler.layer_construction import auto_layers, operator_segments

    def loss(ws, x):
        for w in ws:
            x = jax.checkpoint(lambda w, h: jnp.tanh(h @ w))(w, x)
        return jnp.mean(jax.lax.scan(lambda h, w: (h @ w, None), x, jnp.stack(ws))[0] ** 2)
    jaxpr = jax.make_jaxpr(loss)([jnp.ones((8, 8))] * 3, jnp.ones((2, 8))).jaxpr
    segments = operator_segments(jaxpr)
    heavy = [e.primitive.name for e in jaxpr.eqns if e.primitive.name in ("checkpoint", "remat2", "scan")]
    assert len(heavy) == 4 and segments[-1] == 3
    assert max(auto_layers(2, delta=None)(jaxpr)) == 1


def test_operator_segments_cut_where_the_fewest_bytes_are_live():
    """A residual block: ``h = x + (x @ w1) @ w2`` then ``h @ w3``. Cutting before the add leaves both
    addends live (x and the projection); cutting after it leaves only h, so the add joins w2's segment."""
    from alpa_like.compiler.layer_construction import operator_segments

    def f(x0, w1, w2, w3):
        x = jnp.tanh(x0)  # made by an equation, as a block's input is (step inputs are loaded, not live)
        h = x + (x @ w1) @ w2
        return jnp.tanh(h @ w3)

    shapes = [jax.ShapeDtypeStruct((8, 4), jnp.float32)] + [jax.ShapeDtypeStruct((4, 4), jnp.float32)] * 3
    jaxpr = jax.make_jaxpr(f)(*shapes).jaxpr
    segments = operator_segments(jaxpr)
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names == ["tanh", "dot_general", "dot_general", "add", "dot_general", "tanh"]
    assert segments == [0, 0, 1, 1, 2, 2]


def _convs(x, kernels, cut_after):
    for i, k in enumerate(kernels):
        if i:
            x = jnp.tanh(x)
        x = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        if i == cut_after:
            mark_pipeline_boundary()
    return x.sum()


def test_a_rematerialized_layer_cut_after_a_convolution_does_not_recompute_it():
    """What :func:`recompute_savings` assumes of JAX: with per-layer remat, a layer ending right after a
    convolution (or a convolution and a sum) recomputes the layer's other convolutions only."""
    from alpa_like.compiler.flops import conv_flops
    from alpa_like.compiler.layer_construction import operator_segments, recompute_savings

    kernels = [jnp.ones((3, 3, 4, 4))] * 3
    x = jnp.ones((2, 8, 8, 4))

    def loss(kernels):
        return _convs(x, kernels, cut_after=1)  # layers: conv, tanh, conv | tanh, conv, sum

    def conv_work(remat):
        grad = jax.make_jaxpr(jax.grad(construct_layers(loss, manual_layers, remat=remat)))(kernels)
        return sum(conv_flops(e) for e in _all_eqns(grad.jaxpr) if e.primitive.name == "conv_general_dilated")

    one_conv = 2 * (2 * 8 * 8 * 4) * (3 * 3 * 4)
    assert conv_work(True) - conv_work(False) == one_conv  # the first convolution, recomputed once
    jaxpr = jax.make_jaxpr(lambda k: _convs(x, k, cut_after=-1))(kernels).jaxpr
    segments = operator_segments(jaxpr)
    assert recompute_savings(jaxpr, segments) == [one_conv] * 3
    # A segment whose convolution feeds an operation that needs it (tanh) within the segment saves nothing.
    jaxpr = jax.make_jaxpr(lambda k: jnp.tanh(_convs(x, k, cut_after=-1)))(kernels).jaxpr
    assert recompute_savings(jaxpr, operator_segments(jaxpr))[-1] == 0.0


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def test_a_boundary_marked_inside_a_checkpointed_block_is_a_clear_error():
    """It would cut nothing there (UniformStageOption would then see "the step has 1 layers")."""
    def block(w, h):
        h = jnp.tanh(h @ w)
        mark_pipeline_boundary()
        return h

    def loss(w, x):
        return jnp.mean(jax.checkpoint(block)(w, jax.checkpoint(block)(w, x)))
    jaxpr = jax.make_jaxpr(loss)(jnp.ones((8, 8)), jnp.ones((2, 8))).jaxpr
    with pytest.raises(ValueError, match=r"mark_pipeline_boundary\(\) is called inside a (checkpoint|remat2) body"):
        manual_layers(jaxpr)
