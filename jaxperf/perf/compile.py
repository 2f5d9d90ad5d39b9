"""Compile once: the persistent compilation cache, ahead-of-time compilation, and saving compiled programs.

    enable_compilation_cache("~/.cache/jaxperf/xla")     # later runs of the same programs skip XLA compilation
    compiled, seconds = aot_compile(step, state, batch)   # lower + compile now, not at the first call
    export_fn(step, state, batch, path="step.jax")        # the program as StableHLO bytes (jax.export)
    f = load_exported("step.jax"); outs = f(state, batch) # run it again, in another process, without the Python code
    export_forward(model, batch=8, seq_len=128, path="gpt.jax")   # the GPT forward pass

`jax.jit` traces and compiles at the first call; `aot_compile` does it up front so compile time is measured apart
(and a shape error shows before the run starts). The persistent cache keys compiled executables by program, jax
version and device, so a second process with the same program loads it from disk.

`jax.export` serialises the lowered program (StableHLO plus calling convention and shardings), not the Python code:
the symbolic counterpart of "hybridize and save" - the saved file runs without the model's source. Serialisation needs
the `flatbuffers` package. Pytree containers other than tuples, lists, dicts and None (e.g. a TrainState dataclass)
cannot be serialised, so such functions are exported over their flattened leaves: the loaded function then takes the
same arguments (it flattens them) and returns the flat list of output leaves (`LoadedFunction.flat`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

log = logging.getLogger(__name__)

_CACHE_DIR: str | None = None


def enable_compilation_cache(path: str | os.PathLike, *, min_compile_time_s: float = 0.0,
                             min_entry_size_bytes: int = 0) -> str:
    """Turn on JAX's persistent compilation cache in `path` (created if needed); returns the absolute path.

    The thresholds default to 0 so small programs are cached too (JAX's defaults skip programs that compile in under
    a second). Calling it again with the same path does nothing; with another path, the cache moves there.
    """
    global _CACHE_DIR
    path = str(Path(path).expanduser().resolve())
    if _CACHE_DIR == path and jax.config.jax_compilation_cache_dir == path:
        return path
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    try:  # the cache object is created once per process; make a moved directory take effect
        from jax._src import compilation_cache as _cc

        _cc.reset_cache()
    except Exception:  # noqa: BLE001 - private API; without it a new path applies from the next process
        pass
    _CACHE_DIR = path
    log.info("persistent compilation cache at %s", path)
    return path


def aot_compile(jitted: Callable, *args, **kwargs) -> tuple[Any, float]:
    """Lower and compile `jitted` (a `jax.jit` function) for these arguments (arrays or ShapeDtypeStructs).

    Returns (compiled, seconds). The compiled program is called like the function with arrays of the same shapes,
    dtypes and shardings; other shapes raise instead of recompiling.
    """
    if not hasattr(jitted, "lower"):
        raise TypeError(f"aot_compile wants a jax.jit-ed function, got {type(jitted).__name__}: pass jax.jit(f)")
    t0 = time.perf_counter()
    compiled = jitted.lower(*args, **kwargs).compile()
    seconds = time.perf_counter() - t0
    log.info("compiled %s in %.2f s", getattr(jitted, "__name__", "function"), seconds)
    return compiled, seconds


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


_PLAIN = (tuple, list, dict, type(None))


def _only_plain(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) for k in x) and all(_only_plain(v) for v in x.values())
    if isinstance(x, (tuple, list)):
        return type(x) in (tuple, list) and all(_only_plain(v) for v in x)
    return x is None or hasattr(x, "shape")


def export_fn(fn: Callable, *args, path: str | os.PathLike | None = None, platforms=None):
    """Export `fn` (jitted or not) for these arguments with `jax.export`, and write it to `path` if given.

    Returns the `jax.export.Exported`. Functions whose arguments or results hold custom pytree nodes are exported
    over flat leaves (see the module docstring); a small `<path>.json` next to the file records which.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    abstract = jax.tree.map(_abstract, args)
    out_shape = jax.eval_shape(jitted, *args)
    flat = not (_only_plain(list(args)) and _only_plain(out_shape))
    if flat:
        in_tree = jax.tree.structure(tuple(args))

        def flat_fn(*leaves):
            return jax.tree.leaves(jitted(*jax.tree.unflatten(in_tree, leaves)))

        exported = jax.export.export(jax.jit(flat_fn), platforms=platforms)(*jax.tree.leaves(abstract))
    else:
        exported = jax.export.export(jitted, platforms=platforms)(*abstract)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            blob = exported.serialize()
        except ImportError as e:
            raise ImportError(f"saving an exported program needs the flatbuffers package: pip install flatbuffers "
                              f"({e})") from e
        path.write_bytes(bytes(blob))
        Path(str(path) + ".json").write_text(json.dumps({"flat": flat, "in_leaves": len(jax.tree.leaves(args)),
                                                         "jax": jax.__version__}))
    return exported


class LoadedFunction:
    """A deserialised program. Call it like the exported function; `.exported` is the `jax.export.Exported`."""

    def __init__(self, exported, flat: bool):
        self.exported = exported
        self.flat = flat

    def __call__(self, *args):
        if self.flat:
            leaves = jax.tree.leaves(args)
            if len(leaves) != len(self.exported.in_avals):
                raise TypeError(f"the exported program takes {len(self.exported.in_avals)} array leaves, got "
                                f"{len(leaves)}: pass arguments shaped like those given to export_fn")
            return self.exported.call(*leaves)
        return self.exported.call(*args)


def load_exported(path: str | os.PathLike) -> LoadedFunction:
    """Read a program written by `export_fn`/`export_forward` and return it as a callable."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no exported program at {path}: write one with export_fn(fn, *args, path=...)")
    meta_path = Path(str(path) + ".json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"flat": False}
    exported = jax.export.deserialize(bytearray(path.read_bytes()))
    return LoadedFunction(exported, bool(meta.get("flat")))


def export_forward(model, *, batch: int, seq_len: int, path: str | os.PathLike | None = None,
                   with_params: bool = False):
    """Export the forward pass `tokens [batch, seq_len] int32 -> logits` of a Flax NNX model (e.g. jaxperf's GPT).

    with_params=False: the program takes (params, tokens), params being `nnx.to_pure_dict(nnx.state(model,
      nnx.Param))` - the file holds the program only and works with any checkpoint of the same architecture.
    with_params=True: the weights are baked into the program as constants and it takes tokens only (a
      self-contained "saved model"; the file grows by the size of the weights).
    Returns the Exported; with `path`, also writes it (load with `load_exported`).
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    pure = nnx.to_pure_dict(params)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)

    def forward(p, tokens_BxL):
        template = jax.tree.map(lambda x: x, params)
        nnx.replace_by_pure_dict(template, p)
        return nnx.merge(graphdef, template, rest)(tokens_BxL)

    if with_params:
        return export_fn(jax.jit(lambda t: forward(pure, t)), tokens, path=path)
    return export_fn(jax.jit(forward), pure, tokens, path=path)


def forward_params(model) -> Any:
    """The `params` argument of a program exported by `export_forward(model, with_params=False)`."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))
