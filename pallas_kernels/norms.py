"""RMSNorm and LayerNorm with an optional fused residual add: pure-jnp references and Pallas kernels (fwd and bwd).

    y = rms_norm(x_BxLxD, scale_D)                          # == jaxperf.models.layers.Norm(kind="rmsnorm")
    y, h = layer_norm(x_BxLxD, scale_D, bias_D, residual=r)  # h = x + r; y = layernorm(h)  (pre-norm Transformer)

Semantics are those of `jaxperf.models.layers.Norm`: math in fp32, output in x.dtype;
layernorm: h - mean(h), then * rsqrt(mean(.^2) + eps) * scale (+ bias); rmsnorm skips the mean subtraction.

The wrapper flattens leading dims into rows, pads rows up to a block multiple (and, for Triton, D up to a power of two;
padded feature columns are masked out of the statistics in the kernel). The backward kernel recomputes the statistics
from h (no [rows] residuals saved) and writes dx plus per-block partial sums of dscale / dbias; the last sum over
blocks is a tiny jnp reduction.

Legend: R rows (flattened leading dims), D features, nb number of row blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _util

_F32 = jnp.float32


_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class NormBlockSizes:
    """Tiling of the norm kernels: each grid step normalises `block_rows` full rows (the whole D in one tile).

    block_rows: rows per grid step; TPU wants a multiple of 8, Triton a power of two. Inputs with fewer rows use one
      block of the row count rounded up to a power of two (at least 8) instead.
    pad_features: pad D to a power of two and mask the padding out of the statistics in the kernel (Triton needs
      power-of-two blocks; on CPU it makes that path testable).
    """

    block_rows: int
    pad_features: bool = False

    @classmethod
    def get_default(cls, backend: str | None = None, dim: int | None = None) -> "NormBlockSizes":
        """Per-backend defaults ("cpu" = interpret mode, "gpu" = Triton, "tpu" = Mosaic; None: the default backend).

        `dim` (D) shrinks the blocks of wide rows: on TPU one fp32 block stays near 1 MiB of VMEM (the backward holds
        four double-buffered row blocks), on GPU a block stays near 8K elements so it fits in registers.
        """
        backend = _util.resolve_backend(backend)
        if backend == "tpu":
            rows = 256
            if dim is not None:
                rows = max(8, min(rows, (1 << 20) // (4 * dim) // 8 * 8))
            return cls(block_rows=rows)
        if backend == "gpu":
            rows = 16
            if dim is not None:
                rows = max(1, min(rows, 8192 // _util.next_pow2(dim)))
            return cls(block_rows=rows, pad_features=True)
        return cls(block_rows=64)  # interpret mode: fewer, larger grid steps run faster


# ----------------------------------------------------------------------------------------------------------------------
# References (the spec)


def _check(x, scale, bias, residual, op):
    """Shape checks shared by the references and the kernels (the kernels add dtype and tiling checks)."""
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x.shape={x.shape} needs a non-empty feature (last) dim D")
    d = x.shape[-1]
    if scale.shape != (d,):
        raise ValueError(f"{op}: scale.shape={scale.shape} must be (D,)=({d},) for x.shape={x.shape}")
    if bias is not None and bias.shape != (d,):
        raise ValueError(f"{op}: bias.shape={bias.shape} must be (D,)=({d},) for x.shape={x.shape}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"{op}: residual.shape={residual.shape} must equal x.shape={x.shape}")


def _add_residual(x, residual):
    """h = x + residual, summed in fp32 and rounded once to the promoted dtype (what an XLA add in that dtype gives)."""
    dt = jnp.result_type(x.dtype, residual.dtype)
    return (x.astype(_F32) + residual.astype(_F32)).astype(dt)


def _reference(x, scale, bias, eps, residual, layer):
    h = x if residual is None else _add_residual(x, residual)
    v = h.astype(_F32)
    if layer:
        v = v - jnp.mean(v, axis=-1, keepdims=True)
    v = v * jax.lax.rsqrt(jnp.mean(jnp.square(v), axis=-1, keepdims=True) + eps)
    lift = (1,) * (v.ndim - 1)
    v = v * scale.astype(_F32).reshape(lift + scale.shape)
    if bias is not None:
        v = v + bias.astype(_F32).reshape(lift + bias.shape)
    out = v.astype(x.dtype)
    return out if residual is None else (out, h)


def rms_norm_reference(x, scale, *, eps: float = 1e-5, residual=None):
    """RMSNorm in pure jnp (fp32 math). Returns norm(x), or (norm(h), h) with h = x + residual."""
    _check(x, scale, None, residual, "rms_norm_reference")
    return _reference(x, scale, None, eps, residual, layer=False)


def layer_norm_reference(x, scale, bias=None, *, eps: float = 1e-5, residual=None):
    """LayerNorm in pure jnp (fp32 math). Returns norm(x), or (norm(h), h) with h = x + residual."""
    _check(x, scale, bias, residual, "layer_norm_reference")
    return _reference(x, scale, bias, eps, residual, layer=True)


# ----------------------------------------------------------------------------------------------------------------------
# Kernels


def _normalize(h, *, layer, eps, d):
    """(xhat, rstd) of an fp32 [rows, Dp] tile whose columns >= d are padding."""
    dp = h.shape[-1]
    if layer:
        hc = h - jnp.sum(h, axis=-1, keepdims=True) / d
        if dp != d:
            col = jax.lax.broadcasted_iota(jnp.int32, h.shape, 1)
            hc = jnp.where(col < d, hc, 0.0)
    else:
        hc = h  # padded columns hold zeros
    rstd = jax.lax.rsqrt(jnp.sum(hc * hc, axis=-1, keepdims=True) / d + eps)
    return hc * rstd, rstd


def _fwd_kernel(*refs, layer, eps, d, has_residual, has_bias):
    refs = list(refs)
    x_ref = refs.pop(0)
    r_ref = refs.pop(0) if has_residual else None
    s_ref = refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    o_ref = refs.pop(0)
    h_ref = refs.pop(0) if has_residual else None

    h = x_ref[...]
    if has_residual:
        h = (h.astype(_F32) + r_ref[...].astype(_F32)).astype(h_ref.dtype)
        h_ref[...] = h
    xhat, _ = _normalize(h.astype(_F32), layer=layer, eps=eps, d=d)
    y = xhat * s_ref[...].astype(_F32)
    if has_bias:
        y = y + b_ref[...].astype(_F32)
    o_ref[...] = y.astype(o_ref.dtype)


def _bwd_kernel(*refs, layer, eps, d, has_residual, has_bias):
    refs = list(refs)
    h_ref, g_ref = refs.pop(0), refs.pop(0)
    gh_ref = refs.pop(0) if has_residual else None
    s_ref = refs.pop(0)
    dx_ref, ds_ref = refs.pop(0), refs.pop(0)
    db_ref = refs.pop(0) if has_bias else None

    xhat, rstd = _normalize(h_ref[...].astype(_F32), layer=layer, eps=eps, d=d)
    g = g_ref[...].astype(_F32)
    dxhat = g * s_ref[...].astype(_F32)
    proj = jnp.sum(dxhat * xhat, axis=-1, keepdims=True) / d
    inner = dxhat - xhat * proj
    if layer:
        inner = inner - jnp.sum(dxhat, axis=-1, keepdims=True) / d
    dx = rstd * inner
    if has_residual:
        dx = dx + gh_ref[...].astype(_F32)  # h is also an output: its cotangent flows straight back to x and residual
    dx_ref[...] = dx.astype(dx_ref.dtype)
    ds_ref[...] = jnp.sum(g * xhat, axis=0, keepdims=True)  # padded rows have g = 0
    if has_bias:
        db_ref[...] = jnp.sum(g, axis=0, keepdims=True)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    layer: bool
    eps: float
    d: int
    block_rows: int
    pad_features: bool
    interpret: object  # bool, or pltpu.InterpretParams (the TPU interpreter)
    backend: str
    x_dtype: str  # dtypes of x and residual (None without one): the cotangents must come back in them
    r_dtype: str | None


def _compiler_params(cfg: _Cfg, dp: int):
    # Wide rows on Triton: more warps share the row reductions.
    return _util.compiler_params(cfg.backend, cfg.interpret, ("parallel",), num_warps=8 if dp >= 2048 else 4)


def _specs(cfg: _Cfg, rows_p: int, dp: int):
    br = cfg.block_rows
    row = pl.BlockSpec((br, dp), lambda i: (i, 0))
    vec = pl.BlockSpec((1, dp), lambda i: (0, 0))
    part = pl.BlockSpec((pl.squeezed, 1, dp), lambda i: (i, 0, 0))
    return row, vec, part, rows_p // br


def _fwd_call(cfg: _Cfg, h_in, r_in, scale2, bias2):
    """h_in, r_in: [Rp, Dp] (r_in may be None); scale2, bias2: [1, Dp]. Returns out [Rp, Dp] (and h if residual)."""
    rows_p, dp = h_in.shape
    row, vec, _, nb = _specs(cfg, rows_p, dp)
    has_residual, has_bias = r_in is not None, bias2 is not None
    args, in_specs = [h_in], [row]
    if has_residual:
        args.append(r_in)
        in_specs.append(row)
    args.append(scale2)
    in_specs.append(vec)
    if has_bias:
        args.append(bias2)
        in_specs.append(vec)
    out_shape = [jax.ShapeDtypeStruct((rows_p, dp), h_in.dtype)]
    if has_residual:
        out_shape.append(jax.ShapeDtypeStruct((rows_p, dp), jnp.result_type(h_in.dtype, r_in.dtype)))
    kernel = functools.partial(_fwd_kernel, layer=cfg.layer, eps=cfg.eps, d=cfg.d,
                               has_residual=has_residual, has_bias=has_bias)
    return _util.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(nb,),
        in_specs=in_specs,
        out_specs=[row] * len(out_shape),
        compiler_params=_compiler_params(cfg, dp),
        interpret=cfg.interpret,
        name="layer_norm_fwd" if cfg.layer else "rms_norm_fwd",
    )(*args)


def _bwd_call(cfg: _Cfg, h, g, gh, scale2, has_bias):
    """Returns dh [Rp, Dp] (h.dtype) and fp32 per-block partials dscale [nb, 1, Dp] (and dbias)."""
    rows_p, dp = h.shape
    row, vec, part, nb = _specs(cfg, rows_p, dp)
    has_residual = gh is not None
    args, in_specs = [h, g], [row, row]
    if has_residual:
        args.append(gh)
        in_specs.append(row)
    args.append(scale2)
    in_specs.append(vec)
    out_shape = [jax.ShapeDtypeStruct((rows_p, dp), h.dtype), jax.ShapeDtypeStruct((nb, 1, dp), _F32)]
    out_specs = [row, part]
    if has_bias:
        out_shape.append(jax.ShapeDtypeStruct((nb, 1, dp), _F32))
        out_specs.append(part)
    kernel = functools.partial(_bwd_kernel, layer=cfg.layer, eps=cfg.eps, d=cfg.d,
                               has_residual=has_residual, has_bias=has_bias)
    return _util.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(nb,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=_compiler_params(cfg, dp),
        interpret=cfg.interpret,
        name="layer_norm_bwd" if cfg.layer else "rms_norm_bwd",
    )(*args)


# ----------------------------------------------------------------------------------------------------------------------
# custom_vjp over 2-D padded operands: (x, residual | None, scale, bias | None) -> (out, h | None)


def _pad2(a, rows_p, dp):
    return _util.pad_axis(_util.pad_axis(a, 0, rows_p), 1, dp)


def _vec2(v, dp):
    return None if v is None else _util.pad_axis(v.reshape(1, -1), 1, dp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm2d(cfg: _Cfg, x, residual, scale, bias):
    return _norm2d_fwd(cfg, x, residual, scale, bias)[0]


def _norm2d_fwd(cfg: _Cfg, x, residual, scale, bias):
    rows, d = x.shape
    rows_p, dp = _util.round_up(rows, cfg.block_rows), (_util.next_pow2(d) if cfg.pad_features else d)
    x_p = _pad2(x, rows_p, dp)
    r_p = None if residual is None else _pad2(residual, rows_p, dp)
    outs = _fwd_call(cfg, x_p, r_p, _vec2(scale, dp), _vec2(bias, dp))
    out = outs[0][:rows, :d]
    h_p = outs[1] if residual is not None else x_p
    h = None if residual is None else h_p[:rows, :d]
    return (out, h), (h_p, scale, bias)


def _norm2d_bwd(cfg: _Cfg, res, cts):
    h_p, scale, bias = res
    g_out, g_h = cts
    rows, d = g_out.shape
    rows_p, dp = h_p.shape
    g_p = _pad2(g_out, rows_p, dp)
    gh_p = None if cfg.r_dtype is None else _pad2(g_h, rows_p, dp)
    outs = _bwd_call(cfg, h_p, g_p, gh_p, _vec2(scale, dp), bias is not None)
    dh = outs[0][:rows, :d]
    dscale = jnp.sum(outs[1], axis=(0, 1))[:d].astype(scale.dtype)
    dbias = None if bias is None else jnp.sum(outs[2], axis=(0, 1))[:d].astype(bias.dtype)
    dx = dh.astype(cfg.x_dtype)
    dres = None if cfg.r_dtype is None else dh.astype(cfg.r_dtype)
    return dx, dres, dscale, dbias


_norm2d.defvjp(_norm2d_fwd, _norm2d_bwd)


# ----------------------------------------------------------------------------------------------------------------------
# Public API


def _dtype_problem(x, scale, bias, residual) -> str | None:
    for name, a in (("x", x), ("scale", scale), ("bias", bias), ("residual", residual)):
        if a is not None and jnp.dtype(a.dtype).name not in _SUPPORTED_DTYPES:
            return f"{name}.dtype={jnp.dtype(a.dtype).name} is not supported (one of {_SUPPORTED_DTYPES})"
    return None


def unavailable_reason(x, scale=None, bias=None, residual=None, *, interpret: bool | None = None,
                       backend: str | None = None) -> str | None:
    """Why the Pallas norm cannot run for these operands here, or None when it can (shapes are checked by the call)."""
    backend = _util.resolve_backend(backend)
    interpret = _util.resolve_interpret(interpret, backend)
    if not interpret and backend not in _util.SUPPORTED_BACKENDS:
        return f"Pallas norms compile only for {_util.SUPPORTED_BACKENDS}, backend is {backend!r} (use interpret=True)"
    if x.ndim < 1 or x.shape[-1] == 0:
        return f"x.shape={x.shape} has no feature dim"
    return _dtype_problem(x, scale, bias, residual)


def _fit_block_rows(bs: NormBlockSizes, rows: int, d: int, backend: str, interpret: bool, op: str) -> int:
    """Check the tiling for this backend and shrink the block to small inputs."""
    br = bs.block_rows
    if not isinstance(br, int) or br <= 0:
        raise ValueError(f"{op}: NormBlockSizes.block_rows={br!r} must be a positive int")
    if not interpret and backend == "tpu" and br % 8:
        raise ValueError(f"{op}: NormBlockSizes.block_rows={br} must be a multiple of 8 on TPU (e.g. {_util.round_up(br, 8)})")
    if not interpret and backend == "gpu":
        if br & (br - 1):
            raise ValueError(f"{op}: NormBlockSizes.block_rows={br} must be a power of two for Triton "
                             f"(e.g. {_util.next_pow2(br)})")
        if not bs.pad_features and d & (d - 1):
            raise ValueError(f"{op}: D={d} is not a power of two, which Triton needs: use "
                             "NormBlockSizes(..., pad_features=True) to pad and mask it")
    # Small inputs: one block of the row count rounded up to a power of two (Triton) and to >= 8 rows (TPU sublanes),
    # instead of a mostly empty full-size block.
    return min(br, max(8, _util.next_pow2(rows)))


def _norm(x, scale, bias, eps, residual, block_sizes, interpret, backend, layer, op):
    _check(x, scale, bias, residual, op)
    problem = _dtype_problem(x, scale, bias, residual)
    if problem is not None:
        raise ValueError(f"{op}: {problem}; cast the inputs or use impl='xla'")
    backend = _util.resolve_backend(backend)
    interpret = _util.resolve_interpret(interpret, backend)
    _util.check_runnable(interpret, backend, op)
    d = x.shape[-1]
    rows = x.size // d
    bs = block_sizes or NormBlockSizes.get_default(backend, dim=d)
    block_rows = _fit_block_rows(bs, rows, d, backend, interpret, op)
    if rows == 0:  # nothing to normalise: no kernel launch over an empty grid
        return _reference(x, scale, bias, eps, residual, layer)
    r_dtype = None if residual is None else jnp.dtype(residual.dtype).name
    cfg = _Cfg(layer, float(eps), d, block_rows, bs.pad_features, interpret, backend, jnp.dtype(x.dtype).name, r_dtype)
    out, h = _norm2d(cfg, x.reshape(rows, d), None if residual is None else residual.reshape(rows, d), scale, bias)
    out = out.reshape(x.shape)
    return out if residual is None else (out, h.reshape(x.shape))


def rms_norm(x, scale, *, eps: float = 1e-5, residual=None, block_sizes: NormBlockSizes | None = None,
             interpret: bool | None = None, impl: str = "pallas", backend: str | None = None):
    """RMSNorm over the last dim, optionally fused with a residual add.

    Args:
      x: [..., D] float32, bfloat16 or float16. scale: [D]. residual: optional, same shape as x.
      eps: added to mean(x^2). block_sizes: tiling (default per backend). interpret: None = True on CPU.
      impl: "pallas" (the kernel) or "xla" (the reference). backend: lowering target, default jax.default_backend().
    Returns:
      out [..., D] in x.dtype; with `residual`: (out, h) where h = x + residual and out = rms_norm(h).

    Example: `y, h = rms_norm(x, scale, residual=attn_out)`.
    """
    if impl == "xla":
        return rms_norm_reference(x, scale, eps=eps, residual=residual)
    if impl != "pallas":
        raise ValueError(f"rms_norm: impl={impl!r} must be 'pallas' or 'xla'")
    return _norm(x, scale, None, eps, residual, block_sizes, interpret, backend, False, "rms_norm")


def layer_norm(x, scale, bias=None, *, eps: float = 1e-5, residual=None, block_sizes: NormBlockSizes | None = None,
               interpret: bool | None = None, impl: str = "pallas", backend: str | None = None):
    """LayerNorm over the last dim (mean subtracted, then scale and optional bias), optionally fused with a residual.

    Args and Returns as `rms_norm`, plus bias: optional [D].
    """
    if impl == "xla":
        return layer_norm_reference(x, scale, bias, eps=eps, residual=residual)
    if impl != "pallas":
        raise ValueError(f"layer_norm: impl={impl!r} must be 'pallas' or 'xla'")
    return _norm(x, scale, bias, eps, residual, block_sizes, interpret, backend, True, "layer_norm")
