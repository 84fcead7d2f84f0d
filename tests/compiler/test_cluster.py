"""ClusterSpec: presets with sourced numbers, validation, JSON round trip, the measured local cluster."""
import dataclasses
import doctest
import json

import jax
import pytest

from alpa_like.compiler import cluster as cluster_module
from alpa_like.compiler.cluster import ClusterSpec

GIB = 2**30

# Public fields: adding one is an API change (and needs a docstring with units).
FIELDS = ("name", "num_nodes", "num_devices_per_node", "device_name", "peak_flops", "device_memory",
          "intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency", "inter_node_latency",
          "shared_host_compute", "memory_bandwidth", "fp32_peak_flops", "launch_overhead", "matmul_efficiency",
          "matmul_overhead", "fused_traffic", "measured_at")

PRESETS = {
    # name: (device_name, peak_flops, fp32_peak_flops, device_memory, intra bytes/s, inter bytes/s per device)
    "p3.16xlarge": ("V100-SXM2-16GB", 125e12, 15.7e12, 16 * GIB, 150e9, 25e9 / 8 / 8),
    "dgx-a100": ("A100-SXM4-80GB", 312e12, 156e12, 80 * GIB, 300e9, 200e9 / 8),
    "h100": ("H100-SXM5-80GB", 989e12, 494.5e12, 80 * GIB, 450e9, 400e9 / 8),
    "h200": ("H200-SXM-141GB", 989e12, 494.5e12, 140 * GIB, 450e9, 400e9 / 8),
}
DATASHEET_MEMORY_BANDWIDTH = {"p3.16xlarge": 900e9, "dgx-a100": 2.039e12, "h100": 3.35e12, "h200": 4.8e12}


def _spec(**overrides):
    return dataclasses.replace(ClusterSpec.preset("p3.16xlarge"), **overrides)


def test_field_set_is_frozen():
    assert tuple(f.name for f in dataclasses.fields(ClusterSpec)) == FIELDS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_values(name):
    device_name, flops, fp32_flops, memory, intra, inter = PRESETS[name]
    spec = ClusterSpec.preset(name, num_nodes=4)
    assert (spec.name, spec.num_nodes, spec.num_devices_per_node, spec.num_devices) == (name, 4, 8, 32)
    assert (spec.device_name, spec.device_memory) == (device_name, memory)
    assert spec.peak_flops == pytest.approx(flops)
    assert spec.fp32_peak_flops == pytest.approx(fp32_flops)
    assert spec.compute_rates.fp32_peak_flops == spec.fp32_peak_flops < spec.compute_rates.peak_flops
    assert spec.intra_node_bandwidth == pytest.approx(intra)
    assert spec.inter_node_bandwidth == pytest.approx(inter)
    assert spec.inter_node_bandwidth < spec.intra_node_bandwidth
    assert 0 < spec.intra_node_latency <= spec.inter_node_latency


def test_alpa_testbed_has_64_devices():
    assert ClusterSpec.preset("p3.16xlarge", num_nodes=8).num_devices == 64
    assert ClusterSpec.preset("p3.16xlarge").num_nodes == 1


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown cluster preset 'tpu'.*dgx-a100.*h100.*p3\.16xlarge"):
        ClusterSpec.preset("tpu")


@pytest.mark.parametrize("num_nodes", [0, -1, 1.5, True])
def test_preset_rejects_bad_num_nodes(num_nodes):
    with pytest.raises(ValueError, match="num_nodes"):
        ClusterSpec.preset("h100", num_nodes=num_nodes)


@pytest.mark.parametrize("field, value", [
    ("num_nodes", 0), ("num_devices_per_node", 0), ("device_memory", -1), ("peak_flops", 0.0),
    ("intra_node_bandwidth", -1.0), ("inter_node_bandwidth", float("nan")), ("intra_node_latency", -1e-6),
    ("inter_node_latency", "1us"), ("name", ""), ("memory_bandwidth", 0.0), ("memory_bandwidth", "fast"),
    ("fp32_peak_flops", 0.0), ("fp32_peak_flops", True),
    ("launch_overhead", -1e-6), ("matmul_overhead", -1e-6), ("matmul_efficiency", 0.0),
    ("matmul_efficiency", 1.5), ("fused_traffic", 0.0), ("fused_traffic", 2.0),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        _spec(**{field: value})


def test_frozen_and_keyword_only():
    spec = ClusterSpec.preset("dgx-a100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_nodes = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        ClusterSpec(*spec.to_dict().values())  # type: ignore[misc]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_round_trip_through_json(name):
    spec = ClusterSpec.preset(name, num_nodes=2)
    data = json.loads(json.dumps(spec.to_dict()))
    assert ClusterSpec.from_dict(data) == spec
    assert tuple(data) == FIELDS


def test_from_dict_rejects_unknown_and_missing_keys():
    data = ClusterSpec.preset("h100").to_dict()
    with pytest.raises(ValueError, match=r"unknown keys \['gpus'\], missing keys \[\]"):
        ClusterSpec.from_dict({**data, "gpus": 8})
    del data["peak_flops"]
    with pytest.raises(ValueError, match=r"missing keys \['peak_flops'\]"):
        ClusterSpec.from_dict(data)
    data = ClusterSpec.preset("p3.16xlarge").to_dict()
    del data["shared_host_compute"]  # a JSON file from before the field existed: the default applies
    assert ClusterSpec.from_dict(data) == ClusterSpec.preset("p3.16xlarge")


def test_str_is_one_readable_line():
    text = str(ClusterSpec.preset("p3.16xlarge", num_nodes=8))
    assert "\n" not in text
    assert text.startswith("p3.16xlarge: 8 node(s) x 8 V100-SXM2-16GB (125 TFLOP/s, 16 GiB each)")
    assert "intra-node 150 GB/s" in text and "inter-node 0.3906 GB/s" in text


def test_local_measures_this_process():
    spec = ClusterSpec.local()
    assert (spec.num_nodes, spec.num_devices_per_node) == (1, len(jax.local_devices()))
    assert spec.name == "local-cpu"
    assert spec.peak_flops > 0 and spec.intra_node_bandwidth > 0 and spec.device_memory > 0
    assert spec.shared_host_compute  # virtual CPU devices share the host's cores
    assert not ClusterSpec.preset("p3.16xlarge").shared_host_compute
    assert spec.inter_node_bandwidth == spec.intra_node_bandwidth
    assert ClusterSpec.local() == spec  # measurements are cached per device
    assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_local_with_a_device_subset():
    one = ClusterSpec.local(jax.local_devices()[:1])
    assert one.num_devices == 1 and one.intra_node_bandwidth > 0
    assert ClusterSpec.local(jax.local_devices()[:2]).num_devices == 2
    with pytest.raises(ValueError, match="devices"):
        ClusterSpec.local([])


def test_local_is_stored_and_read_back_by_a_new_process(tmp_path, monkeypatch):
    """A measured cluster is kept per machine: a fresh process (here: the in-process memo and the
    measurements' caches cleared) reads the same spec back instead of measuring again, so plans made
    from it do not move from run to run; ``remeasure=True`` measures again and replaces it."""
    monkeypatch.setenv("ALPA_LIKE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cluster_module, "_stored", {})
    devices = tuple(jax.local_devices()[:2])
    first = ClusterSpec.local(devices)
    assert first.measured_at is not None and first.measured_at.endswith("Z")
    assert f"measured {first.measured_at}" in str(first)
    [stored] = (tmp_path / "clusters").iterdir()
    assert ClusterSpec.load(stored) == first

    measured = []
    monkeypatch.setattr(cluster_module, "_stored", {})
    monkeypatch.setattr(ClusterSpec, "_measure", classmethod(lambda cls, d: measured.append(d) or first))
    assert ClusterSpec.local(devices) == first and not measured  # read back, not measured
    other = dataclasses.replace(first, peak_flops=first.peak_flops * 2)
    monkeypatch.setattr(ClusterSpec, "_measure", classmethod(lambda cls, d: measured.append(d) or other))
    assert ClusterSpec.local(devices, remeasure=True) == other and measured == [devices]
    monkeypatch.setattr(cluster_module, "_stored", {})
    assert ClusterSpec.local(devices) == other  # the new measurement replaced the stored one


def test_a_damaged_stored_cluster_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("ALPA_LIKE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cluster_module, "_stored", {})
    devices = tuple(jax.local_devices()[:1])
    path = cluster_module._local_cache_path(devices)
    (tmp_path / "clusters").mkdir()
    with open(path, "w") as f:
        f.write('{"name": "local-cpu", "num_nodes": "x"')
    spec = ClusterSpec.local(devices)
    assert spec.num_devices == 1 and ClusterSpec.load(path) == spec


def test_save_and_load(tmp_path):
    spec = ClusterSpec.preset("dgx-a100", num_nodes=2)
    spec.save(tmp_path / "c.json")
    assert ClusterSpec.load(tmp_path / "c.json") == spec
    assert ClusterSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="cannot read"):
        ClusterSpec.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not a saved ClusterSpec: .*expected a JSON object"):
        ClusterSpec.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="missing keys"):
        ClusterSpec.load(tmp_path / "bad.json")


def test_doctests():
    assert doctest.testmod(cluster_module).failed == 0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_gpu_presets_price_compute_with_the_fitted_gpu_model(name):
    spec = ClusterSpec.preset(name)
    model = cluster_module.GPU_COMPUTE_MODEL
    assert spec.memory_bandwidth == pytest.approx(DATASHEET_MEMORY_BANDWIDTH[name] * cluster_module.GPU_BANDWIDTH_SHARE)
    assert (spec.matmul_efficiency, spec.matmul_overhead, spec.fused_traffic, spec.launch_overhead) == (
        model["matmul_efficiency"], model["matmul_overhead"], model["fused_traffic"], model["launch_overhead"])
    rates = spec.compute_rates
    assert (rates.matmul_efficiency, rates.matmul_overhead, rates.fused_traffic) == (
        spec.matmul_efficiency, spec.matmul_overhead, spec.fused_traffic)


def test_the_gpu_model_is_the_fit_of_the_committed_measurements():
    """The presets' constants are what examples/benchmarks/gpu_cost_fit.py wrote from the H200 data (to the
    three significant digits the constants keep)."""
    from pathlib import Path
    fit = json.loads((Path(__file__).parents[2] / "examples/benchmarks/data/h200/gpu_cost_fit.json").read_text())
    fit = fit["rows"]
    model = cluster_module.GPU_COMPUTE_MODEL
    for key in ("matmul_efficiency", "matmul_overhead", "fused_traffic", "launch_overhead"):
        assert model[key] == pytest.approx(fit[key], rel=5e-3), key
    assert cluster_module.GPU_BANDWIDTH_SHARE * 4.8e12 == pytest.approx(fit["bandwidth"], rel=5e-3)
    assert fit["max_held_out_error"] < 0.15


def test_local_measures_memory_bandwidth_and_launch_overhead():
    spec = ClusterSpec.local()
    assert spec.memory_bandwidth is not None and 1e7 < spec.memory_bandwidth < 1e13
    assert 0.0 < spec.launch_overhead < 1.0
    assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
