"""Megatron-LM Eq. 2 (parameters) and Eq. 3 (FLOPs) against the values of the paper's Table 1."""
import pytest

from alpa_like.bench.flops import gpt_step_flops, megatron_num_params, megatron_step_flops, tflops_per_device
from alpa_like.models import GPTConfig

# Megatron-LM Table 1: (billions of parameters, heads, hidden, layers, GPUs, batch, TFLOP/s per GPU).
TABLE_1 = [
    (1.7, 24, 2304, 24, 32, 512, 137),
    (3.6, 32, 3072, 30, 64, 512, 138),
    (7.5, 32, 4096, 36, 128, 512, 142),
    (18.4, 48, 6144, 40, 256, 1024, 135),
    (39.1, 64, 8192, 48, 512, 1536, 138),
    (76.1, 80, 10240, 60, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 3072, 3072, 163),
]
# Iteration time F / (n X) implied by each row (seed notes, recomputed from the table with Eq. 3).
IMPLIED_SECONDS = [3.53, 3.70, 3.70, 9.40, 14.45, 16.06, 24.82, 37.61, 54.08, 102.6]
V, S = 51200, 2048


@pytest.mark.parametrize("row", TABLE_1)
def test_eq2_gives_table_1_parameter_counts(row):
    billions, heads, h, l = row[:4]
    config = GPTConfig(vocab_size=V, seq_len=S, hidden_size=h, num_layers=l, num_heads=heads)
    assert megatron_num_params(config) / 1e9 == pytest.approx(billions, abs=0.051)


@pytest.mark.parametrize("row,seconds", list(zip(TABLE_1, IMPLIED_SECONDS)))
def test_eq3_gives_the_iteration_times_implied_by_table_1(row, seconds):
    _, _, h, l, n, batch, tflops = row
    flops = megatron_step_flops(batch_size=batch, seq_len=S, num_layers=l, hidden_size=h, vocab_size=V)
    assert flops / (n * tflops * 1e12) == pytest.approx(seconds, rel=2e-3)
    assert tflops_per_device(flops, seconds, n) == pytest.approx(tflops, rel=2e-3)


def test_eq3_is_four_forwards_of_the_layers_plus_the_logits():
    b, s, l, h, v = 3, 512, 7, 640, 1000
    forward_per_layer = 24 * b * s * h**2 + 4 * b * s**2 * h
    expected = 4 * l * forward_per_layer + 6 * b * s * h * v
    assert megatron_step_flops(batch_size=b, seq_len=s, num_layers=l, hidden_size=h, vocab_size=v) == \
        pytest.approx(expected, rel=1e-12)
    without = gpt_step_flops(batch_size=b, seq_len=s, num_layers=l, hidden_size=h, vocab_size=v, recompute=False)
    assert without == pytest.approx(3 * l * forward_per_layer + 6 * b * s * h * v, rel=1e-12)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="hidden_size must be an int >= 1"):
        megatron_step_flops(batch_size=1, seq_len=8, num_layers=2, hidden_size=0, vocab_size=10)
    with pytest.raises(ValueError, match="step_seconds must be > 0"):
        tflops_per_device(1e12, 0.0, 8)
