"""The scanned layer stack under remat "full" with its weight gradients stacked in the compute dtype.

    y, stats = remat_full_scan(layer, state, x, (positions, segment_ids), grad_dtype=jnp.bfloat16)

`layer(state_i, x, *args) -> (y, stats)` is one layer on its parameters' slice; `state` holds every layer's parameters
stacked on a leading axis, `args` what every layer also reads and nothing differentiates (positions, segment ids).
The forward is `lax.scan` keeping each layer's input; the backward is a reverse scan that recomputes each layer from
its input and pulls its gradients back (what `jax.checkpoint` with remat "full" does).
The difference is the buffer the backward loop writes each layer's weight gradients into: autodiff's scan stacks
them in the parameters' dtype (fp32: the stacks of every layer's gradients, 1.5 GiB per chip for a Llama-2-7B over 16
chips, are live at the backward's peak), this one stacks in `grad_dtype` every gradient that is exactly
representable there by construction, and casts the stacks to the parameters' dtype after the loop. The values are
the same bits.

A weight used only through its cast to the compute dtype (`layers.to_compute`) has a gradient that is the cast back
of a compute-dtype value (the transpose of `convert_element_type`), or a rounding to its precision (the transpose of
`reduce_precision`); `exact_grads` finds those from the backward's own program: a gradient qualifies when the
operation that makes it is such a cast or rounding, seen through layout-only operations and nested jits. Anything
else (a norm scale used in fp32, the MoE router, a gradient summed over devices in fp32) keeps the parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# Operations that move or relabel values without computing new ones
_LAYOUT = {"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "copy", "copy_p",
           "sharding_constraint"}
_CALLS = {"pjit", "jit", "closed_call", "core_call"}


def _exact_in(jaxpr, var, dtype) -> bool:
    """Whether `var` of `jaxpr` holds values of `dtype` by construction (module docstring)."""
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    info = jnp.finfo(dtype)
    while True:
        try:
            eqn = producers.get(var)
        except TypeError:  # a literal
            return False
        if eqn is None:  # an input of this jaxpr
            return False
        name = eqn.primitive.name
        if name == "convert_element_type":
            return eqn.invars[0].aval.dtype == dtype
        if name == "reduce_precision":
            return eqn.params["exponent_bits"] <= info.nexp and eqn.params["mantissa_bits"] <= info.nmant
        if name in _LAYOUT:
            var = eqn.invars[0]
            continue
        if name in _CALLS:
            sub = eqn.params["jaxpr"]
            sub = getattr(sub, "jaxpr", sub)
            return _exact_in(sub, sub.outvars[eqn.outvars.index(var)], dtype)
        return False


def exact_grads(layer: Callable, state: Any, x: jax.Array, args: tuple, dtype) -> Any:
    """For each leaf of `state` (one layer's parameters, arrays or ShapeDtypeStructs): whether its gradient through
    `layer(state, x, *args) -> (y, stats)` is exactly representable in `dtype` by construction. Traced abstractly."""
    spec = lambda t: None if t is None else jax.ShapeDtypeStruct(t.shape, t.dtype)  # noqa: E731
    state, x, args = jax.tree.map(spec, (state, x, args))
    out = jax.eval_shape(layer, state, x, *args)

    def pull(s, x, args, ct):
        return jax.vjp(lambda s, x: layer(s, x, *args), s, x)[1](ct)[0]

    closed = jax.make_jaxpr(pull)(state, x, args, out)
    flat, tree = jax.tree.flatten(state)
    flags = [leaf.dtype != dtype and jnp.dtype(leaf.dtype).itemsize > jnp.dtype(dtype).itemsize
             and _exact_in(closed.jaxpr, v, dtype) for leaf, v in zip(flat, closed.jaxpr.outvars)]
    return jax.tree.unflatten(tree, flags)


def remat_full_scan(layer: Callable, state: Any, x: jax.Array, args: tuple = (), *, unroll: int = 1,
                    grad_dtype) -> tuple[Any, Any]:
    """`lax.scan` of `layer` over the stacked `state` from `x`: (the last layer's output, the stacked `stats`), with
    remat "full" and the weight gradients stacked in `grad_dtype` where that is exact (module docstring)."""
    one = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape[1:], t.dtype), state)
    cast = exact_grads(layer, one, x, args, grad_dtype)

    @jax.custom_vjp
    def run(state, x, args):
        return jax.lax.scan(lambda c, s: layer(s, c, *args), x, state, unroll=unroll)

    def run_fwd(state, x, args):
        def body(c, s):
            y, stats = layer(s, c, *args)
            return y, (c, stats)

        y, (inputs, stats) = jax.lax.scan(body, x, state, unroll=unroll)
        return (y, stats), (state, inputs, args)

    def run_bwd(res, ct):
        state, inputs, args = res
        dy, dstats = ct

        def body(g, per_layer):
            s, x, ds_stats = per_layer
            _, pull = jax.vjp(lambda s, x: layer(s, x, *args), s, x)
            ds, dx = pull((g, ds_stats))
            ds = jax.tree.map(lambda d, c: d.astype(grad_dtype) if c else d, ds, cast)
            return dx, ds

        dx, dstate = jax.lax.scan(body, dy, (state, inputs, dstats), reverse=True, unroll=unroll)
        return jax.tree.map(lambda d, p: d.astype(p.dtype), dstate, state), dx, jax.tree.map(lambda _: None, args)

    run.defvjp(run_fwd, run_bwd)
    return run(state, x, args)

