"""Checkpoint speed: save and restore seconds and GB/s of a GPT training state, on the local and Ray backends.

For each model the state (parameters and Adam's two moments, float32, every leaf filled with random values,
which compress as a trained state's do) is

* local: sharded over the 8 CPU devices of this process as ZeRO-3 lays it out (each leaf's largest dim split
  8 ways); ``al.save_checkpoint`` writes it (each device its shards), ``al.restore_checkpoint`` reads it into
  another plan's layouts: a 2-stage pipeline's (two meshes of 4 devices), as its first step takes it;
* ray: the same pipeline on a local Ray (one worker actor per mesh, 4 CPU devices each); the state lives on
  the workers as ``RemoteArray`` s, each worker writes the leaves it holds and reads back those its mesh loads.

Each row is the median of ``--repeats`` rounds (a save into a new step directory, then a restore of it); the
restore reads files the save has just written (in the page cache). GB/s is the state's bytes (1e9 per GB) over
the seconds. A save returns when its step directory is committed (``async_save=False``).

    python examples/benchmarks/checkpoint.py --out results/checkpoint.json
"""
import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from _common import use_cpu_devices, write_results  # noqa: E402

use_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import alpa_like as al  # noqa: E402
from alpa_like import models  # noqa: E402
from alpa_like.compiler.spmd_layout import largest_dim_spec  # noqa: E402
from alpa_like.models import gpt  # noqa: E402
from alpa_like.runtime.mesh import make_mesh, named_sharding  # noqa: E402

MODELS = ("gpt-small", "opt-125m")
BATCH_SIZE = 2  # only the step's signature: nothing is trained


def state_shapes(model, batch):
    """The training state's shapes (nothing allocated)."""
    def create():
        params = model.init(jax.random.PRNGKey(0), batch["input_ids"])["params"]
        return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    return jax.eval_shape(create)


def random_state(shapes, devices):
    """A state of ``shapes`` with random values, each leaf laid out as ZeRO-3 does on ``devices``."""
    mesh = make_mesh(devices, (len(devices),), ("x",))
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    out = []
    for k, leaf in enumerate(leaves):
        sharding = named_sharding(mesh, largest_dim_spec(leaf.shape, len(devices)))
        if np.issubdtype(leaf.dtype, np.floating):
            make = jax.jit(lambda key, s=leaf: 0.02 * jax.random.normal(key, s.shape, s.dtype), out_shardings=sharding)
            out.append(make(jax.random.PRNGKey(k)))
        else:
            out.append(jax.device_put(np.zeros(leaf.shape, leaf.dtype), sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def pipeline_step(model):
    """The GPT step as a 2-stage pipeline (its executable is what a restore reads into)."""
    loss_fn = gpt.gpt_loss(model)

    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2))
    return al.parallelize(train_step, method=method)


def ready(tree):
    """Waits for the jax arrays of ``tree`` (a Ray restore has returned once its workers have read)."""
    jax.block_until_ready([x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)])
    return tree


def rounds(state, like, directory: Path, repeats: int, first_step: int = 0) -> tuple[list, list]:
    """``repeats`` rounds of save then restore into ``like``; the seconds of each."""
    saves, restores = [], []
    for r in range(first_step, first_step + repeats):
        start = time.perf_counter()
        al.save_checkpoint(directory, state, r)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        restored = ready(al.restore_checkpoint(directory, like=like, step=r))
        restores.append(time.perf_counter() - start)
        del restored
        shutil.rmtree(directory / f"step_{r}")
    return saves, restores


def row(name: str, backend: str, nbytes: int, saves: list, restores: list, into: str) -> dict:
    save, restore = statistics.median(saves), statistics.median(restores)
    return {"model": name, "backend": backend, "state_bytes": nbytes, "save_s": save, "save_gb_s": nbytes / 1e9 / save,
            "restore_s": restore, "restore_gb_s": nbytes / 1e9 / restore, "restore_into": into,
            "repeats": len(saves)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma separated names from alpa_like.models")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--out", default="results/checkpoint.json")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint-bench-"))
    rows = []
    try:
        for name in args.models.split(","):
            config = models.get_config(name)
            model = gpt.GPTModel(config)
            batch = gpt.gpt_batch(config, BATCH_SIZE, jax.random.PRNGKey(1))
            shapes = state_shapes(model, batch)
            al.init("local")
            state = random_state(shapes, jax.devices())
            nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
            print(f"{name}: state {nbytes / 1e9:.3f} GB ({len(jax.tree_util.tree_leaves(state))} arrays)", flush=True)
            local_exe = pipeline_step(model).get_executable(shapes, batch)
            meshes = " + ".join(str(s.submesh_shape) for s in local_exe.plan.stages)
            local = rounds(state, local_exe, work / name / "local", args.repeats)
            rows.append(row(name, "local", nbytes, *local, into=f"pipeline {meshes}"))

            al.init(cluster="ray", num_nodes=1, num_devices_per_node=len(jax.devices()))
            ray_exe = pipeline_step(model).get_executable(shapes, batch)
            al.save_checkpoint(work / name / "seed", state, 0)
            del state
            on_workers = ready(al.restore_checkpoint(work / name / "seed", like=ray_exe))  # also warms the workers up
            shutil.rmtree(work / name / "seed")
            ray = rounds(on_workers, ray_exe, work / name / "ray", args.repeats)
            rows.append(row(name, "ray", nbytes, *ray, into=f"pipeline {meshes}, one worker per mesh"))
            del on_workers
            al.shutdown()
    finally:
        al.shutdown()
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'model':10} {'backend':8} {'state GB':>9} {'save s':>8} {'save GB/s':>10} {'restore s':>10} "
          f"{'restore GB/s':>13}  restored into")
    for r in rows:
        print(f"{r['model']:10} {r['backend']:8} {r['state_bytes'] / 1e9:9.3f} {r['save_s']:8.3f} "
              f"{r['save_gb_s']:10.3f} {r['restore_s']:10.3f} {r['restore_gb_s']:13.3f}  {r['restore_into']}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
