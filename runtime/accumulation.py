"""A stage piece's run with the accumulation of its outputs fused in (both backends).

A RUN whose outputs the program accumulates (its ACC instructions: gradients, a loss) is one jitted call
``(totals, *inputs) -> (outputs, [totals[i] + outputs[slots[i]]])`` on every micro-batch, the first one
included: the totals a RUN starts are ``-0.0`` (``x + -0.0`` is ``x`` bit for bit, a ``-0.0`` included), so
the first micro-batch's sum is its output. An output of an extended dtype (a typed PRNG key) cannot be added:
it is taken as it is, which is all one micro-batch needs. The call compiles once: its first compile leaves
the totals' layouts open and XLA propagates the accumulated outputs' layouts to them, so the starting totals
are made in those layouts and every sum comes out in the layout the next call takes it in.

This needs a piece with the ILP's layouts pinned inside it, so that the open totals take the pinned outputs'
layouts. An unpinned piece (a TeraPipe slice's) would leave XLA's
propagation free inside it too: with ``open_totals=False`` a first RUN runs the piece unfused and its outputs
are the totals, in the layouts XLA gave them (a second compile for the fused form).
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
    output, the layout it is made in (None: XLA's choice), or None; ``open_totals``: start totals from -0.0
    in the layouts the first compile gives them (a pinned piece), else from a first unfused run's outputs.
    """

    def __init__(self, body: Callable, slots: tuple[int, ...], donate: tuple[int, ...] = (),
                 out_shardings: Sequence | None = None, open_totals: bool = True):
        def run(totals, *args):
            outs = body(*args)
            return outs, [outs[k] if t is None else t + outs[k] for t, k in zip(totals, slots, strict=True)]
        self.body, self.slots = body, slots
        pins = None if out_shardings is None else list(out_shardings)
        self.jitted = jax.jit(run, donate_argnums=tuple(k + 1 for k in donate),
                              out_shardings=None if pins is None else (pins, None))
        """The call as a jitted function: what runs once the first compile no longer fits the arguments."""
        self.open_totals: list[jax.ShapeDtypeStruct | None] | None = None
        """The totals as the first compile saw them: shapes and dtypes, layouts left to XLA (None: an output
        taken as it is)."""
        self._compiled = None
        self._zeros: Callable[[], list[jax.Array]] | None = None
        self._unfused = None if open_totals else jax.jit(body, donate_argnums=donate, out_shardings=pins)
        self.first_call: tuple[Callable, list] | None = None
        """The jitted function the first call ran and the specs of its leading arguments (the open totals, or
        none for an unfused run): lowering it on those and the first call's argument specs finds its
        executable in jax's cache."""

    def __call__(self, totals: Sequence[jax.Array | None], *args) -> tuple[list, list]:
        """The piece's outputs on ``args`` and the new totals; a ``None`` among ``totals`` is a total this
        call starts (from ``-0.0``). The first call compiles."""
        if self._unfused is not None:
            return self._without_open_totals(totals, args)
        if self._zeros is None:
            self._compile(args)
            self.first_call = (self.jitted, [self.open_totals])
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

    def _without_open_totals(self, totals: Sequence[jax.Array | None], args: Sequence[Any]) -> tuple[list, list]:
        """``__call__`` of a piece without open totals: unfused while a total is to start, else fused."""
        if all(t is not None for t in totals):
            if self.first_call is None:
                self.first_call = (self.jitted, [[jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=t.sharding)
                                                  for t in totals]])
            return self.jitted(list(totals), *args)
        outs = self._unfused(*args)
        if self.first_call is None:
            self.first_call = (self._unfused, [])
        return outs, [outs[k] if t is None else t + outs[k] for t, k in zip(totals, self.slots, strict=True)]

    def _compile(self, args: Sequence[Any]) -> None:
        """Compiles the call with the totals' layouts left open and makes the maker of its -0.0 totals."""
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
