"""Megatron-LM's tensor parallelism splits the work inside its parallel regions over ``t`` ranks and repeats
the work on the full hidden state on every rank: the classification of a traced layer's equations and what
the baseline's chunks cost with it."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import alpa_like as al
from alpa_like.bench import ours
from alpa_like.bench.megatron import HiddenState, LayerSeconds, repeated_on_every_rank, repeated_seconds
from alpa_like.bench.workloads import make_workload, transformer_costs
from alpa_like.compiler import jax_compat
from alpa_like.compiler.flops import ComputeRates, equation_seconds
from alpa_like.compiler.layer_slicing import BACKWARD, FORWARD

GPT_TINY = HiddenState(sequences=4, seq_len=16, hidden_size=32)
"""gpt-tiny (h 32, 4 heads, 4h 128, vocabulary 64) on micro-batches of 4 sequences of 16 tokens."""

LAYER_NORM = ["convert_element_type [4,16,32] -> [4,16,32]", "square [4,16,32] -> [4,16,32]",
              "reduce_sum [4,16,32] -> [4,16]", "div [4,16],[] -> [4,16]", "reduce_sum [4,16,32] -> [4,16]",
              "div [4,16],[] -> [4,16]", "square [4,16] -> [4,16]", "sub [4,16],[4,16] -> [4,16]",
              "max [],[4,16] -> [4,16]", "broadcast_in_dim [4,16] -> [4,16,1]",
              "broadcast_in_dim [4,16] -> [4,16,1]", "convert_element_type [4,16,32] -> [4,16,32]",
              "sub [4,16,32],[4,16,1] -> [4,16,32]", "add [4,16,1],[] -> [4,16,1]", "rsqrt [4,16,1] -> [4,16,1]",
              "reshape [32] -> [1,1,32]", "mul [4,16,1],[1,1,32] -> [4,16,32]",
              "mul [4,16,32],[4,16,32] -> [4,16,32]", "reshape [32] -> [1,1,32]",
              "add [4,16,32],[1,1,32] -> [4,16,32]", "convert_element_type [4,16,32] -> [4,16,32]"]
ROW_PARALLEL_BIAS = ["convert_element_type [32] -> [32]", "reshape [32] -> [1,1,32]",
                     "add [4,16,32],[1,1,32] -> [4,16,32]"]
RESIDUAL = ["add [4,16,32],[4,16,32] -> [4,16,32]"]


def _shapes(vars_) -> str:
    return ",".join("[" + ",".join(map(str, v.aval.shape)) + "]" for v in vars_ if hasattr(v, "aval"))


def _text(eqn) -> str:
    return f"{eqn.primitive.name} {_shapes(eqn.invars)} -> {_shapes(eqn.outvars)}"


def _leaves(eqns):
    for eqn in eqns:
        subs = jax_compat.nested_jaxprs(eqn)
        if subs:
            yield from _leaves(e for j in subs for e in j.eqns)
        else:
            yield eqn


@pytest.fixture(scope="module")
def sliced_gpt_tiny():
    workload = make_workload("gpt-tiny", 8)
    return workload, ours.slice_workload(workload, ours.pipeshard_method(workload, 2))


def _repeated(sliced, layer, phase):
    eqns = [e for e, p in zip(sliced.jaxpr.eqns, sliced.pieces) if p and (p.layer, p.phase) == (layer, phase)]
    return [_text(e) for e in _leaves(eqns) if repeated_on_every_rank(e, GPT_TINY)]


def test_a_gpt_layer_repeats_its_layernorms_residual_adds_and_row_parallel_biases(sliced_gpt_tiny):
    """gpt-tiny's middle layer is a block's MLP and the next block's attention: two LayerNorms, two
    row-parallel output biases, two residual adds; everything else (matmuls, column-parallel biases, GeLU, the
    heads' attention, the weights' casts) is split."""
    _, sliced = sliced_gpt_tiny
    block = LAYER_NORM + ROW_PARALLEL_BIAS + RESIDUAL
    assert _repeated(sliced, 1, FORWARD) == block + block


def test_the_backward_repeats_only_work_on_the_hidden_state(sliced_gpt_tiny):
    """The recomputed forward, then the gradients: LayerNorms' and biases' (reductions to ``[h]``), the
    residual's (``add_any``); never a matrix product or a tensor of the heads, the MLP's 4h or the vocabulary."""
    _, sliced = sliced_gpt_tiny
    repeated = _repeated(sliced, 1, BACKWARD)
    assert not any(r.startswith(("dot_general ", "conv_general_dilated ")) for r in repeated)
    assert not any(d in r for r in repeated for d in ("128", "96", "[4,4,", "64"))
    assert repeated.count("reduce_sum [4,16,32] -> [32]") == 6  # 2 x (LayerNorm scale, bias) + 2 output biases
    assert repeated.count("add_any [4,16,32],[4,16,32] -> [4,16,32]") >= 2  # the two residual branches


def test_the_embedding_and_the_logits_split_the_vocabulary_and_repeat_the_rest(sliced_gpt_tiny):
    _, sliced = sliced_gpt_tiny
    first, last = _repeated(sliced, 0, FORWARD), _repeated(sliced, 2, FORWARD)
    assert "gather [16,32],[4,16,1] -> [4,16,32]" in first  # the position table, whole on every rank
    assert "gather [64,32],[4,16,1] -> [4,16,32]" not in first  # VocabParallelEmbedding
    assert first[first.index("gather [16,32],[4,16,1] -> [4,16,32]") + 1] == "add [4,16,32],[4,16,32] -> [4,16,32]"
    assert not any("64" in r for r in last)  # the logits and the cross-entropy's softmax over the vocabulary
    assert last[:len(LAYER_NORM)] == LAYER_NORM


def test_repeated_seconds_of_a_hand_made_layer_in_closed_form():
    """``tanh((x * g + x) @ w)`` with the hidden state ``x`` [2, 4, 8]: the scale and the residual add (64
    FLOPs each) are repeated, the matrix product and the tanh on its [2, 4, 32] output are split."""
    x, g, w = jnp.zeros((2, 4, 8)), jnp.zeros((8,)), jnp.zeros((8, 32))
    jaxpr = jax.make_jaxpr(lambda x, g, w: jnp.tanh((x * g + x) @ w))(x, g, w).jaxpr
    hidden = HiddenState(sequences=2, seq_len=4, hidden_size=8)
    rates = ComputeRates(peak_flops=1e12)
    total = sum(equation_seconds(e, rates) for e in jaxpr.eqns)
    repeated = sum(repeated_seconds(e, rates, hidden) for e in jaxpr.eqns)
    assert repeated == pytest.approx(2 * 64 / 1e12, rel=1e-12)
    assert total - repeated == pytest.approx((2 * 2 * 4 * 32 * 8 + 2 * 4 * 32) / 1e12, rel=1e-12)
    nested = jax.make_jaxpr(jax.checkpoint(lambda x, g, w: jnp.tanh((x * g + x) @ w)))(x, g, w).jaxpr
    assert sum(repeated_seconds(e, rates, hidden) for e in nested.eqns) == pytest.approx(repeated, rel=1e-12)


def test_chunk_divides_the_split_part_and_adds_the_repeated_part_whole():
    seconds = LayerSeconds(forward=(1e-3, 2e-3), backward=(2e-3, 4e-3), apply=(1e-5, 1e-5),
                           forward_repeated=(3e-4, 1e-4), backward_repeated=(6e-4, 2e-4), apply_repeated=(1e-7, 0.0),
                           forward_fixed=(1e-4, 1e-4), backward_fixed=(2e-4, 2e-4), apply_fixed=(3e-6, 3e-6))
    assert seconds.chunk("forward", range(2), 4, 2) == pytest.approx(
        4 * (1e-3 / 2 + 3e-4) + 1e-4 + 4 * (2e-3 / 2 + 1e-4) + 1e-4, rel=1e-12)
    assert seconds.chunk("apply", [0], 1, 4) == pytest.approx(1e-5 / 4 + 1e-7 + 3e-6, rel=1e-12)
    with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1"):
        seconds.chunk("forward", [0], 1, 0)


def test_tensor_parallel_chunks_cost_at_least_the_evenly_split_step(sliced_gpt_tiny):
    """With ``t = 1`` a chunk costs what the compute model prices its equations at; with ``t > 1`` more than
    an even ``1/t`` of that, by the repeated work."""
    workload, sliced = sliced_gpt_tiny
    rates = al.ClusterSpec.preset("h200").compute_rates
    plain = dataclasses.replace(rates, matmul_overhead=0.0)
    seconds = transformer_costs(sliced, workload, 2, rates).seconds
    for phase, name in ((FORWARD, "forward"), (BACKWARD, "backward")):
        eqns = [e for e, p in zip(sliced.jaxpr.eqns, sliced.pieces) if p and p.phase == phase]
        scaled = sum(equation_seconds(e, plain) for e in eqns)
        fixed = sum(equation_seconds(e, rates) for e in eqns) - scaled
        assert seconds.chunk(name, range(2), 4, 1) == pytest.approx(scaled + fixed, rel=1e-12)
        for t in (2, 4):
            assert seconds.chunk(name, range(2), 4, t) > scaled / t + fixed
        assert 0 < sum(getattr(seconds, name + "_repeated")) < sum(getattr(seconds, name))


def test_hidden_state_rejects_bad_sizes():
    with pytest.raises(ValueError, match="HiddenState.seq_len must be an int >= 1"):
        HiddenState(sequences=1, seq_len=0, hidden_size=8)


def test_the_parameters_every_rank_holds_whole_are_the_layernorms_row_parallel_biases_and_position_table(
        sliced_gpt_tiny):
    """gpt-tiny (float32 parameters) folded into Megatron-LM's two layers: the first holds the position table
    ``[s, h]`` and block 0's attention (``ln_1``'s scale and bias, the output projection's bias); the second
    block 0's MLP (``ln_2``, ``fc_out``'s bias), block 1 and the final LayerNorm: 11 vectors of ``h``. Their
    optimizer state is the layer's in the same proportion."""
    workload, sliced = sliced_gpt_tiny
    s, h = workload.config.seq_len, workload.config.hidden_size
    costs = transformer_costs(sliced, workload, 2)
    assert costs.replicated_param_bytes == (4.0 * (s * h + 3 * h), 4.0 * 11 * h)
    for l in range(2):
        assert costs.replicated_optimizer_bytes[l] == pytest.approx(
            costs.optimizer_bytes[l] * costs.replicated_param_bytes[l] / costs.param_bytes[l], rel=1e-12)


def test_optimizer_bytes_are_adams_two_moments_per_parameter_without_the_tied_embedding(sliced_gpt_tiny):
    """gpt-tiny ties its word embedding ``[64, 32]`` (the first layer's parameter) to the logits of the last
    layer, whose apply phase reads it too. Each folded layer's optimizer bytes are Adam's two float32 moments
    of its own parameters plus its parameter share of the two int32 step counters (``TrainState.step`` and
    Adam's ``count``), with no parameter counted as optimizer state."""
    workload, sliced = sliced_gpt_tiny
    costs = transformer_costs(sliced, workload, 2)
    total_params = sum(costs.param_bytes)
    counters = 2 * 4
    for l in range(2):
        share = costs.param_bytes[l] / total_params
        assert costs.optimizer_bytes[l] == pytest.approx(2 * costs.param_bytes[l] + counters * share, rel=1e-12)
