"""References the tests check the compiler and the runtimes against (test-only: nothing else runs these):
the stage DP's brute force and a GPipe-order executor of stage programs."""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from alpa_like.compiler import jax_compat
from alpa_like.compiler.grad_accumulation import to_micro_batches
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD
from alpa_like.compiler.micro_batch_keys import fold_micro_batch_index
from alpa_like.compiler.indices import SubmeshIdx
from alpa_like.compiler.schedules import ScheduleName, schedule_name
from alpa_like.compiler.stage_construction import StagePiece, StageProgram, apply_order, micro_batch_key_draws
from alpa_like.compiler.stage_costs import StageChoice, StageCosts, StageSolution, pipeline_latency
from alpa_like.compiler.stage_dp import aligned_plans_only, micro_batches_in_flight
from alpa_like.compiler.stage_placement import contiguous_offsets, price_placed_stages


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


def brute_force_stages(costs: StageCosts, cluster_shape: tuple[int, int], num_micro_batches: int,
                       device_memory: float, *,
                       schedule: ScheduleName | str = ScheduleName.ONE_F_ONE_B) -> StageSolution | None:
    """The stage DP's reference: tries every layer partition and every (submesh, logical) choice per stage.

    Exponential; use it with a handful of layers and devices. Returns None when no plan exists. Stage
    times are priced for their placement as in ``solve_stages`` (``price_placed_stages``).
    """
    n_nodes, per_node = cluster_shape
    batches, schedule = num_micro_batches, schedule_name(schedule)
    k, num_devices = costs.num_layers, n_nodes * per_node
    aligned_only = aligned_plans_only(costs, cluster_shape)
    best: tuple[float, tuple[StageChoice, ...]] | None = None
    for num_stages in range(1, min(k, num_devices, batches if schedule.splits_backward else k) + 1):
        held_by = micro_batches_in_flight(schedule, num_stages, batches)[::-1]  # first stage first
        for cuts in itertools.combinations(range(1, k), num_stages - 1):
            bounds = (0, *cuts, k)
            options = []
            for q in range(num_stages):
                first, last = bounds[q], bounds[q + 1] - 1
                held = int(held_by[q])
                options.append([
                    StageChoice(layers=(first, last), submesh_index=SubmeshIdx(p), submesh=sub,
                                logical_shape=costs.logical_shapes[p][l], view_index=l,
                                variant=costs.variants[p][l], t_intra=float(t),
                                memory_per_device=float(costs.mem_stage[first, last, p, l]
                                                        + held * costs.mem_act[first, last, p, l]),
                                step_seconds=costs.step_seconds_of(first, last, p))
                    for p, sub in enumerate(costs.submeshes) for l in range(len(costs.logical_shapes[p]))
                    if math.isfinite(t := costs.t_intra[first, last, p, l])
                    and costs.mem_stage[first, last, p, l] + held * costs.mem_act[first, last, p, l]
                    <= device_memory])
            for plan in _plans_with_devices(options, num_devices):
                if aligned_only and contiguous_offsets([a * b for a, b in (o.submesh for o in plan)],
                                                       per_node) is None:
                    continue
                plan = price_placed_stages(costs, plan, per_node)
                value = pipeline_latency(plan, batches, schedule)
                if best is None or value < best[0]:
                    best = (value, plan)
    return None if best is None else StageSolution.of(best[1], batches, schedule=schedule)


def _plans_with_devices(options: list[list[StageChoice]], num_devices: int):
    """Every choice of one option per stage whose submeshes use exactly ``num_devices`` devices."""
    def extend(q: int, left: int, chosen: tuple[StageChoice, ...]):
        if q == len(options):
            if left == 0:
                yield chosen
            return
        for option in options[q]:
            size = option.submesh[0] * option.submesh[1]
            if size <= left - (len(options) - q - 1):
                yield from extend(q + 1, left - size, chosen + (option,))
    return extend(0, num_devices, ())
