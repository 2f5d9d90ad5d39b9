"""Safetensors files read in slices and written one tensor at a time, so neither side ever holds a whole checkpoint.

    src = Checkpoint("path/to/model")              # model.safetensors, or the shards model.safetensors.index.json lists
    src.shapes["model.norm.weight"]                 # shapes and dtypes from the headers alone
    block = src.read("lm_head.weight", (slice(0, 64), slice(None)))   # only those rows come off the disk

    write_shards("out/", [(name, shape, produce), ...], max_shard_bytes=2 << 30)   # model-0000k-of-0000n.safetensors

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} and the raw
little-endian bytes of every tensor (https://github.com/huggingface/safetensors). Reading memory-maps each tensor and
copies out the requested slice; bfloat16 works here, unlike the `safetensors` package's numpy API. Writing lays out
the header from the shapes first, then asks for each tensor's values only when its bytes are due, so the host holds
one tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors dtype names <-> numpy dtypes (bfloat16 is ml_dtypes', the one JAX uses)
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(jnp.bfloat16)}
_NAMES = {v: k for k, v in DTYPES.items()}


class HFCheckpointError(ValueError):
    """A checkpoint jaxperf cannot represent exactly, or a malformed one; the message names the file, tensor or
    setting."""


def _header(path: str) -> tuple[dict, int]:
    """(header dict, byte offset where the data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise HFCheckpointError(f"{path} is shorter than a safetensors header (8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8:
            raise HFCheckpointError(f"{path}: header length {n} exceeds the file size {size}: the file is truncated")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise HFCheckpointError(f"{path}: the header is not JSON ({e})") from None
    return header, 8 + n


class Checkpoint:
    """Every tensor of a (possibly sharded) safetensors checkpoint directory: names, shapes and dtypes up front,
    values read in slices on demand."""

    def __init__(self, directory: str):
        index = os.path.join(directory, INDEX_NAME)
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise HFCheckpointError(
                f"no *.safetensors file in {directory}: save the model with save_pretrained(..., "
                f"safe_serialization=True) (PyTorch .bin checkpoints are not read)")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self._where: dict[str, tuple[str, int]] = {}  # name -> (file, absolute byte offset)
        for name in files:
            path = os.path.join(directory, name)
            header, start = _header(path)
            size = os.path.getsize(path)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                end = start + int(info["data_offsets"][1])
                if end > size:  # checked here: a memory map past the end would fail later, or fault on reading
                    raise HFCheckpointError(f"{path} is truncated: tensor {key} ends at byte {end} but the file has "
                                            f"{size} bytes; copy or download it again")
                self.shapes[key] = tuple(int(d) for d in info["shape"])
                self.dtypes[key] = info["dtype"]
                self._where[key] = (path, start + int(info["data_offsets"][0]))

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """Tensor `name`, or its block `index` (one slice per dim), as a fresh numpy array in the stored dtype."""
        path, offset = self._where[name]
        shape, kind = self.shapes[name], self.dtypes[name]
        if kind not in DTYPES:
            raise HFCheckpointError(f"tensor {name} in {path} is {kind}; jaxperf reads float checkpoints "
                                   f"({', '.join(DTYPES)})")
        if math.prod(shape) == 0:
            return np.zeros(shape, DTYPES[kind])[index or ()]
        mapped = np.memmap(path, dtype=DTYPES[kind], mode="r", offset=offset, shape=shape)
        try:
            return np.array(mapped[index or ()])
        finally:
            del mapped


def parse_size(size: int | str) -> int:
    """Bytes from an int or a Hugging Face style size string ("2GB", "500MB", "20KB", "1GiB")."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r}: write a number of bytes or e.g. '2GB', '500MB'")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_"))


Produce = Callable[[], np.ndarray]


def plan_shards(entries: Sequence[tuple[str, tuple[int, ...]]], itemsize: int, max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into files of at most `max_bytes` each, in order (a larger tensor gets a file alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in entries:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def write_file(path: str, tensors: Sequence[tuple[str, tuple[int, ...], Produce]], dtype: np.dtype,
               metadata: dict[str, str] | None = None) -> int:
    """Write one safetensors file; each `produce()` is called when its bytes are due and must return an array of the
    announced shape (cast to `dtype` here). Returns the bytes of tensor data written."""
    dtype = np.dtype(dtype)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, _ in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, produce in tensors:
            value = np.ascontiguousarray(produce(), dtype=dtype)
            if value.shape != tuple(shape):
                raise HFCheckpointError(f"tensor {name} came out with shape {value.shape}, announced {tuple(shape)}")
            f.write(value.reshape(-1).view(np.uint8).data)
            del value
    os.replace(tmp, path)
    return offset


def write_shards(directory: str, tensors: Sequence[tuple[str, tuple[int, ...], Produce]], dtype,
                 max_shard_bytes: int) -> list[str]:
    """model.safetensors, or model-0000k-of-0000n.safetensors plus model.safetensors.index.json when the tensors
    exceed `max_shard_bytes`; earlier model*.safetensors files and index in `directory` are removed first (a stale
    model.safetensors next to an index would be loaded instead of it). Returns the file names written."""
    dtype = np.dtype(dtype)
    for name in os.listdir(directory):
        if (name.startswith("model") and name.endswith(".safetensors")) or name == INDEX_NAME:
            os.remove(os.path.join(directory, name))
    by_name = {name: (name, shape, produce) for name, shape, produce in tensors}
    groups = plan_shards([(name, shape) for name, shape, _ in tensors], dtype.itemsize, max_shard_bytes)
    if len(groups) == 1:
        write_file(os.path.join(directory, SINGLE_NAME), tensors, dtype)
        return [SINGLE_NAME]
    files, weight_map, total = [], {}, 0
    for k, group in enumerate(groups, 1):
        file = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        total += write_file(os.path.join(directory, file), [by_name[n] for n in group], dtype)
        weight_map.update({n: file for n in group})
        files.append(file)
    with open(os.path.join(directory, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files
