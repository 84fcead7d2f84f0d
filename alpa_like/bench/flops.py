"""FLOPs and TFLOP/s of the benchmark rows: Megatron-LM's analytic formulas (seed 002).

Every GPT/OPT row of the suite reports throughput as Alpa's benchmark does: the FLOPs of Megatron-LM
Eq. 3 (activation recomputation included, so the forward counts twice) divided by the step time and the
number of devices. The same formula is used for our plan and for every baseline, so a TFLOP/s ratio is a
step-time ratio.
"""
from __future__ import annotations

from alpa_like.models.gpt import megatron_num_params

__all__ = ["gpt_step_flops", "megatron_num_params", "megatron_step_flops", "tflops_per_device"]


def megatron_step_flops(*, batch_size: int, seq_len: int, num_layers: int, hidden_size: int,
                        vocab_size: int) -> float:
    r"""FLOPs of one training step of a GPT with activation recomputation (Megatron-LM Eq. 3).

    .. math:: F = 96 B s l h^2 \left(1 + \frac{s}{6h} + \frac{V}{16 l h}\right)

    It is 4x the forward pass (backward 2x, recomputation 1x) of ``24 B s h^2 + 4 B s^2 h`` per layer,
    plus ``6 B s h V`` for the logits (forward and backward, not recomputed).

    >>> round(megatron_step_flops(batch_size=1, seq_len=2048, num_layers=96, hidden_size=12288,
    ...                           vocab_size=51200) / 1e15, 1)
    2.9
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("num_layers", num_layers),
                        ("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"megatron_step_flops: {name} must be an int >= 1, got {value!r}")
    b, s, l, h, v = batch_size, seq_len, num_layers, hidden_size, vocab_size
    return 96.0 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))


def tflops_per_device(flops: float, step_seconds: float, num_devices: int) -> float:
    """``flops / (step_seconds * num_devices) / 1e12``: Alpa's and Megatron-LM's TFLOP/s per GPU."""
    if not step_seconds > 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds!r}")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")
    return flops / (step_seconds * num_devices) / 1e12


def gpt_step_flops(*, batch_size: int, seq_len: int, num_layers: int, hidden_size: int, vocab_size: int,
                   recompute: bool = True) -> float:
    """Eq. 3 with recomputation; without it the forward runs once, so the layers count 3x the forward
    instead of 4x (the logits term is unchanged), as Alpa's benchmark does with its checkpoint factor.

    >>> f = dict(batch_size=8, seq_len=1024, num_layers=24, hidden_size=1024, vocab_size=51200)
    >>> gpt_step_flops(**f) == megatron_step_flops(**f)
    True
    """
    full = megatron_step_flops(batch_size=batch_size, seq_len=seq_len, num_layers=num_layers,
                               hidden_size=hidden_size, vocab_size=vocab_size)
    if recompute:
        return full
    logits = 6.0 * batch_size * seq_len * hidden_size * vocab_size
    return (full - logits) * 3 / 4 + logits
