"""Weight-only int8: int8 values with one fp32 scale per output channel, dequantised where the weight is used.

    w8 = quantize_int8(w_DxF, n_in=1)          # Int8Weight(q int8 [D, F], scale fp32 [1, F]); w ~ q * scale
    params8 = quantize_params(params)          # every matmul weight and embedding table of a GPT parameter tree
    y = dense(x, w8)                           # jaxperf.models.layers.dense multiplies by the scale after the matmul

The scheme is symmetric absmax calibration per output channel: scale = max|w| over the input (contracted) axes / 127
and q = round(w / scale) in [-127, 127]. Because every output channel has its own scale, the scale factors out of
the matmul: x @ (q * s) = (x @ q) * s, so `dense` multiplies the matmul's [.., out] result by s instead of
rebuilding the fp32 weight. Embedding tables are quantized per row (one scale per token or position), so a lookup
takes the int8 rows and their scales; the tied output projection (the table transposed) then has one scale per
vocabulary entry, which is again its output channel.

An `Int8Weight` stands where the fp32 array stood inside a parameter (`nnx.Param`), so the model reads it with
`self.w[...]` as usual; `[...]` and `.astype` return it unchanged and the layers that use weights (`dense` and
`embed_lookup` in layers.py) dequantise. Norm scales, biases and anything not listed in `QUANTIZED` stay in their
dtype: they are a small share of the bytes and their precision matters more.

Legend: D embed, F mlp, H heads, K kv heads, Dh head dim, V vocab, L positions, N layers (a leading stacked axis).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

QMAX = 127  # symmetric int8: -128 is never used, so q and -q are both representable

# Parameter name -> how many leading axes are contracted in `dense` (the input axes); "table" for embedding tables,
# which are read by row and contract their last axis when used as the tied output projection.
QUANTIZED: dict[str, int | str] = {
    "wq_DxHxDh": 1, "wk_DxKxDh": 1, "wv_DxKxDh": 1, "wo_HxDhxD": 2,
    "w_in_DxF": 1, "w_gate_DxF": 1, "w_out_FxD": 1, "head_DxV": 1,
    "embed_VxD": "table", "pos_LxD": "table",
}


@flax.struct.dataclass
class Int8Weight:
    """A weight as int8 values `q` and fp32 `scale` (q's shape with 1 on every contracted axis): w ~ q * scale."""

    q: jax.Array
    scale: jax.Array

    shape = property(lambda self: self.q.shape)
    ndim = property(lambda self: self.q.ndim)

    @property
    def T(self) -> "Int8Weight":  # noqa: N802 - the array attribute it stands in for
        return Int8Weight(self.q.T, self.scale.T)

    def __getitem__(self, index):
        if index is Ellipsis:  # `param[...]` reads the whole weight
            return self
        return Int8Weight(self.q[index], self.scale[index])

    def astype(self, dtype) -> "Int8Weight":
        """Unchanged: the weight is dequantised where it is used, in the dtype of the activations."""
        del dtype
        return self

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.scale.astype(jnp.float32)).astype(dtype)

    @property
    def nbytes(self) -> int:
        return int(self.q.size * self.q.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize)


nnx.register_data_type(Int8Weight)


def is_int8(x: Any) -> bool:
    return isinstance(x, Int8Weight)


def _reduced_axes(name: str, ndim: int) -> tuple[int, ...]:
    """The axes a weight's scale is shared over: its contracted axes (a leading stacked `layers` axis is a channel)."""
    rule = QUANTIZED[name]
    base = len(name.split("_")[-1].split("x"))  # wq_DxHxDh -> 3 named axes
    lead = ndim - base
    if lead not in (0, 1):
        raise ValueError(f"{name} has {ndim} axes; expected {base} (or {base + 1} with stacked layers)")
    if rule == "table":
        return (ndim - 1,)
    return tuple(range(lead, lead + int(rule)))


def quantize_int8(w: jax.Array, reduce_axes: tuple[int, ...]) -> Int8Weight:
    """Symmetric int8 with one scale per channel: the max |w| over `reduce_axes` maps to 127.

    An all-zero channel gets scale 1 (its values are 0 either way), so every scale is a positive finite number.
    """
    w32 = jnp.asarray(w, jnp.float32)
    absmax = jnp.max(jnp.abs(w32), axis=reduce_axes, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / QMAX, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(w32 / scale), -QMAX, QMAX).astype(jnp.int8)
    return Int8Weight(q, scale)


def _name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def quantize_params(params: Any) -> Any:
    """The same tree with every weight named in `QUANTIZED` replaced by an `Int8Weight` (others untouched)."""

    def one(path, x):
        name = _name(path)
        if name in QUANTIZED and not is_int8(x) and jnp.issubdtype(x.dtype, jnp.floating):
            return quantize_int8(x, _reduced_axes(name, len(x.shape)))
        return x

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_int8)


def scale_axes(axes: tuple | None, scale_shape: tuple[int, ...]) -> tuple | None:
    """The logical axes of a scale: the weight's, with None where the scale has a single entry (nothing to split)."""
    if axes is None:
        return None
    return tuple(None if d == 1 else a for a, d in zip(axes, scale_shape))


def tree_bytes(params: Any) -> int:
    """Bytes of a parameter tree as stored (int8 values and their scales counted as such)."""
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(params)))


def check_scales(params: Any) -> None:
    """ValueError naming the first weight whose scales are not all positive finite numbers (a damaged checkpoint)."""
    for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_int8)[0]:
        if not is_int8(x):
            continue
        s = np.asarray(jax.device_get(x.scale), np.float32)
        bad = ~(np.isfinite(s) & (s > 0))
        if bad.any():
            where = jax.tree_util.keystr(path)
            example = s[bad].reshape(-1)[0]
            raise ValueError(f"the int8 scales of {where} hold {int(bad.sum())} value(s) that are not positive finite "
                             f"numbers (e.g. {example}): the quantized checkpoint is damaged; quantize the run again")


__all__ = ["Int8Weight", "QUANTIZED", "check_scales", "is_int8", "quantize_int8", "quantize_params", "scale_axes",
           "tree_bytes"]
