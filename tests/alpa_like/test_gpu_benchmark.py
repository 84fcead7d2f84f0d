"""examples/benchmarks/gpu.py: runs without the optional packages, compiles each variant once, and runs a
method whose memory estimate exceeds the device's."""
import dataclasses
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

import alpa_like as al
from tests.test_optional_imports import OPTIONAL

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # the check and the timing compile 11 GPT steps (~40 s on 2 cores)
def test_runs_without_the_optional_packages_and_writes_every_number(tmp_path):
    out = tmp_path / "gpu.json"
    code = textwrap.dedent(f"""
        import runpy, sys
        for name in {OPTIONAL!r}:
            sys.modules[name] = None
        sys.argv = ["gpu.py", "--model", "gpt-tiny", "--check-model", "gpt-tiny", "--steps", "2",
                    "--rounds", "1", "--out", {str(out)!r}]
        runpy.run_path({str(SCRIPT)!r}, run_name="__main__")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["rows"]
    assert results["device"]["jax"] == jax.__version__
    assert [r["method"] for r in results["check"]] == list(
        ("DataParallel", "Zero2Parallel", "Zero3Parallel", "ShardParallel", "ManualShardParallel"))
    assert all(r["ok"] for r in results["check"])
    timing = {r["variant"]: r for r in results["timing"]}
    assert list(timing) == ["jax.jit", "DataParallel", "Zero2Parallel", "Zero3Parallel", "ShardParallel",
                            "ManualShardParallel"]
    for name, row in timing.items():
        assert "error" not in row and row["step_s"] > 0 and row["tflops_per_device"] > 0
        assert (name == "jax.jit") == ("predicted_step_s" not in row)
    assert "correctness: gpt-tiny" in done.stdout and "timing: gpt-tiny float16 batch 8" in done.stdout


def test_jit_compiles_once_although_the_state_passes_through_a_method(gpu):
    device = jax.devices()[0]
    _, loss_fn, params, batch = gpu.gpt_case("gpt-tiny", jax.numpy.float32, 8, device)
    state = gpu.sgd_state(params, 0.1, device)
    cluster = gpu.cluster_for([device])
    al.init("local", devices=[device])
    try:
        jit, state = gpu.first_step("jax.jit", loss_fn, state, batch, cluster, {})
        jit_layout = jax.tree.map(lambda x: x.sharding, state)
        method, state = gpu.first_step("DataParallel", loss_fn, state, batch, cluster, {})
        state, _ = jit(gpu.relayout(state, jit_layout), batch)
    finally:
        al.shutdown()
    assert jit._cache_size() == 1


def test_a_method_whose_estimate_exceeds_the_device_memory_runs_and_is_marked(gpu):
    device = jax.devices()[0]
    _, loss_fn, params, batch = gpu.gpt_case("gpt-tiny", jax.numpy.float32, 8, device)
    cluster = dataclasses.replace(gpu.cluster_for([device]), device_memory=1024)
    row = {}
    al.init("local", devices=[device])
    try:
        gpu.first_step("DataParallel", loss_fn, gpu.sgd_state(params, 0.1, device), batch, cluster, row)
    finally:
        al.shutdown()
    assert row["estimate_exceeds_device_memory"] and row["predicted_peak_memory_bytes"] > 1024
    assert row["predicted_step_s"] > 0 and row["compile_and_first_step_s"] > 0


@dataclasses.dataclass
class FakeGpu:
    device_kind: str
    platform: str = "gpu"

    def memory_stats(self):
        return {"bytes_limit": 70 * 2**30}


def test_the_cost_model_cluster_of_a_gpu_is_its_family_preset_with_the_memory_jax_may_use(gpu):
    spec = gpu.cluster_for([FakeGpu("NVIDIA H200")])
    assert (spec.name, spec.num_devices, spec.device_name) == ("h200", 1, "NVIDIA H200")
    assert spec.memory_bandwidth == al.ClusterSpec.preset("h200").memory_bandwidth and spec.device_memory == 70 * 2**30
    assert gpu.cluster_for([FakeGpu("NVIDIA H100 80GB HBM3")]).name == "h100"
    assert gpu.cluster_for([FakeGpu("NVIDIA A100-SXM4-80GB")] * 2).peak_flops == 312e12


def test_bad_arguments_name_the_flag(gpu, capsys):
    for argv, message in ((["--model", "gpt-nope"], "--model: unknown"), (["--check-model", "moe-tiny"],
                          "--check-model must name a GPT config"), (["--steps", "0"], "--steps must be >= 1")):
        with pytest.raises(SystemExit):
            gpu.parse_args(argv)
        assert message in capsys.readouterr().err
