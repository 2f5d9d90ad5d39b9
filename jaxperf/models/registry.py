"""One registry per op kind: every implementation of attention, the norms and the loss comes in by the same door.

    register("norm", "mine", fn, unavailable=lambda x, *, platform: None)
    fn = implementation("norm", cfg.norm_impl, x, platform=cfg.platform)     # raises with the reason if it cannot run

An implementation is called with the op's operands, its options and `platform=` (the one the program is built for,
the model config's settled `platform`; None for a config never settled). `unavailable(*operands, platform=)` returns
None when it can run there, else why not. What each op passes:

| op | fn | unavailable |
|---|---|---|
| attention | `fn(q, k, v, *, causal, segment_ids, platform)` -> out [B, L, H, Dh] | `(q, k, v, *, platform)` |
| norm | `fn(x, scale, bias, *, kind, eps, residual, platform)` -> normed (and x + residual when given) | `(x, *, platform)` |
| loss | `fn(model, batch, mask, *, platform)` -> (sum of token losses, unmasked tokens) | `(model, batch, *, platform)` |
| grouped_matmul | `fn(x [R, D], w [E, D, F], sizes [E], *, platform)` -> [R, F], rows sorted by group | `(x, w, *, platform)` |

"auto" is settled into the model config before anything is traced (jaxperf.models.platform.settle); in a config never
settled it is the portable choice, "xla". Built-in implementations are registered by the modules that define them:
attention in `attention.py` (xla, cudnn, pallas, ring), norms in `layers.py` (xla, pallas), the loss in `gpt.py` (xla,
chunked, pallas), the MoE layer's grouped matmul in `moe.py` (xla, tiled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

OPS = ("attention", "norm", "loss", "grouped_matmul")


@dataclass(frozen=True)
class _Impl:
    fn: Callable
    unavailable: Callable[..., str | None]


def _always(*operands, platform=None) -> None:
    return None


_REGISTRY: dict[str, dict[str, _Impl]] = {op: {} for op in OPS}


def register(op: str, name: str, fn: Callable, unavailable: Callable[..., str | None] | None = None) -> None:
    """Add `fn` as implementation `name` of `op` ("attention", "norm" or "loss"), chosen with `model.<op>_impl=name`
    (attention takes any registered name; the norm and loss fields list theirs in the config schema). Without
    `unavailable` it is taken to run everywhere."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops with implementations: {', '.join(OPS)}")
    _REGISTRY[op][name] = _Impl(fn, unavailable or _always)


def names(op: str) -> list[str]:
    """"auto" and every registered implementation of `op`."""
    return ["auto", *_REGISTRY[op]]


def implementation(op: str, name: str, *operands, platform: str | None) -> Callable:
    """The function of implementation `name` of `op` ("auto": "xla"), after asking it whether it can run on these
    operands and `platform`: ValueError for a name never registered, RuntimeError with its reason for one that cannot
    run."""
    impls = _REGISTRY[op]
    name = "xla" if name == "auto" else name
    if name not in impls:
        raise ValueError(f"unknown {op} impl {name!r}; registered: {', '.join(names(op))}")
    why = impls[name].unavailable(*operands, platform=platform)
    if why is not None:
        raise RuntimeError(f"{op} impl {name!r} cannot run here: {why}. Use impl='auto' or 'xla'.")
    return impls[name].fn
