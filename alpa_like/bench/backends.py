"""Measured backends: run a plan on real devices and time the step; compare with the simulated prediction.

The interface is one function per backend, :data:`StepRunner`: ``runner(workload, method, steps) ->
Measurement``. ``local`` runs on the devices of this process (the 8 virtual CPU devices here); ``ray`` runs
the same code after ``al.init("ray")`` (the Ray backend runs pipeline plans) on a Ray cluster at an address,
or on a local cluster of :data:`LOCAL_RAY_NODES` Ray nodes it starts
(:class:`~alpa_like.runtime.ray_local_cluster.LocalCluster`).

Each measurement also carries the prediction for the same compiled plan: the instruction programs on the
simulated backend's clock (pipeline plans) or the SPMD plan's modelled time, both for
``ClusterSpec.local()`` (the measured speed of this machine's devices): this is the simulator-accuracy check
the suite reports per case.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
from flax.training import train_state

import alpa_like as al
from alpa_like import models
from alpa_like.bench.flops import gpt_step_flops
from alpa_like.bench.workloads import OPTIMIZERS, Workload, loss_train_step
from alpa_like.models import gpt, moe, wide_resnet

SCALED_CONFIGS = {
    "opt-125m-scaled": dataclasses.replace(models.get_config("opt-125m"), hidden_size=128, num_heads=2,
                                           num_layers=4, seq_len=128, vocab_size=1024),
}
"""The OPT family's smallest shape scaled to run on this machine's CPU devices: opt-125m's head size (64), 4x
MLP, pre-LN and learned positions, with width 768 -> 128, 12 -> 4 layers, sequence 2048 -> 128 and vocabulary
50,272 -> 1,024."""
LOCAL_MODELS = {"gpt": ("gpt-small", 32), "opt": ("opt-125m-scaled", 32), "moe": ("moe-tiny", 32),
                "wresnet": ("wresnet-tiny", 32)}
"""Per suite, the model and batch size that run on the 8 CPU devices (the suites' own sizes cannot)."""
LOCAL_RAY_NODES, LOCAL_RAY_DEVICES_PER_NODE = 2, 2
"""The local Ray cluster ``--backend ray`` starts when given no address: nodes, and CPU devices per node."""


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run this method (e.g. an SPMD method on the Ray backend)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurement:
    method: str
    measured_seconds: float
    """Median wall time of a step after warm-up."""
    predicted_seconds: float
    """The cost model's step time for the same plan on ``ClusterSpec.local()``."""
    step_flops: float
    num_devices: int
    num_nodes: int = 1
    dispatch: dict[str, float] | None = None
    """On the Ray backend: the fixed costs measured on its workers
    (:func:`~alpa_like.runtime.ray_dispatch.measure_dispatch_costs`), which ``predicted_seconds`` includes."""
    predicted_without_dispatch_seconds: float | None = None
    """On the Ray backend: the prediction without those costs (the devices' work and the bytes only)."""
    measured_seconds_by_kind: dict[str, float] | None = None
    """Pipeline plans: one profiled step's seconds per instruction kind (``RUN``, ``LOAD``, ``RECV``,
    ``MEAN``, ...), summed over the meshes, each instruction waited for."""
    predicted_seconds_by_kind: dict[str, float] | None = None
    """Pipeline plans: the simulator's seconds per instruction kind for the same plan (with ``dispatch``),
    summed over the meshes."""

    def summary(self) -> dict:
        return {"method": self.method, "measured_s": self.measured_seconds, "predicted_s": self.predicted_seconds,
                "predicted_without_dispatch_s": self.predicted_without_dispatch_seconds, "dispatch": self.dispatch,
                "num_nodes": self.num_nodes, "num_devices": self.num_devices,
                "predicted_over_measured": self.predicted_seconds / self.measured_seconds,
                "measured_s_by_kind": self.measured_seconds_by_kind,
                "predicted_s_by_kind": self.predicted_seconds_by_kind,
                "measured_tflops_per_device": self.step_flops / self.measured_seconds / self.num_devices / 1e12}


StepRunner = Callable[[Workload, object, int], Measurement]


def local_workload(suite: str) -> Workload:
    """The suite's small model with real arrays (``LOCAL_MODELS``), FP32, with its suite's optimizer."""
    name, batch_size = LOCAL_MODELS[suite]
    config = SCALED_CONFIGS[name] if name in SCALED_CONFIGS else models.get_config(name)
    key, data_key = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
    if isinstance(config, models.MoEConfig):
        tx = OPTIMIZERS["moe"]()
        batch = moe.moe_batch(config, batch_size, data_key)
        params = moe.MoEModel(config).init(key, batch["input_ids"])["params"]
        return Workload(name=name, family="moe", config=config, global_batch=batch_size,
                        train_step=loss_train_step(moe.moe_loss(moe.MoEModel(config))),
                        args=(train_state.TrainState.create(apply_fn=None, params=params, tx=tx), batch),
                        num_layers=config.num_layers, remat=False)
    if isinstance(config, models.GPTConfig):
        tx = OPTIMIZERS["gpt"]()
        batch = gpt.gpt_batch(config, batch_size, data_key)
        params = gpt.GPTModel(config).init(key, batch["input_ids"])["params"]
        return Workload(name=name, family="gpt", config=config, global_batch=batch_size,
                        train_step=loss_train_step(gpt.gpt_loss(gpt.GPTModel(config))),
                        args=(train_state.TrainState.create(apply_fn=None, params=params, tx=tx), batch),
                        num_layers=config.num_layers, remat=False)
    tx = OPTIMIZERS["wresnet"]()
    batch = wide_resnet.wresnet_batch(config, batch_size, data_key)
    variables = wide_resnet.WideResNet(config).init(key, batch["images"], train=False)
    state = {"train": train_state.TrainState.create(apply_fn=None, params=variables["params"], tx=tx),
             "batch_stats": variables.get("batch_stats", {})}
    loss_fn = wide_resnet.wresnet_loss(wide_resnet.WideResNet(config))

    def train_step(state, batch):
        (loss, new_stats), grads = al.value_and_grad(loss_fn, has_aux=True)(
            state["train"].params, state["batch_stats"], batch)
        return {"train": state["train"].apply_gradients(grads=grads), "batch_stats": new_stats}, loss

    return Workload(name=name, family="wresnet", config=config, global_batch=batch_size, train_step=train_step,
                    args=(state, batch), num_layers=sum(config.stage_sizes), remat=False)


def _simulation(exe, dispatch=None):
    """A pipeline executable's plan and programs on the simulated backend's clock (with a runtime's
    ``dispatch`` costs)."""
    from alpa_like.runtime.simulator import simulate
    return simulate(exe.plan, exe.program, exe.programs, value_specs=getattr(exe, "value_specs", None),
                    dispatch=dispatch)


def _seconds_by_kind(exe, args, simulated) -> tuple[dict[str, float], dict[str, float]]:
    """A pipeline executable's seconds per instruction kind, summed over its meshes: measured on one profiled
    step of ``args`` (``run(..., profile=True)``), and in its ``simulated`` step (:func:`_simulation`) with the
    RUN phases summed (``RUN F`` + ``RUN B`` + ``RUN A`` -> ``RUN``)."""
    exe.run(*args, profile=True)
    measured = dict(exe.last_step.op_seconds)
    predicted: dict[str, float] = {}
    for kind, seconds in simulated.seconds_by_kind.items():
        op = kind.split()[0]
        predicted[op] = predicted.get(op, 0.0) + seconds
    return measured, predicted


def _ray_dispatch(exe):
    """The Ray backend's fixed costs measured on the executable's first two workers (None for a local
    executable or one worker)."""
    workers = list(dict.fromkeys(getattr(exe, "workers", ())))
    if len(workers) < 2:
        return None
    from alpa_like.runtime.ray_dispatch import measure_dispatch_costs
    return measure_dispatch_costs(exe.cluster, workers[:2])


def _measure(workload: Workload, method, steps: int) -> Measurement:
    step = al.parallelize(workload.train_step, method=method)
    state, batch = workload.args
    exe = step.get_executable(state, batch)
    out = None
    for _ in range(2):  # compile and warm up
        state, out = step(state, batch)
    jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready((state, out))
        times.append(time.perf_counter() - start)
    flops = _step_flops(workload, exe)
    dispatch = _ray_dispatch(exe)
    if hasattr(exe, "programs"):  # a pipeline: the simulated step of its programs
        simulated = _simulation(exe, dispatch)
        predicted = simulated.step_seconds
        measured_by_kind, predicted_by_kind = _seconds_by_kind(exe, (state, batch), simulated)
    else:  # an SPMD method: the plan's modelled time
        predicted, measured_by_kind, predicted_by_kind = exe.plan.estimated_iteration_time, None, None
    return Measurement(method=type(method).__name__, measured_seconds=statistics.median(times),
                       predicted_seconds=predicted, step_flops=flops, num_devices=exe.plan.num_devices,
                       num_nodes=exe.plan.cluster.num_nodes,
                       dispatch=None if dispatch is None else dataclasses.asdict(dispatch),
                       predicted_without_dispatch_seconds=None if dispatch is None else _simulation(exe).step_seconds,
                       measured_seconds_by_kind=measured_by_kind, predicted_seconds_by_kind=predicted_by_kind)


def _step_flops(workload: Workload, exe) -> float:
    """Eq. 3 (without the recomputation term: these runs do not recompute) for GPT, the traced step otherwise."""
    c = workload.config
    if workload.family == "gpt":
        return gpt_step_flops(batch_size=workload.global_batch, seq_len=c.seq_len, num_layers=c.num_layers,
                              hidden_size=c.hidden_size, vocab_size=c.vocab_size, recompute=workload.remat)
    from alpa_like.compiler.flops import jaxpr_flops
    return float(jaxpr_flops(exe.traced.closed_jaxpr))


def run_local(workload: Workload, method, steps: int) -> Measurement:
    """Runs on the devices of this process (``al.init("local")``)."""
    al.init("local")
    return _measure(workload, method, steps)


def run_ray(workload: Workload, method, steps: int, address: str | None = None) -> Measurement:
    """Runs on the Ray cluster at ``address``, else on a local cluster of :data:`LOCAL_RAY_NODES` nodes with
    :data:`LOCAL_RAY_DEVICES_PER_NODE` CPU devices each, started for the run and stopped after; plans use every
    node. The Ray backend runs PipeshardParallel steps (an SPMD method there is a clear error)."""
    if not isinstance(method, al.PipeshardParallel):
        raise BackendUnavailable(f"--backend ray runs pipeline plans; {type(method).__name__} runs with "
                                 "--backend local")
    with contextlib.ExitStack() as stack:
        if address is None:
            from alpa_like.runtime.ray_local_cluster import LocalCluster
            address = stack.enter_context(LocalCluster(num_nodes=LOCAL_RAY_NODES,
                                                       num_cpus_per_node=LOCAL_RAY_DEVICES_PER_NODE)).address
        al.init("ray", address=address)
        try:
            return _measure(workload, method, steps)
        finally:
            al.shutdown()


BACKENDS: dict[str, StepRunner] = {"local": run_local, "ray": run_ray}


def measured_methods(workload: Workload) -> list:
    """What a measured row runs: our automatic pipeline plan beside data parallelism and ZeRO-2/3."""
    pipeshard = al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=workload.num_layers, eps=None),
        stage_option=al.AutoStageOption(show_progress=False))
    return [pipeshard, al.ShardParallel(), al.DataParallel(), al.Zero2Parallel(), al.Zero3Parallel()]
