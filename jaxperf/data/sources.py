"""Where tokens come from: the default corpus (this Python's standard library), text files, and token `.bin` files.

A `source` string is one of
    "stdlib"             the `.py` files of the running Python's standard library (always present, no download)
    "notes.txt"          one text file
    "data/*.txt"         a glob (sorted; `**` recurses)
    "train.bin"          a nanoGPT-style flat token file, uint16 ids (memory-mapped, never copied)
    "train.bin:uint32"   the same with uint32 ids

Text sources are joined in sorted file order with one "\n" between files and tokenized; with `cache_dir` the tokens are
kept as .npy, keyed by the file list, sizes, mtimes, tokenizer and `max_bytes`, so the second load is instant.
"""

from __future__ import annotations

import codecs
import functools
import glob
import hashlib
import os
import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
_BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[pathlib.Path, ...]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        if _EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1]) or not p.is_file():
            continue
        try:
            p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(p)
    return tuple(files)


def stdlib_corpus_files() -> list[pathlib.Path]:
    """The default corpus: the standard library's `.py` files, sorted.

    Excludes `site-packages`, test directories (`test/`, `tests/`, `idlelib/idle_test/`) and files that are not UTF-8.

    Returns:
        absolute paths in a deterministic (sorted) order.
    """
    return list(_stdlib_files())


def _parse_bin(source: str) -> tuple[str, np.dtype] | None:
    """("path", dtype) when `source` names a token .bin file, else None."""
    path, dtype = source, "uint16"
    head, sep, tail = source.rpartition(":")
    has_suffix = bool(sep) and tail in _BIN_DTYPES
    if has_suffix:
        path, dtype = head, tail
    if not path.endswith(".bin"):
        if has_suffix:
            raise ValueError(f"{source!r}: a ':{dtype}' suffix is only meaningful for a token .bin file")
        return None
    return path, np.dtype(_BIN_DTYPES[dtype])


def _text_files(source: str) -> list[pathlib.Path]:
    if source == "stdlib":
        return stdlib_corpus_files()
    if glob.has_magic(source):
        files = sorted(pathlib.Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
        files = [p for p in files if p.is_file()]
        if not files:
            raise ValueError(f"the glob {source!r} matches no files (cwd {os.getcwd()}); check the pattern and path")
        return files
    path = pathlib.Path(source).expanduser()
    if path.is_dir():
        raise ValueError(f"{source!r} is a directory; pass a glob such as '{source.rstrip('/')}/*.txt'")
    if not path.is_file():
        raise ValueError(f"no such file {source!r}; pass 'stdlib', a text file, a glob, or a token .bin file")
    return [path]


def corpus_texts(source: str, max_bytes: int | None = None) -> Iterator[str]:
    """The text pieces of a text source, one per file, whose concatenation is the corpus.

    Every piece but the last ends with the "\n" that separates files; with `max_bytes` the pieces stop after a prefix
    of that many UTF-8 bytes (a character cut in half at the end is dropped). Used to train BPE and by `load_tokens`.

    Args:
        source: "stdlib", a text file or a glob (see the module docstring); .bin files hold no text.
        max_bytes: keep only this many bytes of the concatenation.

    Returns:
        an iterator of strings.
    """
    if _parse_bin(source) is not None:
        raise ValueError(f"{source!r} is a token file and holds no text; train BPE on a text source instead")
    files = _text_files(source)
    budget = max_bytes
    for i, path in enumerate(files):
        data = path.read_bytes()
        if i + 1 < len(files):
            data += b"\n"
        if budget is not None:
            data = data[:budget]
            budget -= len(data)
        # A non-final incremental decode holds back (here: drops) a character that the byte budget cut in half.
        yield codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=budget != 0)
        if budget == 0:
            return


def source_fingerprint(source: str, max_bytes: int | None = None) -> str:
    """A hash of a source's file list, sizes and mtimes (and `max_bytes`): it changes when the data may have changed.

    Useful as `get_tokenizer(..., cache_key=source_fingerprint(source))`.
    """
    parsed = _parse_bin(source)
    files = [pathlib.Path(parsed[0])] if parsed else _text_files(source)
    h = hashlib.sha256(f"max_bytes={max_bytes}".encode())
    for p in files:
        st = p.stat()
        h.update(f"|{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _load_bin(path: str, dtype: np.dtype, tokenizer) -> np.ndarray:
    if not os.path.isfile(path):
        raise ValueError(f"no such token file {path!r}")
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        fits = [name for name, d in _BIN_DTYPES.items() if size % np.dtype(d).itemsize == 0]
        hint = f"'{path}:{fits[0]}' ({fits[0]}) would fit" if fits else "no supported dtype fits: is it truncated?"
        raise ValueError(
            f"{path!r} has {size} bytes, not a multiple of {dtype.itemsize} ({dtype.name}): likely the wrong dtype; "
            f"{hint}"
        )
    if size == 0:
        raise ValueError(f"token file {path!r} is empty")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    max_id = int(tokens.max())
    if max_id >= tokenizer.vocab_size:
        raise ValueError(
            f"{path!r} holds token id {max_id} but the {tokenizer.name} tokenizer has vocab_size="
            f"{tokenizer.vocab_size}; use the tokenizer the file was made with (or the right dtype)"
        )
    return tokens


def load_tokens(source: str, tokenizer, *, cache_dir: str | None = None, max_bytes: int | None = None) -> np.ndarray:
    """Tokens of a source as one flat array.

    Args:
        source: "stdlib", a text file, a glob, or "file.bin[:uint16|uint32]" (see the module docstring).
        tokenizer: any jaxperf tokenizer (used to encode text, and to check the ids of a .bin file).
        cache_dir: where tokenized text is kept as `tokens-<hash>.npy`; None disables caching.
        max_bytes: text sources only: tokenize just this prefix of the concatenated corpus.

    Returns:
        a 1-D array of ids: uint16 if `tokenizer.vocab_size <= 65536` else uint32. A .bin source comes back as a
        read-only memmap in the file's own dtype (no copy).

    Example:
        >>> tokens = load_tokens("stdlib", ByteTokenizer(), cache_dir="/tmp/jaxperf", max_bytes=1 << 20)
    """
    parsed = _parse_bin(source)
    if parsed is not None:
        return _load_bin(parsed[0], parsed[1], tokenizer)
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"{max_bytes=} must be positive (or None for the whole corpus)")
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    cache_file = None
    if cache_dir is not None:
        fp = getattr(tokenizer, "fingerprint", f"{tokenizer.name}-{tokenizer.vocab_size}")
        key = f"{source_fingerprint(source, max_bytes)}|{tokenizer.name}|{tokenizer.vocab_size}|{fp}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        cache_file = pathlib.Path(cache_dir).expanduser() / f"tokens-{digest}.npy"
        if cache_file.exists():
            return np.load(cache_file, mmap_mode="r")
    tokens = _tokenize(corpus_texts(source, max_bytes), tokenizer, dtype)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, tokens)
        os.replace(tmp, cache_file)
    return tokens


def _tokenize(texts: Iterator[str], tokenizer, dtype, chunk: int = 64) -> np.ndarray:
    """Encodes the pieces in chunks (parallel inside `encode_batch`) and concatenates them."""
    parts, batch = [], []
    for text in texts:
        batch.append(text)
        if len(batch) == chunk:
            parts.extend(ids.astype(dtype) for ids in tokenizer.encode_batch(batch))
            batch = []
    if batch:
        parts.extend(ids.astype(dtype) for ids in tokenizer.encode_batch(batch))
    return np.concatenate(parts) if parts else np.zeros((0,), dtype)


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """A contiguous train / validation split; validation is the tail.

    Args:
        tokens: 1-D array of ids.
        val_fraction: share of tokens for validation, in [0, 1).

    Returns:
        (train, val) views of `tokens`.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"{val_fraction=} must lie in [0, 1)")
    n_val = int(round(len(tokens) * val_fraction))
    cut = len(tokens) - n_val
    return tokens[:cut], tokens[cut:]
