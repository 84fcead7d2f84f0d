"""The pipeline path's first passes: trace a step, split it at ``al.grad`` and cut it into layers.

:func:`slice_step` traces the step under the layer option's layer construction (one micro-batch; al.grad cuts
the loss: ``AutoLayerOption`` clusters operators by Eq. 3.6, ``ManualLayerOption`` cuts at
``al.mark_pipeline_boundary()``), checks that it differentiates one loss, slices the jaxpr into per-layer
forward, backward and apply-grad pieces and summarises each layer (FLOPs, parameters, activations). The
:class:`SlicedStep` it returns is what the later passes (:func:`~alpa_like.compiler.pipeline.plan_pipeline`)
and the pipeline runtimes share.
"""
from __future__ import annotations

import dataclasses
import time
import warnings as python_warnings
from collections.abc import Callable, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr

from alpa_like.compiler import jax_compat
from alpa_like.compiler.cross_layer_grad import split_cross_layer_grad_sums
from alpa_like.compiler.grad_accumulation import grad_markers, split_at_grad_marker
from alpa_like.compiler.input_roles import input_roles
from alpa_like.compiler.layer_construction import layering
from alpa_like.compiler.layer_slicing import layer_summaries, slice_layers
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.options import PipeshardParallel
from alpa_like.compiler.schedules import ScheduleName
from alpa_like.compiler.stage_profiling import apply_phase_inputs
from alpa_like.compiler.trace import TracedStep, trace_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlicedStep:
    """A step traced under layer construction and cut into per-layer pieces (what planning and the runtime
    share)."""

    traced: TracedStep
    jaxpr: Any
    """The step jaxpr with parameter markers bypassed."""
    pieces: tuple
    roles: tuple[str, ...]
    warnings: tuple[str, ...]
    summaries: tuple
    optimizer_inputs: tuple[tuple[int, ...], ...]
    seconds: float

    @property
    def closed_jaxpr(self):
        return ClosedJaxpr(self.jaxpr, self.traced.closed_jaxpr.consts)


def slice_step(method: PipeshardParallel, fun: Callable, args: Sequence[Any], *, static_argnums: Sequence[int],
               batch_argnums: Sequence[int]) -> SlicedStep:
    """Traces ``fun(*args)`` under ``method``'s layer option (one micro-batch) and slices it into layers.

    Gradients summed across layers are split per layer (:mod:`~alpa_like.compiler.cross_layer_grad`) except
    under the ``terapipe`` schedule, whose runtime differentiates each token slice itself and reads al.grad's
    results one per differentiated leaf."""
    start = time.perf_counter()
    with layering(method.layer_option.layering()):
        traced = trace_step(fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums,
                            num_micro_batches=method.num_micro_batches)
    if any(is_marker(e, "boundary") for e in traced.closed_jaxpr.jaxpr.eqns):
        raise ValueError("al.mark_pipeline_boundary() was called outside the function al.grad differentiates, "
                         "where it cuts nothing: call it inside the loss, between two layers' forward code")
    markers = grad_markers(traced.closed_jaxpr)
    if not markers and _calls_grad_in_a_body(traced.closed_jaxpr.jaxpr):
        raise ValueError("PipeshardParallel: the step calls al.grad / al.value_and_grad inside a lax.scan, loop or "
                         "cond body (a gradient accumulation loop?), where the pipeline cannot cut its loss into "
                         "layers: call it once, outside loops, and accumulate with num_micro_batches")
    if len(markers) > 1:
        raise ValueError(f"PipeshardParallel needs exactly one al.grad / al.value_and_grad call in the step (its "
                         f"loss is what the pipeline cuts into layers), found {len(markers)}")
    if markers and method.num_micro_batches > 1:  # a value computed from the batch after al.grad: an error
        split_at_grad_marker(traced.closed_jaxpr, [leaf.is_batch for leaf in traced.in_leaves])
    # Parameter markers have done their job (param_mask); without them each layer reads its own parameters.
    jaxpr = jax_compat.bypass_eqns(traced.closed_jaxpr.jaxpr, lambda e: is_marker(e, "param"))
    jaxpr, constraint_warning = without_sharding_constraints(jaxpr)
    pieces = slice_layers(jaxpr)
    split = jaxpr
    if method.pipeline_schedule != ScheduleName.TERAPIPE:
        split = split_cross_layer_grad_sums(jaxpr, pieces)  # tied weights: accumulate per layer, add per step
    if split is not jaxpr:
        jaxpr, pieces = split, slice_layers(split)
    roles, warnings = input_roles(traced)
    if constraint_warning:
        python_warnings.warn(constraint_warning, stacklevel=3)
        warnings += (constraint_warning,)
    summaries = layer_summaries(jaxpr, pieces, [r == "param" for r in roles])
    batch = {i for i, r in enumerate(roles) if r == "batch"}
    optimizer_inputs = tuple(tuple(sorted(apply_phase_inputs(jaxpr, pieces, l) - set(s.param_inputs) - batch))
                             for l, s in enumerate(summaries))
    return SlicedStep(traced=traced, jaxpr=jaxpr, pieces=tuple(pieces), roles=tuple(roles), warnings=warnings,
                      summaries=tuple(summaries), optimizer_inputs=optimizer_inputs,
                      seconds=time.perf_counter() - start)


def without_sharding_constraints(jaxpr: Jaxpr) -> tuple[Jaxpr, str | None]:
    """``jaxpr`` without the step's own ``with_sharding_constraint`` equations (identities whose shardings name
    the devices of the whole step, where each pipeline stage runs on its own submesh, and the intra-op pass
    chooses the stage's layouts), and a warning saying how many were left out, or None when there were none."""
    jaxpr, count = jax_compat.bypass_eqns_deep(jaxpr, jax_compat.is_sharding_constraint)
    if not count:
        return jaxpr, None
    return (jaxpr,
            f"PipeshardParallel leaves out {count} sharding_constraint equation(s) of the step "
            "(with_sharding_constraint calls, and their transposes in the backward): each stage runs on its own "
            "submesh, whose layouts the intra-op pass chooses")


def _calls_grad_in_a_body(jaxpr: Jaxpr) -> bool:
    """Whether an al.grad marker is in a program nested in ``jaxpr`` (a call, loop or cond body)."""
    return any(any(is_marker(e, "grad") for e in sub.eqns) or _calls_grad_in_a_body(sub)
               for eqn in jaxpr.eqns for sub in jax_compat.nested_jaxprs(eqn))
