"""Finding a loss that is a sum over the batch dim, and the warning every method gives for it."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_like as al
from alpa_like.compiler.loss_reduction import batch_sums
from alpa_like.compiler.trace import trace_step

ROWS, FEATURES, CLASSES, LATENT = 8, 6, 5, 3
SUMMED = "adds up per-example values over the batch dim"


def _params():
    rng = np.random.default_rng(0)
    return {name: jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
            for name, shape in (("enc", (FEATURES, 2 * LATENT)), ("dec", (LATENT, FEATURES)),
                                ("head", (FEATURES, CLASSES)), ("wide", (FEATURES, 2 * ROWS)))}


def _batch(rows=ROWS):
    rng = np.random.default_rng(1)
    return {"x": jnp.asarray(rng.normal(size=(rows, FEATURES)), jnp.float32),
            "label": jnp.asarray(rng.integers(0, CLASSES, size=rows), jnp.int32),
            "mask": jnp.asarray(rng.integers(0, 2, size=rows), jnp.float32)}


def _vae(params, x, boundary=False):
    """Logits of the reconstruction, and the per-example KL divergence of the latent (shape [rows])."""
    h = x @ params["enc"]
    mean, logvar = h[:, :LATENT], h[:, LATENT:]
    if boundary:
        al.mark_pipeline_boundary()
    logits = jnp.tanh(mean) @ params["dec"]
    kld = -0.5 * jnp.sum(1 + logvar - mean ** 2 - jnp.exp(logvar), axis=-1)
    return logits, kld


def vae_loss_summed_kl(params, batch, boundary=False):
    """bce averaged, KL summed over the examples."""
    logits, kld = _vae(params, batch["x"], boundary)
    bce = optax.sigmoid_binary_cross_entropy(logits, jax.nn.sigmoid(batch["x"])).sum(-1).mean()
    return bce + jnp.sum(kld)


def vae_loss_averaged(params, batch, boundary=False):
    logits, kld = _vae(params, batch["x"], boundary)
    bce = optax.sigmoid_binary_cross_entropy(logits, jax.nn.sigmoid(batch["x"])).sum(-1).mean()
    return bce + jnp.mean(kld)


def _squares(params, batch):
    return (batch["x"] @ params["head"] - 1.0) ** 2  # [rows, classes]


def _logits(params, batch):
    return batch["x"] @ params["head"]


def _wide(params, batch):
    """[rows, 2 * ROWS]: its last dim is a multiple of a micro-batch's rows, as a sequence length often is."""
    return jnp.tanh(batch["x"] @ params["wide"]) ** 2


NOT_SUMS = {
    "jnp.mean": lambda p, b: jnp.mean(_squares(p, b)),
    "sum / rows": lambda p, b: jnp.sum(_squares(p, b)) / b["x"].shape[0],
    "mean of per-row sums": lambda p, b: jnp.mean(jnp.sum(_squares(p, b), axis=-1)),
    "sum over features of the batch mean": lambda p, b: jnp.sum(jnp.mean(_squares(p, b), axis=0)),
    "twice the mean": lambda p, b: 2.0 * jnp.mean(_squares(p, b)),
    "optax cross entropy mean": lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
        _logits(p, b), b["label"]).mean(),
    "masked mean": lambda p, b: jnp.sum(jnp.sum(_squares(p, b), -1) * b["mask"]) / jnp.maximum(jnp.sum(b["mask"]), 1),
    "max over the batch": lambda p, b: jnp.sum(jnp.max(_logits(p, b), axis=0)),
    "sum over a wide dim of the batch mean": lambda p, b: jnp.sum(jnp.mean(_wide(p, b), axis=0)),
    "a sum over parameters plus a mean": lambda p, b: jnp.mean(_squares(p, b)) + jnp.sum(p["head"] ** 2),
    "VAE, everything averaged": vae_loss_averaged,
}

SUMS = {
    "jnp.sum": lambda p, b: jnp.sum(_squares(p, b)),
    "half the sum": lambda p, b: 0.5 * jnp.sum(_squares(p, b)),
    "optax cross entropy sum": lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
        _logits(p, b), b["label"]).sum(),
    "sum over the examples of means over a wide dim": lambda p, b: jnp.sum(jnp.mean(_wide(p, b), axis=-1)),
    "masked sum": lambda p, b: jnp.sum(jnp.where(b["mask"][:, None] > 0, _squares(p, b), 0.0)),
    "VAE, KL summed over the examples": vae_loss_summed_kl,
}


def _sums_of(loss_fn, with_value=False, m=2):
    def step(params, batch):
        if with_value:
            loss, grads = al.value_and_grad(loss_fn)(params, batch)
        else:
            grads, loss = al.grad(loss_fn)(params, batch), 0.0
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    traced = trace_step(step, (_params(), _batch()), batch_argnums=(1,), num_micro_batches=m)
    return batch_sums(traced.closed_jaxpr, [leaf.is_batch for leaf in traced.in_leaves])


@pytest.mark.parametrize("with_value", [False, True], ids=["grad", "value_and_grad"])
@pytest.mark.parametrize("name", sorted(NOT_SUMS))
def test_losses_that_average_over_the_batch_are_not_reported(name, with_value):
    assert _sums_of(NOT_SUMS[name], with_value) == ()


@pytest.mark.parametrize("with_value", [False, True], ids=["grad", "value_and_grad"])
@pytest.mark.parametrize("name", sorted(SUMS))
def test_losses_that_sum_over_the_batch_are_reported(name, with_value):
    found = _sums_of(SUMS[name], with_value)
    assert found
    assert all(s.shape[0] == ROWS // 2 for s in found)  # one micro-batch's rows


def test_the_vae_kl_sum_is_found_with_its_per_example_scale():
    found = _sums_of(vae_loss_summed_kl)
    assert {s.shape for s in found} == {(ROWS // 2, LATENT)}
    assert {abs(s.scale) for s in found} == {0.5}  # -0.5 * sum(1 + logvar - ...) over latent and examples


def test_a_sum_inside_a_nested_grad_is_not_the_loss():
    def loss(params, batch):  # a gradient penalty: the inner grad sums over the batch, the loss averages
        inner = jax.grad(lambda x: jnp.sum(jnp.tanh(x @ params["head"])))(batch["x"])
        return jnp.mean(jnp.sum(inner ** 2, axis=-1))

    assert _sums_of(loss) == ()


def test_a_custom_vjp_rule_with_ones_is_not_the_seed():
    @jax.custom_vjp
    def straight_through(x):
        return jnp.round(x)

    straight_through.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g * jnp.ones_like(g),))
    assert _sums_of(lambda p, b: jnp.mean(straight_through(_logits(p, b)) ** 2)) == ()


def test_without_micro_batches_or_without_al_grad_nothing_is_reported():
    assert _sums_of(SUMS["jnp.sum"], m=1)  # the analysis itself reads only the jaxpr ...
    traced = trace_step(lambda p, b: jax.grad(SUMS["jnp.sum"])(p, b), (_params(), _batch()), batch_argnums=(1,),
                        num_micro_batches=2)
    assert batch_sums(traced.closed_jaxpr, [leaf.is_batch for leaf in traced.in_leaves]) == ()  # no marker


# ------------------------------------------------------------------------------------------ the warning

def _train_step(loss_fn, boundary=False):
    def step(params, batch):
        loss, grads = al.value_and_grad(functools.partial(loss_fn, boundary=boundary))(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss
    return step


def _summed_warnings(record):
    return [w for w in record if issubclass(w.category, UserWarning) and SUMMED in str(w.message)]


def test_data_parallel_with_micro_batches_warns_once_for_a_summed_loss():
    step = al.parallelize(_train_step(vae_loss_summed_kl), method=al.DataParallel(num_micro_batches=2))
    with pytest.warns(UserWarning, match=SUMMED) as record:
        exe = step.get_executable(_params(), _batch(rows=16))
    assert len(_summed_warnings(record)) == 1
    message, = [w for w in exe.plan.warnings if SUMMED in w]
    assert "1/2 of the full-batch sum" in message and "Divide the loss by the batch size" in message


@pytest.mark.parametrize("method", [al.Zero2Parallel(num_micro_batches=2), al.Zero3Parallel(num_micro_batches=2),
                                    al.ShardParallel(num_micro_batches=2)], ids=lambda m: type(m).__name__)
def test_every_spmd_method_puts_the_warning_in_its_plan(method):
    with pytest.warns(UserWarning, match=SUMMED) as record:
        plan = al.plan(_train_step(vae_loss_summed_kl), _params(), _batch(rows=16), method=method)
    assert len(_summed_warnings(record)) == 1
    assert any(SUMMED in w for w in plan.warnings)


def test_pipeshard_with_micro_batches_warns_for_a_summed_loss():
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  stage_option=al.AutoStageOption(show_progress=False))
    with pytest.warns(UserWarning, match=SUMMED) as record:
        plan = al.plan(_train_step(vae_loss_summed_kl, boundary=True), _params(), _batch(rows=16), method=method,
                       cluster=al.ClusterSpec.preset("p3.16xlarge", num_nodes=1))
    assert len(_summed_warnings(record)) == 1
    assert any(SUMMED in w for w in plan.warnings)


@pytest.mark.parametrize("loss_fn, m", [(vae_loss_summed_kl, 1), (vae_loss_averaged, 2)],
                         ids=["summed, one micro-batch", "averaged, two micro-batches"])
def test_no_warning_without_micro_batches_or_for_a_mean(loss_fn, m):
    step = al.parallelize(_train_step(loss_fn), method=al.DataParallel(num_micro_batches=m))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        exe = step.get_executable(_params(), _batch(rows=16))
    assert not _summed_warnings(record)
    assert not any(SUMMED in w for w in exe.plan.warnings)
