"""A training run on the Ray backend: compiled from shapes, metrics usable together, donated state.

The tests use the session's local Ray (``ray_session``) and one 1 node x 4 device Ray backend for the module:
two meshes of two devices, one worker actor each.
"""
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like.runtime import ray_backend
from alpa_like.runtime.ray_backend import RemoteArray
from tests.helpers import assert_trees_close, reference_on_one_device, run_steps
from tests.runtime.test_pipeshard_runtime import mlp_case, mlp_loss, train_step_for
from tests.runtime.test_ray_backend import init_ray, method_for

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_backend_4(ray_session, tmp_path_factory):
    init_ray(str(tmp_path_factory.mktemp("xla_cache")))
    yield
    al.shutdown()


def sgd_case():
    """The 4-layer MLP of the pipeline runtime tests (a boundary after each layer) under plain SGD."""
    _, state, batches = mlp_case()
    tx = optax.sgd(0.1)
    return train_state.TrainState.create(apply_fn=None, params=state.params, tx=tx), batches


def step_with_metrics(state, batch):
    """Metrics made on different meshes: the loss on the last stage's, a weight norm on the first's."""
    loss, grads = al.value_and_grad(mlp_loss)(state.params, batch)
    state = state.apply_gradients(grads=grads)
    return state, {"loss": loss, "w0": jnp.sum(state.params["w0"] ** 2)}


def shapes_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


METHOD = method_for("2_meshes", manual=True)


def test_executable_from_shapes_runs_on_arrays(ray_backend_4):
    state, batches = sgd_case()
    step = al.parallelize(step_with_metrics, method=METHOD)
    exe = step.get_executable(shapes_of(state), shapes_of(batches[0]))
    assert step.get_executable(state, batches[0]) is exe  # the same signature: one compilation
    result, _ = run_steps(exe, state, batches[:2])
    expected, _ = reference_on_one_device(step_with_metrics, state, batches[:2])
    assert_trees_close(result.params, expected.params)
    with pytest.raises(TypeError, match=r"argument leaf batch\.x is a jax\.ShapeDtypeStruct: running a step "
                                        r"needs arrays"):
        exe(state, {**batches[0], "x": jax.ShapeDtypeStruct((32, 16), jnp.float32)})


def test_metrics_of_one_step_combine_on_the_driver(ray_backend_4):
    """Metrics made on different meshes come back as NumPy arrays in the step's reports (one call per
    worker); the state stays on the workers."""
    state, batches = sgd_case()
    step = al.parallelize(step_with_metrics, method=METHOD)
    result, metrics = run_steps(step, state, batches[:2])
    expected, expected_metrics = reference_on_one_device(step_with_metrics, state, batches[:2])
    exe = step.get_executable(result, batches[0])
    assert exe.last_step.driver_calls == len(exe.workers) == 2
    assert all(isinstance(m, np.ndarray) for m in jax.tree.leaves(metrics[-1]))
    assert all(isinstance(x, RemoteArray) for x in jax.tree.leaves(result))
    np.testing.assert_allclose(metrics[-1]["loss"] / metrics[-1]["w0"],
                               expected_metrics[-1]["loss"] / expected_metrics[-1]["w0"], rtol=1e-5)
    assert_trees_close(result.params, expected.params)
    assert held_handles(exe, len(jax.tree.leaves(result))) == len(jax.tree.leaves(result))  # none for a metric


def held_handles(exe, expected: int) -> int:
    """How many arrays the workers hold once the driver's dropped handles are freed (``expected``: the count
    to wait for, 30 s at most)."""
    exe.cluster.flush_frees()
    deadline = time.monotonic() + 30
    while (held := sum(exe.worker_handles())) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return held


def test_donated_state_is_consumed_on_its_workers(ray_backend_4):
    state, batches = sgd_case()
    batches = batches[:3]
    keeping = al.parallelize(step_with_metrics, method=METHOD)
    donating = al.parallelize(step_with_metrics, method=METHOD, donate_argnums=(0,))
    kept, kept_metrics = run_steps(keeping, state, batches)
    assert keeping.get_executable(kept, batches[0]).last_step.donated_buffers == 0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*donate_argnums.*")
        state = donating(state, batches[0])[0]  # a driver array is copied to the workers: it stays valid
    old = state
    exe = donating.get_executable(state, batches[1])
    held = sum(exe.worker_handles())
    state, _ = donating(state, batches[1])
    donated = exe.last_step.donated_buffers
    assert donated >= len(jax.tree.leaves(old.params))
    # the workers dropped the donated inputs' handles: they hold the new state, not the old one too
    assert sum(exe.worker_handles()) <= held + len(jax.tree.leaves(state)) - donated
    w0 = old.params["w0"]
    with pytest.raises(RuntimeError, match="donated"):
        np.asarray(w0)
    with pytest.raises(ValueError, match=r"argument leaf state\.\S+ is a RemoteArray donated to an earlier step"):
        donating(old, batches[2])
    state, metrics = donating(state, batches[2])
    assert_trees_close(state.params, kept.params, rtol=0, atol=0)
    assert_trees_close(state.opt_state, kept.opt_state, rtol=0, atol=0)
    assert_trees_close(metrics, kept_metrics[-1], rtol=0, atol=0)


def test_a_failed_check_after_starting_ray_shuts_it_down(monkeypatch):
    """A RayCluster whose checks fail after it started (or connected) Ray leaves no Ray running."""
    ray = pytest.importorskip("ray")
    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append("init"))
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeID": n, "Resources": {"CPU": 1.0}} for n in "ab"])
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray_backend, "start_local_ray", lambda **kwargs: calls.append("start"))
    for address in ("127.0.0.1:6379", None):
        calls.clear()
        with pytest.raises(ValueError, match="num_nodes=3, but the Ray cluster has 2 alive nodes"):
            ray_backend.RayCluster(address=address, num_nodes=3)
        assert calls == ["init" if address else "start", "shutdown"]


def test_the_new_state_is_stored_in_the_layout_the_next_step_loads(ray_backend_4):
    """The pieces that write the new state make each leaf in the layout its mesh's LOAD puts it in, so the
    next step takes every state leaf as it is (and donation reuses its buffers)."""
    _, state, batches = mlp_case()
    step = al.parallelize(train_step_for(mlp_loss), method=METHOD, donate_argnums=(0,))
    result, losses = run_steps(step, state, batches)
    exe = step.get_executable(result, batches[0])
    assert exe.last_step.inputs_by_kind["handle"] >= len(jax.tree.leaves(state))  # the state came as handles
    assert exe.last_step.input_relayouts == 0
    assert exe.last_step.donated_buffers >= len(jax.tree.leaves(state.params))
    expected, expected_losses = reference_on_one_device(train_step_for(mlp_loss), state, batches)
    assert_trees_close(result.params, expected.params)
    assert_trees_close(result.opt_state, expected.opt_state)
    assert_trees_close(losses, expected_losses)


def _span_starts(instructions):
    """The instructions a profiled step times, in order: a RUN takes in the ACC and FREE instructions right
    after it, a MEAN the MEANs right after it."""
    from alpa_like.runtime.instructions import Op
    takes_in = {Op.RUN: {Op.ACC, Op.FREE}, Op.MEAN: {Op.MEAN}}
    starts, absorbed = [], set()
    for ins in instructions:
        if ins.op not in absorbed:
            starts.append(ins)
            absorbed = takes_in.get(ins.op, set())
    return starts


def test_a_profiled_step_times_every_instruction_on_its_worker(ray_backend_4):
    """``run(..., profile=True)``: each worker times each instruction of its program in order (spans that do
    not overlap, inside its step), the kinds' sums are ``op_seconds``, and the step computes what it computes
    unprofiled; an unprofiled step reports no spans."""
    state, batches = sgd_case()
    step = al.parallelize(step_with_metrics, method=METHOD)
    exe = step.get_executable(state, batches[0])
    plain_state, plain_metrics = exe.run(state, batches[0])
    assert exe.last_step.spans == [] and exe.last_step.op_seconds == {}
    profiled_state, profiled_metrics = exe.run(state, batches[0], profile=True)
    stats = exe.last_step
    for mesh in range(len(exe.workers)):
        spans = [(text, begin, end) for m, text, begin, end in stats.spans if m == mesh]
        assert [text for text, _, _ in spans] == [str(ins) for ins in _span_starts(exe.programs.program(mesh))]
        bounds = [t for _, begin, end in spans for t in (begin, end)]
        assert bounds == sorted(bounds) and bounds[0] >= 0 and bounds[-1] <= stats.worker_seconds[mesh]
    kinds = {text.split()[0] for _, text, _, _ in stats.spans}
    assert set(stats.op_seconds) == kinds and {"RUN", "LOAD", "RECV"} <= kinds
    assert sum(stats.op_seconds.values()) == pytest.approx(sum(end - begin for _, _, begin, end in stats.spans))
    assert_trees_close(profiled_state.params, plain_state.params, rtol=0, atol=0)
    assert_trees_close(profiled_metrics, plain_metrics, rtol=0, atol=0)
