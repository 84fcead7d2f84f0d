"""alpa-like: automatic parallelization of JAX training steps.

    import alpa_like as al

    @al.parallelize(method=al.DataParallel(num_micro_batches=2))
    def train_step(state, batch):
        grads = al.grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads)
"""
from alpa_like.api import ParallelizedFunc, init, parallelize, plan, shutdown
from alpa_like.checkpoint import checkpoint_steps, restore_checkpoint, save_checkpoint
from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.markers import mark_pipeline_boundary
from alpa_like.compiler.options import (AutoLayerOption, AutoShardingOption, AutoStageOption, CreateStateParallel,
                                        DataParallel, FollowParallel, ManualLayerOption, ManualShardParallel,
                                        ManualStageOption, PipeshardParallel, ShardParallel, UniformStageOption,
                                        Zero2Parallel, Zero3Parallel)
from alpa_like.compiler.plan import CommEstimate, ParallelPlan, StagePlan, TensorPlan
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.grad import grad, value_and_grad

__all__ = [
    "AutoLayerOption", "AutoStageOption", "ManualLayerOption", "ManualStageOption", "PipeshardParallel",
    "UniformStageOption",
    "AutoShardingOption", "ShardParallel",
    "ClusterSpec", "CommEstimate", "CreateStateParallel", "DataParallel", "FollowParallel", "ManualShardParallel",
    "ParallelPlan", "ParallelizedFunc", "ShardingSpec", "StagePlan", "TensorPlan", "Zero2Parallel", "Zero3Parallel",
    "grad", "init", "mark_pipeline_boundary", "parallelize", "plan", "shutdown", "value_and_grad",
    "checkpoint_steps", "restore_checkpoint", "save_checkpoint",
]
__version__ = "0.1.0"
