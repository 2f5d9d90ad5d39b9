"""Helpers shared by every kernel in the package: interpret default, padding, rounding, the mask value and
per-backend compiler params.

The Pallas backend follows the type of `compiler_params` (jax 0.10 to 0.12): `pltpu.CompilerParams` lowers with Mosaic
TPU, `pltriton.CompilerParams` with Triton on NVIDIA/AMD GPUs. In plain interpret mode (`interpret=True`) no params are
passed: the kernel runs as a scan over the grid on whatever backend is present (the only way to run it on CPU). With
`interpret=pltpu.InterpretParams()` the TPU interpreter runs the kernel on CPU with TPU semantics (VMEM scratch,
sequential grid axes, race detection), so the Mosaic params are passed there too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SUPPORTED_BACKENDS = ("tpu", "gpu")

# A large negative *finite* score for masked entries: a row or block that is fully masked then yields
# exp(MASK_VALUE - MASK_VALUE) = 1 or exp(MASK_VALUE - m) = 0, never inf - inf = nan.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def is_tpu_interpret(interpret) -> bool:
    """True for `pltpu.InterpretParams(...)`: run on CPU, but with the TPU kernel's layout and semantics."""
    return type(interpret).__name__ == "InterpretParams"


def resolve_backend(backend: str | None) -> str:
    """The platform the kernel is lowered for: `backend` if given, else JAX's default backend ("cpu", "gpu", "tpu")."""
    if backend is None:
        backend = jax.default_backend()
    backend = backend.lower()
    return "gpu" if backend in ("cuda", "rocm") else backend


def resolve_interpret(interpret, backend: str):
    """interpret=None means: interpret where there is no compiled Pallas backend (CPU). `pltpu.InterpretParams` is kept
    as it is (it selects the TPU interpreter); anything else becomes a bool."""
    if interpret is None:
        return backend not in SUPPORTED_BACKENDS
    if is_tpu_interpret(interpret):
        return interpret
    return bool(interpret)


def check_runnable(interpret: bool, backend: str, op: str) -> None:
    """An explicit non-interpret request on a backend without a Pallas lowering fails before tracing, with the fix."""
    if not interpret and backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"{op}: Pallas kernels compile only for {SUPPORTED_BACKENDS}, not backend={backend!r}; "
            "pass interpret=True (or None) to run the kernel body on CPU, or impl='xla'."
        )


def compiler_params(
    backend: str, interpret, dimension_semantics: tuple[str, ...], *, num_warps: int = 4, num_stages: int = 1
):
    """Backend-specific compiler params for pl.pallas_call.

    Mosaic TPU params for backend "tpu" and for the TPU interpreter (`pltpu.InterpretParams`, which reads the
    dimension semantics); Triton params for "gpu"; None in plain interpret mode.
    """
    if is_tpu_interpret(interpret) or (backend == "tpu" and not interpret):
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=dimension_semantics)
    if interpret:
        return None
    if backend == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    raise ValueError(f"no Pallas compiler params for backend={backend!r}")


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pad `x` along `axis` up to `size` (no copy when already that size)."""
    extra = size - x.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot pad axis {axis} of shape {x.shape} down to {size}")
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def padded_lanes(d: int, backend: str, interpret: bool) -> int:
    """Size the minor (feature) dim is padded to: a power of two for Triton, unchanged elsewhere (TPU accepts a full
    minor dim; interpret mode has no constraint)."""
    if backend == "gpu" and not interpret:
        return next_pow2(d)
    return d


def pallas_call(kernel, *, out_shape, **kwargs):
    """`pl.pallas_call` whose outputs vary over the manual mesh axes its operands vary over, so a kernel runs inside a
    `shard_map` that checks replication (`check_vma=True`) as well as outside one."""

    def call(*args):
        varying = [jax.typeof(a).manual_axis_type for a in jax.tree.leaves(args)
                   if getattr(jax.typeof(a), "manual_axis_type", None) is not None]
        widest = max(varying, key=lambda t: len(t.varying), default=None)

        def vary(s):
            if widest is None or not isinstance(s, jax.ShapeDtypeStruct) or s.manual_axis_type is not None:
                return s
            return jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=widest)

        shapes = jax.tree.map(vary, out_shape, is_leaf=lambda s: isinstance(s, jax.ShapeDtypeStruct))
        return pl.pallas_call(kernel, out_shape=shapes, **kwargs)(*args)

    return call
