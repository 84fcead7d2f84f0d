"""Reference executors the pipelined runtimes are tested against (test-only: no runtime runs these)."""
from __future__ import annotations

from collections.abc import Sequence

from alpa_like.compiler import jax_compat
from alpa_like.compiler.grad_accumulation import to_micro_batches
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD
from alpa_like.compiler.micro_batch_keys import fold_micro_batch_index
from alpa_like.compiler.stage_construction import StagePiece, StageProgram, apply_order, micro_batch_key_draws


def run_sequentially(program: StageProgram, flat_inputs: Sequence, num_micro_batches: int) -> list:
    """Runs ``program`` on the current default device in GPipe order: all forwards, all backwards, the mean
    of the accumulated values, then every apply; returns the step's flat outputs."""
    env: dict = dict(program.constants)
    for i, x in zip(program.step_inputs, flat_inputs, strict=True):
        env[i] = x
    micro = {i: to_micro_batches(env[i], num_micro_batches) for i in program.batch_inputs}
    per_mb: list[dict] = []
    draws = micro_batch_key_draws(program, num_micro_batches)
    for mb in range(num_micro_batches):
        local = dict(env)
        local.update({i: x[mb] for i, x in micro.items()})
        for phase in (FORWARD, BACKWARD):
            order = range(program.num_stages) if phase == FORWARD else reversed(range(program.num_stages))
            for q in order:
                _run_piece(program.piece(q, phase), local, fold_micro_batch_index(draws.get((q, phase), ()), mb))
        per_mb.append(local)
    for src, dst in program.accumulated:
        env[dst] = sum(m[src] for m in per_mb) / num_micro_batches
    for q in apply_order(program):
        _run_piece(program.piece(q, APPLY), env)
    return [program.literal_outputs[k] if v is None else env[v] for k, v in enumerate(program.step_outputs)]


def _run_piece(piece: StagePiece, env: dict, operand_hook: jax_compat.EqnHook | None = None) -> None:
    """Evaluates ``piece`` on the values of ``env`` and stores its outputs there."""
    outs = jax_compat.eval_closed_jaxpr(piece.jaxpr, *[env[i] for i in piece.inputs], operand_hook=operand_hook)
    env.update(zip(piece.outputs, outs, strict=True))
