"""A stage piece's run with the accumulation of its outputs fused in (both backends).

A RUN whose outputs the program accumulates (its ACC instructions: gradients, a loss) is one jitted call
``(totals, *inputs) -> (outputs, [totals[i] + outputs[slots[i]]])`` on every micro-batch, the first one
included: the totals a RUN starts are ``-0.0`` (``x + -0.0`` is ``x`` bit for bit, a ``-0.0`` included), so
the first micro-batch's sum is its output. An output of an extended dtype (a typed PRNG key) cannot be added:
it is taken as it is, which is all one micro-batch needs. The call compiles once: its first compile leaves
the totals' layouts open and XLA propagates the accumulated outputs' layouts to them, so the starting totals
are made in those layouts and every sum comes out in the layout the next call takes it in.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


class FusedAccumulation:
    """One piece's fused run-and-accumulate call, for one choice of accumulated outputs (``slots``) and
    donated inputs (``donate``: positions among the piece's inputs).

    ``body``: the piece as a function of its inputs, returning its list of outputs; ``out_shardings``: per
    output, the layout it is made in (None: XLA's choice), or None.
    """

    def __init__(self, body: Callable, slots: tuple[int, ...], donate: tuple[int, ...] = (),
                 out_shardings: Sequence | None = None):
        def run(totals, *args):
            outs = body(*args)
            return outs, [outs[k] if t is None else t + outs[k] for t, k in zip(totals, slots, strict=True)]
        self.body, self.slots = body, slots
        self.jitted = jax.jit(run, donate_argnums=tuple(k + 1 for k in donate),
                              out_shardings=None if out_shardings is None else (list(out_shardings), None))
        """The call as a jitted function: what runs once the first compile no longer fits the arguments."""
        self.open_totals: list[jax.ShapeDtypeStruct | None] | None = None
        """The totals as the first compile saw them: shapes and dtypes, layouts left to XLA (None: an output
        taken as it is)."""
        self._compiled = None
        self._zeros: Callable[[], list[jax.Array]] | None = None

    def __call__(self, totals: Sequence[jax.Array | None], *args) -> tuple[list, list]:
        """The piece's outputs on ``args`` and the new totals; a ``None`` among ``totals`` is a total this
        call starts (from ``-0.0``). The first call compiles."""
        if self._zeros is None:
            self._compile(args)
        if any(t is None for t in totals):
            zeros = iter(self._zeros())
            totals = [None if spec is None else next(zeros) if t is None else t
                      for t, spec in zip(totals, self.open_totals, strict=True)]
        if self._compiled is not None:
            try:
                return self._compiled(list(totals), *args)
            except (TypeError, ValueError):  # arguments the compile did not see (a layout, a weak type)
                self._compiled = None
        return self.jitted(list(totals), *args)

    def _compile(self, args: Sequence[Any]) -> None:
        outs = jax.eval_shape(self.body, *args)
        self.open_totals = [None if jax.dtypes.issubdtype(outs[k].dtype, jax.dtypes.extended)
                            else jax.ShapeDtypeStruct(outs[k].shape, outs[k].dtype, weak_type=outs[k].weak_type)
                            for k in self.slots]
        compiled = self.jitted.lower(self.open_totals, *args).compile()
        (totals_in, *_), _ = compiled.input_shardings
        _, totals_out = compiled.output_shardings
        added = [(spec, a, b) for spec, a, b in zip(self.open_totals, totals_in, totals_out, strict=True)
                 if spec is not None]
        if all(a.is_equivalent_to(b, len(spec.shape)) for spec, a, b in added):
            self._compiled = compiled
            layouts = [a for _, a, _ in added]
        else:  # sums that would come out in other layouts than they go in: the jitted call takes them
            layouts = [b for _, _, b in added]
        specs = [(spec.shape, spec.dtype) for spec, _, _ in added]
        self._zeros = jax.jit(lambda: [jnp.full(shape, -0.0, dtype) for shape, dtype in specs],
                              out_shardings=layouts)
