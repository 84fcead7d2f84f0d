"""Hooks that the compiler's tracing sets while it traces the user's code, and the user-facing functions read.

Lower rooms trace the step with these set; :mod:`alpa_like.grad` and :mod:`alpa_like.nn` (the API's ``al.grad``
and ``causal_self_attention``) read them. They live here, below both, so that the compiler and the runtimes
need nothing from the API.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import jax

GradHook = Callable[..., object]
_HOOK: contextvars.ContextVar[GradHook | None] = contextvars.ContextVar("alpa_like_grad_hook", default=None)


@contextlib.contextmanager
def grad_hook(hook: GradHook) -> Iterator[None]:
    """Within this block ``al.grad(fun, ...)(*args)`` returns ``hook(fun, args, kwargs, argnums=...,
    has_aux=..., with_value=..., jax_kwargs=...)`` instead (the TeraPipe runtime uses it to find the loss
    and to feed in gradients it computed slice by slice)."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


def active_grad_hook() -> GradHook | None:
    """The hook of the innermost :func:`grad_hook` block, or None."""
    return _HOOK.get()


ATTENTION_SCOPE = "causal_self_attention"
"""Name of the ``jax.named_scope`` wrapping the body of :func:`causal_self_attention`."""


@dataclasses.dataclass
class TokenSliceContext:
    """Key/value cache plumbing of one traced token slice (TeraPipe).

    ``prefixes[n]`` holds, for the ``n``-th attention call of the slice, one ``(k, v)`` pair per earlier
    slice of the sequence (``[batch, l_j, heads, head_dim]`` each, in sequence order); ``None`` means no
    earlier slice. Each call appends its own ``(k, v)`` to ``produced``.
    """

    prefixes: Sequence[Sequence[tuple[jax.Array, jax.Array]]] | None = None
    produced: list[tuple[jax.Array, jax.Array]] = dataclasses.field(default_factory=list)
    prefix_valid: jax.Array | None = None
    """Shared executables for slices of one length and different contexts: the prefixes are left-padded
    to a common length ``P`` and only their last ``prefix_valid`` tokens (an int scalar, traced) are real;
    the padding is masked out of the attention (its probability is exactly 0). None: all tokens real."""


_SLICE: contextvars.ContextVar[TokenSliceContext | None] = contextvars.ContextVar("alpa_like_token_slice",
                                                                                   default=None)


@contextlib.contextmanager
def token_slice_context(context: TokenSliceContext) -> Iterator[TokenSliceContext]:
    """Within this block :func:`causal_self_attention` reads cached prefixes from ``context`` and records
    the keys and values it computes (the TeraPipe runtime's tracing hook; numerics are unchanged)."""
    token = _SLICE.set(context)
    try:
        yield context
    finally:
        _SLICE.reset(token)


def active_token_slice() -> TokenSliceContext | None:
    """The context of the innermost :func:`token_slice_context` block, or None."""
    return _SLICE.get()
