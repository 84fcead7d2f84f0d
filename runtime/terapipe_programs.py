"""TeraPipe lowered to instruction programs: a token-sliced step as stage pieces and per-mesh programs that
the local and the Ray backends run like any other schedule's.

A TeraPipe step runs units, one per (batch slice, token slice) (:mod:`~alpa_like.runtime.terapipe_runtime`
traces the loss once per slice *shape* ``(rows, context, length)`` and cuts each trace into the plan's
stages). This module turns every (shape, stage) into two plain pieces:

* a forward piece (``F``): the stage's equations under ``jax.vjp``, returning the stage's outputs, for each
  attention call it holds the *next prefix* (its cached keys or values extended by the slice's own:
  what the next token slice of the same sequence reads) and the vjp's residuals, flattened;
* a backward piece (``B``): the residuals and the output cotangents in, the input cotangents out: the
  gradients of the parameters (accumulated like any schedule's), the cotangents of the values other stages
  sent, and the cotangent of the cached prefix (carried back to the previous token slice). The loss's
  cotangent is one, inside the piece; a value read by several later stages takes one cotangent from each
  and sums them.

Shape ``s``'s piece of stage ``q`` is the program's stage ``s * P + q`` on mesh ``q`` (``P`` meshes): a
virtual stage, as interleaved 1F1B maps several stages to a mesh. The step's apply-grad pieces are the
pipeline's own (stages ``0..P-1``); a parameter whose gradients several meshes make (a tied embedding) is
accumulated on each and summed by a small piece before its update.

:func:`emit_token_sliced` emits the programs from a TeraPipe schedule. Besides LOAD, RECV, RUN, ACC, MEAN
and FREE they use two instruction forms (:mod:`~alpa_like.runtime.instructions`): a batch LOAD with a
``window`` (the unit's rows and tokens) and ``CARRY``, which hands a buffer to another unit on the same mesh
(the next prefix to the next token slice, its cotangent back, a zero cotangent to the last slice, the
count of real prefix tokens to a padded slice), left-padding or trimming its token dim by ``pad``.
Each unit's loss is weighted ``rows * length * M / (B * S)``, so the accumulate-then-mean of the
pipeline (MEAN divides by ``M``) gives the step's mean loss and gradients.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD
from alpa_like.compiler.schedules import Phase, Schedule
from alpa_like.compiler.stage_construction import StagePiece, StageProgram, ValueId, apply_order
from alpa_like.runtime.instructions import PER_STEP, Instruction, Key, MeshPrograms, Op, step_output_places

__all__ = ["TokenSlicedProgram", "lower_token_sliced", "emit_token_sliced", "forward_only"]


@dataclasses.dataclass(frozen=True)
class Carried:
    """A piece input that a unit gets by CARRY: from the previous / next unit of the same sequence, or from a
    per-step constant."""

    kind: str
    """'prefix' (the previous unit's next prefix), 'cotangent' (the next unit's prefix cotangent; zeros on
    the last unit) or 'valid' (how many of a padded prefix's tokens are real)."""
    call_kv: tuple[int, int] = (0, 0)
    """(attention call, 0 = keys / 1 = values) of a prefix or its cotangent."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenSlicedProgram:
    """A TeraPipe step as a :class:`StageProgram` with one virtual stage per (slice shape, mesh)."""

    program: StageProgram
    stage_to_mesh: tuple[int, ...]
    num_meshes: int
    shape_index: dict[tuple[int, int, int], int]
    """Slice shape ``(rows, context, length)`` -> ``s``: its pieces are stages ``s * P .. s * P + P - 1``."""
    carried: dict[ValueId, Carried]
    next_prefix: dict[tuple[int, int, int, int], ValueId]
    """(shape, mesh, call, kv) -> the forward output holding the next prefix."""
    prefix_cotangent: dict[tuple[int, int, int, int], ValueId]
    """(shape, mesh, call, kv) -> the backward output holding the prefix's cotangent."""
    batch_leaves: frozenset[ValueId]
    zeros: dict[tuple, ValueId]
    """Constants: ('prefix', shape, mesh, call, kv) an empty first prefix, ('cotangent', ...) the last
    unit's zero next-prefix cotangent, ('valid', start) a prefix's real token count."""
    loss_values: dict[int, ValueId] = dataclasses.field(default_factory=dict)
    """Slice shape index -> the forward output holding its weighted loss."""
    grad_sums: tuple[int, ...] = ()
    """Stages whose apply piece sums a gradient's per-mesh accumulators (run before the others)."""


def _inexact(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _zero_cotangent(aval):
    return jnp.zeros(aval.shape, aval.dtype) if _inexact(aval) else np.zeros(aval.shape, jax.dtypes.float0)


def _closed(fn, avals) -> ClosedJaxpr:
    """``fn``'s jaxpr, nested ``jit`` calls inlined (the layout analyses read the equations directly)."""
    return jax_compat.inline_calls(jax.make_jaxpr(fn)(*avals))


class _Values:
    """ValueId allocation over the original program's values."""

    def __init__(self, values: Sequence[Var]):
        self.values = list(values)
        self.ids: dict[Var, ValueId] = {}

    def of(self, var: Var) -> ValueId:
        if var not in self.ids:
            self.ids[var] = ValueId(len(self.values))
            self.values.append(var)
        return self.ids[var]


def lower_token_sliced(program: StageProgram, call, slice_programs: dict, units: Sequence, num_meshes: int,
                       batch_leaf: Sequence[bool], has_next: dict) -> TokenSlicedProgram:
    """The pieces of every (slice shape, stage) and the step's apply pieces as one stage program.

    Args:
      program: the pipeline's stage program of the step (its apply pieces, step inputs and outputs,
        accumulators).
      call: the step's :class:`~alpa_like.runtime.terapipe_runtime.LossCall`.
      slice_programs: slice shape -> its traced and cut loss (``terapipe_runtime._SliceProgram``).
      units: every (batch slice, token slice) unit.
      num_meshes: ``P``.
      batch_leaf: per loss-argument leaf, whether it is a batch leaf (sliced by rows and tokens).
      has_next: slice shape -> whether some unit of that shape has a next token slice.
    """
    P = num_meshes
    vals = _Values(program.values)
    pieces: dict[tuple[int, str], StagePiece] = {}
    constants = dict(program.constants)
    carried: dict[ValueId, Carried] = {}
    next_prefix, prefix_ct, zeros, loss_values = {}, {}, {}, {}
    leaf_vid = [program.step_inputs[s] for s in call.sources]
    grad_marker = [dst for _, dst in program.accumulated]
    loss_dst = grad_marker[0] if call.with_value else None
    grad_dst = {j: grad_marker[m + int(call.with_value)] for m, j in enumerate(call.grad_order)}
    accumulated: list[tuple[ValueId, ValueId]] = []
    acc_meshes: dict[ValueId, set[int]] = {}
    grads_of: list[tuple[ValueId, ValueId, int]] = []  # (gradient output, marker output, mesh)
    shapes = sorted(slice_programs)
    shape_index = {key: n for n, key in enumerate(shapes)}
    for key in shapes:
        n = shape_index[key]
        prog = slice_programs[key]
        leaf_index = {v: j for j, v in enumerate(prog.leaf_vars)}
        consts = dict(zip(prog.closed.jaxpr.constvars, prog.closed.consts, strict=True))
        leaf_ids = {v: leaf_vid[j] for j, v in enumerate(prog.leaf_vars)}
        differentiated = {v for j, v in enumerate(prog.leaf_vars) if call.differentiated[j]}
        consumers: dict[Var, list[int]] = {}
        for q, part in enumerate(prog.parts):
            for v in part.inputs:
                if prog.producer.get(v, q) != q:
                    consumers.setdefault(v, []).append(q)
        ct_in: dict[tuple[Var, int], ValueId] = {}  # (value, consumer stage) -> its cotangent from there
        built = {}
        for q in reversed(range(P)):  # consumers first: their cotangent outputs are the producers' inputs
            built[q] = _stage_pieces(prog, q, n * P + q, has_next[key], consts, consumers, ct_in, vals,
                                     leaf_ids, differentiated)
        for q in range(P):
            fwd, bwd, info = built[q]
            stage = n * P + q
            pieces[(stage, FORWARD)] = fwd
            pieces[(stage, BACKWARD)] = bwd
            for var, vid in info["inputs"].items():
                if var in leaf_index:
                    continue
                if var in prog.prefix_vars:
                    carried[vid] = Carried("prefix", prog.prefix_vars[var])
                    shape = var.aval.shape
                    zkey = ("prefix", key, q, *prog.prefix_vars[var])
                    if zkey not in zeros:
                        zeros[zkey] = vals.of(Var(var.aval))
                        constants[zeros[zkey]] = np.zeros(shape, var.aval.dtype)
                elif var is prog.valid_var:
                    carried[vid] = Carried("valid")
                    for unit in units:
                        if ("valid", unit.token_start) not in zeros:
                            zeros[("valid", unit.token_start)] = vals.of(Var(var.aval))
                            constants[zeros[("valid", unit.token_start)]] = np.int32(unit.token_start)
                elif var in consts:
                    constants[vid] = consts[var]
            for ck, vid in info["next"].items():
                next_prefix[(n, q, *ck)] = vid
            for ck, vid in info["next_ct"].items():
                carried[vid] = Carried("cotangent", ck)
                aval = vals.values[vid].aval
                zkey = ("cotangent", key, q, *ck)
                zeros[zkey] = vals.of(Var(aval))
                constants[zeros[zkey]] = np.zeros(aval.shape, aval.dtype)
            for ck, vid in info["prefix_ct"].items():
                prefix_ct[(n, q, *ck)] = vid
            if info["loss"] is not None:
                loss_values[n] = info["loss"]
            if info["loss"] is not None and loss_dst is not None:
                accumulated.append((info["loss"], loss_dst))
                acc_meshes.setdefault(loss_dst, set()).add(q)
            for var, vid in info["grads"].items():
                j = leaf_index[var]
                grads_of.append((vid, grad_dst[j], q))
                acc_meshes.setdefault(grad_dst[j], set()).add(q)
    for dst, meshes in list(acc_meshes.items()):
        if len(meshes) > 1 and dst == loss_dst:
            raise ValueError("the loss is computed on several meshes")
    # A gradient made on several meshes: one accumulator per mesh, summed by an apply piece.
    partial: dict[tuple[ValueId, int], ValueId] = {}
    extra_apply: dict[int, list[tuple[list[ValueId], ValueId]]] = {}
    for dst, meshes in acc_meshes.items():
        if len(meshes) > 1:
            aval = vals.values[dst].aval
            for q in sorted(meshes):
                partial[(dst, q)] = vals.of(Var(aval))
            extra_apply.setdefault(max(meshes), []).append(([partial[(dst, q)] for q in sorted(meshes)], dst))
    for vid, dst, q in grads_of:
        accumulated.append((vid, partial.get((dst, q), dst)))
    num_shapes = len(shapes)
    num_stages = num_shapes * P + (P if extra_apply else 0)
    grad_sums = []
    for stage in range(num_stages):
        q = stage % P
        if stage < P:
            pieces[(stage, APPLY)] = program.piece(stage, APPLY)
        elif stage >= num_shapes * P and q in extra_apply:
            pieces[(stage, APPLY)] = _sum_piece(stage, extra_apply[q], vals)
            grad_sums.append(stage)
        for phase in (FORWARD, BACKWARD, APPLY):
            if (stage, phase) not in pieces:
                pieces[(stage, phase)] = StagePiece(stage=stage, phase=phase, jaxpr=_closed(lambda: [], []),
                                                    inputs=(), outputs=())
    home: dict[ValueId, int] = {}  # every input of a piece arrives by LOAD, RECV or CARRY
    new = dataclasses.replace(program, num_stages=num_stages, pieces=pieces, values=tuple(vals.values),
                              constants=constants, accumulated=tuple(accumulated), home=home,
                              batch_inputs=frozenset(v for v, b in zip(leaf_vid, batch_leaf, strict=True) if b))
    return TokenSlicedProgram(program=new, stage_to_mesh=tuple(s % P for s in range(num_stages)), num_meshes=P,
                              shape_index=shape_index, carried=carried, next_prefix=next_prefix,
                              prefix_cotangent=prefix_ct, zeros=zeros, grad_sums=tuple(grad_sums),
                              loss_values=loss_values,
                              batch_leaves=new.batch_inputs)


def _constant_residuals_inlined(fwd: ClosedJaxpr, num_out: int) -> tuple[ClosedJaxpr, dict[int, jax.Array]]:
    """``fwd`` (``num_out`` outputs, then the vjp's residuals) without the residuals that are literals (a
    ``pad``'s padding value, for one), and those residuals' values by position among the residuals: the
    backward piece takes them as constants instead of buffers (a piece's outputs are buffers, so Vars)."""
    res = fwd.jaxpr.outvars[num_out:]
    constants = {k: jnp.asarray(o.val, o.aval.dtype) for k, o in enumerate(res) if not isinstance(o, Var)}
    if not constants:
        return fwd, constants
    outvars = fwd.jaxpr.outvars[:num_out] + [o for o in res if isinstance(o, Var)]
    jaxpr = fwd.jaxpr.replace(outvars=outvars, debug_info=jax_compat.debug_info("forward", len(fwd.jaxpr.invars),
                                                                                  len(outvars)))
    return fwd.replace(jaxpr=jaxpr), constants


def _sum_piece(stage: int, sums: list[tuple[list[ValueId], ValueId]], vals: _Values) -> StagePiece:
    """An apply piece adding each gradient's per-mesh step means into the marker output the update reads."""
    inputs = [v for parts, _ in sums for v in parts]
    counts = [len(parts) for parts, _ in sums]

    def add(*xs):
        out, k = [], 0
        for c in counts:
            total = xs[k]
            for x in xs[k + 1:k + c]:
                total = total + x
            out.append(total)
            k += c
        return out
    closed = _closed(add, [vals.values[v].aval for v in inputs])
    return StagePiece(stage=stage, phase=APPLY, jaxpr=closed, inputs=tuple(inputs),
                      outputs=tuple(dst for _, dst in sums))


def _stage_pieces(prog, q: int, stage: int, has_next: bool, consts: dict, consumers: dict, ct_in: dict,
                  vals: _Values, leaf_ids: dict, differentiated: set):
    """Forward and backward pieces of stage ``q`` of one slice shape; registers in ``ct_in`` the cotangents
    its backward outputs for the earlier stages (whose pieces are built after it)."""
    part = prog.parts[q]
    later = {v for p in prog.parts[q + 1:] for v in p.inputs}
    outs = [v for v in part.outputs if v in later or v is prog.loss_var]
    prefix_in = [(v, prog.prefix_vars[v]) for v in part.inputs if v in prog.prefix_vars]
    kv_of = {ck: prog.kv_vars[ck[0]][ck[1]] for _, ck in prefix_in}
    nexts = [ck for _, ck in prefix_in] if has_next else []
    diff = [_inexact(v.aval) for v in part.inputs]
    diff_inputs = [v for v, d in zip(part.inputs, diff, strict=True) if d]
    tree = {}

    def body(*values):
        env = dict(zip(part.inputs, values, strict=True))
        jax_compat.eval_eqns(part.eqns, env)
        extended = [jnp.concatenate([env[v], env[kv_of[ck]]], axis=1) for v, ck in prefix_in if has_next]
        return [env[v] for v in outs] + extended

    def forward(*values):
        def f(*differentiable):
            it = iter(differentiable)
            return body(*[next(it) if d else x for x, d in zip(values, diff, strict=True)])
        results, vjp = jax.vjp(f, *[x for x, d in zip(values, diff, strict=True) if d])
        leaves, tree["def"] = jax.tree_util.tree_flatten(vjp)
        return list(results) + leaves

    num_out = len(outs) + len(nexts)
    fwd, constant_residuals = _constant_residuals_inlined(_closed(forward, [v.aval for v in part.inputs]), num_out)
    res_vars = fwd.jaxpr.outvars[num_out:]
    out_avals = [v.aval for v in fwd.jaxpr.outvars[:num_out]]
    # Cotangent inputs: per output value, one from each later stage that reads it (summed); per next prefix one.
    ct_sources = [[c for c in consumers.get(v, []) if c > q] if _inexact(v.aval) and v is not prog.loss_var else []
                  for v in outs]
    ct_avals = [out_avals[k] for k, sources in enumerate(ct_sources) for _ in sources]
    ct_avals += out_avals[len(outs):]
    # Input cotangents that leave the piece: differentiated leaves' (gradients), the prefix's, other stages'.
    kept = [k for k, v in enumerate(diff_inputs)
            if v in differentiated or (v in prog.prefix_vars and v.aval.shape[1] > 0)
            or (v not in prog.leaf_vars and v not in prog.prefix_vars and prog.producer.get(v, q) != q)]

    def backward(residuals, cts):
        it = iter(residuals)
        leaves = [constant_residuals[k] if k in constant_residuals else next(it)
                  for k in range(len(residuals) + len(constant_residuals))]
        vjp = jax.tree_util.tree_unflatten(tree["def"], leaves)
        it = iter(cts)
        full = []
        for k, (v, sources) in enumerate(zip(outs, ct_sources, strict=True)):
            if v is prog.loss_var:
                full.append(jnp.ones(v.aval.shape, v.aval.dtype))
            elif sources:
                total = next(it)
                for _ in sources[1:]:
                    total = total + next(it)
                full.append(total)
            else:
                full.append(_zero_cotangent(out_avals[k]))
        full += [next(it) for _ in nexts]
        grads = vjp(full)
        return [grads[k] for k in kept]

    bwd = _closed(backward, [[v.aval for v in res_vars], ct_avals])
    for closed, what in ((fwd, "forward"), (bwd, "backward")):
        if any(not isinstance(o, Var) for o in closed.jaxpr.outvars):
            raise NotImplementedError(f"stage {q}'s {what} piece of a token slice has a constant output")
    in_ids = {v: vals.of(v) for v in part.inputs if v not in prog.leaf_vars}
    fwd_inputs = [leaf_ids[v] if v in prog.leaf_vars else in_ids[v] for v in part.inputs]
    out_vars = fwd.jaxpr.outvars
    next_ids = {ck: vals.of(out_vars[len(outs) + k]) for k, ck in enumerate(nexts)}
    fwd_outputs = [vals.of(v) for v in outs] + list(next_ids.values()) + [vals.of(o) for o in res_vars]
    bwd_inputs = [vals.of(o) for o in res_vars]
    for v, sources in zip(outs, ct_sources, strict=True):
        bwd_inputs += [ct_in[(v, c)] for c in sources]
    next_cts = {ck: vals.of(Var(out_avals[len(outs) + k])) for k, ck in enumerate(nexts)}
    bwd_inputs += list(next_cts.values())
    grads, prefix_ct, bwd_outputs = {}, {}, []
    for k, o in zip(kept, bwd.jaxpr.outvars, strict=True):
        v, vid = diff_inputs[k], vals.of(o)
        bwd_outputs.append(vid)
        if v in prog.leaf_vars:
            grads[v] = vid
        elif v in prog.prefix_vars:
            prefix_ct[prog.prefix_vars[v]] = vid
        else:
            ct_in[(v, q)] = vid
    return (StagePiece(stage=stage, phase=FORWARD, jaxpr=fwd, inputs=tuple(fwd_inputs), outputs=tuple(fwd_outputs)),
            StagePiece(stage=stage, phase=BACKWARD, jaxpr=bwd, inputs=tuple(bwd_inputs), outputs=tuple(bwd_outputs)),
            {"inputs": in_ids, "next": next_ids, "next_ct": next_cts, "prefix_ct": prefix_ct,
             "loss": vals.of(prog.loss_var) if prog.loss_var in outs else None, "grads": grads})


def forward_only(tp: TokenSlicedProgram, stage: int) -> StagePiece:
    """Stage ``stage``'s forward piece for a run of forwards alone (the first step's contract check): it returns
    only what forwards read (values for later stages, the next prefix) and the weighted loss, without the
    equations that only the vjp's residuals need (only backward pieces read those); the values it returns
    are the forward piece's."""
    program = tp.program
    reads = {v for (_, phase), piece in program.pieces.items() if phase == FORWARD for v in piece.inputs}
    reads.update(tp.next_prefix.values(), tp.loss_values.values())
    piece = program.piece(stage, FORWARD)
    kept = [k for k, v in enumerate(piece.outputs) if v in reads]
    jaxpr = piece.jaxpr.jaxpr
    closed = piece.jaxpr.replace(jaxpr=jaxpr.replace(outvars=[jaxpr.outvars[k] for k in kept]))
    return dataclasses.replace(piece, jaxpr=jax_compat.without_dead_code(closed),
                               outputs=tuple(piece.outputs[k] for k in kept))


def emit_token_sliced(tp: TokenSlicedProgram, schedule: Schedule, units: Sequence, *,
                      free_buffers: bool = True) -> MeshPrograms:
    """The per-mesh programs that run ``tp`` under a TeraPipe ``schedule`` whose micro-batches are the batch
    slices of ``units`` (``terapipe_runtime._Unit``: batch slice, token slice, shape, first row and token)
    and whose tasks' slices are their token slices; then the gradients' means and the apply pieces. Each
    unit's share of a micro-batch's work (``MeshPrograms.unit_shares``) and each virtual stage's pipeline
    stage (``MeshPrograms.stage_of``: its mesh) let the simulated backend price the programs that run."""
    program, P = tp.program, tp.num_meshes
    index = {(u.batch_slice, u.index): n for n, u in enumerate(units)}
    step_inputs = set(program.step_inputs) | set(program.constants)
    accumulator_of = dict(program.accumulated)
    where: dict[Key, set[int]] = {}
    out: list[Instruction] = []
    reads: list[tuple[tuple[int, Key], ...]] = []

    def emit(ins: Instruction, read: Sequence[tuple[int, Key]] = ()) -> None:
        out.append(ins)
        reads.append(tuple(read))
        if ins.op in (Op.LOAD, Op.RECV, Op.CARRY, Op.MEAN):
            where.setdefault(ins.key, set()).add(ins.mesh)

    def padded(unit) -> int:
        return unit.key[1]

    def carry(vid: ValueId, u: int, mesh: int) -> None:
        unit, what = units[u], tp.carried[vid]
        q = mesh
        if what.kind == "valid":
            source, pad = (tp.zeros[("valid", unit.token_start)], PER_STEP), 0
        elif what.kind == "prefix" and unit.index == 0:
            source, pad = (tp.zeros[("prefix", unit.key, q, *what.call_kv)], PER_STEP), 0
        elif what.kind == "prefix":
            prev = units[index[(unit.batch_slice, unit.index - 1)]]
            source = (tp.next_prefix[(tp.shape_index[prev.key], q, *what.call_kv)],
                      index[(prev.batch_slice, prev.index)])
            pad = padded(unit) - padded(prev) - prev.key[2]
        elif (unit.batch_slice, unit.index + 1) in index:
            nxt = units[index[(unit.batch_slice, unit.index + 1)]]
            source = (tp.prefix_cotangent[(tp.shape_index[nxt.key], q, *what.call_kv)],
                      index[(nxt.batch_slice, nxt.index)])
            pad = padded(unit) + unit.key[2] - padded(nxt)
        else:
            source, pad = (tp.zeros[("cotangent", unit.key, q, *what.call_kv)], PER_STEP), 0
        if source[1] == PER_STEP and mesh not in where.get(source, ()):
            emit(Instruction(Op.LOAD, mesh, key=source))
        if mesh not in where.get(source, ()):
            raise ValueError(f"v{vid} of unit {u} reads v{source[0]}@{source[1]} on mesh {mesh} before it is made")
        emit(Instruction(Op.CARRY, mesh, key=(vid, u), source=source, pad=pad), [(mesh, source)])

    def available(vid: ValueId, u: int, mesh: int) -> Key:
        if vid in tp.batch_leaves and u != PER_STEP:
            key = (vid, u)
            if mesh not in where.get(key, ()):
                unit = units[u]
                emit(Instruction(Op.LOAD, mesh, key=key,
                                 window=(unit.row_start, unit.key[0], unit.token_start, unit.key[2])))
            return key
        if vid in step_inputs and vid not in tp.carried:
            key = (vid, PER_STEP)
            if mesh not in where.get(key, ()):
                emit(Instruction(Op.LOAD, mesh, key=key))
            return key
        key = (vid, u)
        if mesh in where.get(key, ()):
            return key
        if vid in tp.carried:
            carry(vid, u, mesh)
            return key
        holders = where.get(key)
        if not holders:
            raise ValueError(f"value v{vid} (unit {u}) is read on mesh {mesh} before it is computed")
        src = min(holders)
        emit(Instruction(Op.RECV, mesh, key=key, src_mesh=src), [(src, key)])
        return key

    def run(stage: int, phase: str, u: int) -> None:
        mesh = tp.stage_to_mesh[stage]
        piece = program.piece(stage, phase)
        keys = [available(v, u, mesh) for v in piece.inputs]
        emit(Instruction(Op.RUN, mesh, stage=stage, phase=phase, micro_batch=u), [(mesh, k) for k in keys])
        for v in piece.outputs:
            where.setdefault((v, u), set()).add(mesh)
        for v in piece.outputs:
            if v in accumulator_of:
                emit(Instruction(Op.ACC, mesh, key=(v, u), target=accumulator_of[v]), [(mesh, (v, u))])

    for row in schedule.ticks:
        for task in row:
            if task is not None:
                u = index[(task.micro_batch, task.slice or 0)]
                stage = tp.shape_index[units[u].key] * P + task.stage
                run(stage, FORWARD if task.phase == Phase.F else BACKWARD, u)
    acc_mesh = {}
    for ins in out:
        if ins.op is Op.ACC:
            acc_mesh.setdefault(ins.target, ins.mesh)
    for dst, mesh in acc_mesh.items():
        emit(Instruction(Op.MEAN, mesh, key=(dst, PER_STEP)))
    for stage in apply_order(program):
        piece = program.piece(stage, APPLY)
        if piece.inputs or piece.outputs:
            run(stage, APPLY, PER_STEP)
    def returned_input(v: ValueId) -> None:
        if v in step_inputs:  # the step returns an input as it is
            available(v, PER_STEP, P - 1)

    outputs, copies = step_output_places(program, where, lambda v, u: (v, u), returned_input)
    instructions = _with_frees(out, reads, program, {o[0] for o in outputs if o}) if free_buffers else out
    num_slices = len({u.batch_slice for u in units})
    tokens = sum(u.key[0] * u.key[2] for u in units)
    return MeshPrograms(instructions=tuple(instructions), num_meshes=P, stage_to_mesh=tp.stage_to_mesh,
                        outputs=tuple(outputs), output_copies=tuple(copies) if any(copies) else (),
                        units=tuple((u.batch_slice, u.index) for u in units),
                        unit_shares=tuple(u.key[0] * u.key[2] * num_slices / tokens for u in units),
                        stage_of=tp.stage_to_mesh)


def _with_frees(instructions: list[Instruction], reads: list, program: StageProgram, keep: set) -> list[Instruction]:
    """``FREE`` after the last instruction that reads or writes each per-unit buffer on each mesh."""
    last: dict[tuple[int, Key], int] = {}
    for i, (ins, read) in enumerate(zip(instructions, reads, strict=True)):
        for place in read:
            last[place] = i
        if ins.op is Op.RUN:
            for v in program.piece(ins.stage, ins.phase).outputs:
                last[(ins.mesh, (v, ins.micro_batch))] = i
        elif ins.op in (Op.LOAD, Op.RECV, Op.CARRY):
            last[(ins.mesh, ins.key)] = max(last.get((ins.mesh, ins.key), i), i)
    frees: dict[int, list] = {}
    for (mesh, key), i in last.items():
        if key[1] != PER_STEP and key not in keep:
            frees.setdefault(i, []).append((mesh, key))
    result = []
    for i, ins in enumerate(instructions):
        result.append(ins)
        result.extend(Instruction(Op.FREE, mesh, key=key) for mesh, key in sorted(frees.get(i, ())))
    return result
