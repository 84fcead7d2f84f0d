"""`al.grad` and `al.value_and_grad`: drop-in `jax.grad` that tells the compiler where gradients are.

They compute exactly what `jax.grad` / `jax.value_and_grad` compute. In addition they mark the
differentiated arguments as parameters and the results as the end of compute-grad (see
:mod:`alpa_like.compiler.markers`), which gradient accumulation, the ZeRO methods and pipeline planning use;
and while a pipeline method traces the step they cut the loss into layers
(:mod:`alpa_like.compiler.layer_construction`).
Plain `jax.grad` inside a step also works for single-micro-batch methods; accumulation needs these.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax

from alpa_like.compiler.layer_construction import active_layering, construct_layers
from alpa_like.compiler.markers import mark
from alpa_like.compiler.tracing_hooks import active_grad_hook




def _mark_argnums(args: tuple, argnums: int | Sequence[int]) -> tuple:
    indices = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for i in indices:
        if not -len(args) <= i < len(args):
            raise ValueError(f"argnums={argnums!r} is out of range for a function called with {len(args)} arguments")
    indices = {i % len(args) for i in indices}
    return tuple(mark(a, "param") if i in indices else a for i, a in enumerate(args))


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   **jax_kwargs) -> Callable:
    """Like `jax.value_and_grad`; the returned value, aux and gradients pass through the grad marker.

    With ``num_micro_batches > 1`` the step runs everything up to this call once per micro-batch and
    averages what it returns (value, aux and gradients) over the micro-batches, as Alpa does: for a loss
    that is a mean over the batch this equals the full-batch value and gradient; a loss that sums over the
    batch comes out ``1/num_micro_batches`` of the full-batch sum (the compiler warns where it sees one).
    A per-example aux (the micro-batch's rows in dim 0, e.g. logits) comes back with the full batch's rows
    in order instead; any other aux must be floating point. See docs/micro-batches.md.
    """
    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        hook = active_grad_hook()
        if hook is not None:
            return hook(fun, args, kwargs, argnums=argnums, has_aux=has_aux, with_value=True, jax_kwargs=jax_kwargs)
        inner = jax.value_and_grad(_layered(fun), argnums=argnums, has_aux=has_aux, **jax_kwargs)
        out = inner(*_mark_argnums(args, argnums), **kwargs)
        return mark(out, "grad", names=result_names(out, with_value=True, has_aux=has_aux))

    return wrapped


def result_names(out, *, with_value: bool, has_aux: bool) -> tuple[str, ...]:
    """The name of every leaf of what ``al.value_and_grad`` (``with_value``) or ``al.grad`` returns, as the
    user unpacks it: ``value``, ``aux``, ``aux[1]``, ``aux['logits']``, ``grads['dense']['kernel']``."""
    roots = {(True, True): {(0, 0): "value", (0, 1): "aux", (1,): "grads"},
             (True, False): {(0,): "value", (1,): "grads"},
             (False, True): {(0,): "grads", (1,): "aux"},
             (False, False): {(): "grads"}}[with_value, has_aux]
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(out)[0]:
        positions = tuple(getattr(key, "idx", None) for key in path)
        prefix = next(p for p in roots if positions[:len(p)] == p)
        names.append(roots[prefix] + jax.tree_util.keystr(path[len(prefix):]))
    return tuple(names)


def _layered(fun: Callable) -> Callable:
    """``fun`` cut into pipeline layers when a pipeline method is tracing the step, else ``fun``."""
    option = active_layering()
    return fun if option is None else construct_layers(fun, option.assign, remat=option.remat)


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, **jax_kwargs) -> Callable:
    """Like `jax.grad`; see :func:`value_and_grad` for what the markers add."""
    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        hook = active_grad_hook()
        if hook is not None:
            return hook(fun, args, kwargs, argnums=argnums, has_aux=has_aux, with_value=False, jax_kwargs=jax_kwargs)
        inner = jax.grad(_layered(fun), argnums=argnums, has_aux=has_aux, **jax_kwargs)
        out = inner(*_mark_argnums(args, argnums), **kwargs)
        return mark(out, "grad", names=result_names(out, with_value=False, has_aux=has_aux))

    return wrapped
