"""examples/gpt_train.py: checkpoints every K steps and resumes; its timeline for a pipeline executable."""
import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import alpa_like as al

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gpt_train.py"


def run_example(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, str(EXAMPLE), "--model", "gpt-tiny", "--batch-size", "8", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def losses(output: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step\s+(\d+)\s+loss (\S+)", output, re.M)}


@pytest.mark.slow  # two runs of the script, each compiling the GPT step (~20 s apiece on 2 cores)
def test_saves_every_k_steps_and_resumes_where_it_stopped(tmp_path):
    first = run_example("--steps", "2", "--checkpoint-dir", str(tmp_path), "--save-every", "1")
    assert sorted(losses(first)) == [0, 1] and al.checkpoint_steps(tmp_path) == [1, 2]
    resumed = run_example("--steps", "3", "--checkpoint-dir", str(tmp_path), "--resume")
    assert f"resumed from {tmp_path} at step 2" in resumed
    assert sorted(losses(resumed)) == [2] and al.checkpoint_steps(tmp_path) == [1, 2, 3]
    assert al.restore_checkpoint(tmp_path)["step"] == 3


def test_timeline_of_an_executable_without_value_specs(tmp_path):
    """The Ray backend's executable has no value_specs (it receives values in the activation layout)."""
    from tests.runtime.test_pipeshard_runtime import TWO_STAGES, mlp_case, train_step_for
    spec = importlib.util.spec_from_file_location("gpt_train_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    loss_fn, state, batches = mlp_case()
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(), stage_option=TWO_STAGES)
    exe = al.parallelize(train_step_for(loss_fn), method=method).get_executable(state, batches[0])
    like_ray = types.SimpleNamespace(plan=exe.plan, program=exe.program, programs=exe.programs)
    example.write_timeline(like_ray, str(tmp_path / "timeline"))
    assert (tmp_path / "timeline.json").stat().st_size > 0
