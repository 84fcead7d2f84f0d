"""The reproductions' analytic costs and calibration."""
import json

import pytest

from alpa_like.bench import repro
from alpa_like.bench.flops import megatron_num_params, megatron_step_flops
from alpa_like.models import GPTConfig


def test_analytic_costs_sum_to_eq3_and_eq2():
    h, l, heads, s, v = 2304, 24, 24, 2048, 51200
    costs = repro.gpt_costs(hidden=h, layers=l, heads=heads, seq=s, vocab=v)
    per_sequence = sum(costs.forward_flops) + sum(costs.backward_flops)
    assert per_sequence * 512 == pytest.approx(
        megatron_step_flops(batch_size=512, seq_len=s, num_layers=l, hidden_size=h, vocab_size=v), rel=1e-12)
    params = sum(costs.param_bytes) / 2  # FP16
    assert params == pytest.approx(megatron_num_params(
        GPTConfig(vocab_size=v, seq_len=s, hidden_size=h, num_layers=l, num_heads=heads)), rel=1e-12)
    assert all(o == 6 * p for o, p in zip(costs.optimizer_bytes, costs.param_bytes))  # 12 of 16 bytes/param


def test_calibration_hits_its_row_and_is_monotone():
    row = repro.MEGATRON_TABLE_1[0]
    eff = repro._calibrate(lambda e: repro._table_1_tflops(row, e), row[-1])
    assert 0 < eff < 1
    assert repro._table_1_tflops(row, eff) == pytest.approx(row[-1], rel=1e-6)
    assert repro._table_1_tflops(row, eff / 2) < row[-1]


_EMPTY_RESULTS = {"megatron_table_1": {"efficiency": 0.5, "rows": []}, "interleaved_gain": {"paper": "", "rows": []},
                  "bfpp_table_e1": {"efficiency": 0.5, "rows": [], "headline": {}}, "alpa_stage_shapes": {}}


def test_wresnet_scaling_divides_saved_tflops(tmp_path):
    assert repro.wresnet_scaling(str(tmp_path)).startswith("no results")
    rows = [{"gpus": g, "ours": {"auto": {"tflops": t}}} for g, t in ((1, 15.0), (4, 14.0), (32, 12.0))]
    (tmp_path / "bench_wresnet.json").write_text(json.dumps({"rows": rows}))
    scaling = repro.wresnet_scaling(str(tmp_path))
    assert scaling["scaling"] == pytest.approx(0.8) and scaling["paper"] == 0.8
    assert "80.0% (12.00 TFLOP/s per GPU against 15.00" in "\n".join(repro.results_text(
        {**_EMPTY_RESULTS, "wresnet_scaling": scaling}))
    rows[2]["ours"]["auto"]["tflops"] = None  # no plan on 32 GPUs
    (tmp_path / "bench_wresnet.json").write_text(json.dumps({"rows": rows}))
    assert "1 and 32 GPUs" in repro.wresnet_scaling(str(tmp_path))
