"""Where tokens come from: the default corpus (this Python's standard library), text files, and token `.bin` files.

A `source` string is one of
    "stdlib"             the `.py` files of the running Python's standard library (always present, no download)
    "notes.txt"          one text file
    "data/*.txt"         a glob (sorted; `**` recurses)
    "train.bin"          a nanoGPT-style flat token file, uint16 ids (memory-mapped, never copied)
    "train.bin:uint32"   the same with uint32 ids

Text sources are joined in sorted file order with one "\n" between files and tokenized; with `cache_dir` the tokens are
kept as .npy, keyed by the file list, sizes, mtimes, tokenizer and `max_bytes`, so the second load is instant.

A token file written by `write_token_file` carries a sidecar, `train.bin.json`, with its dtype, the vocabulary size
and name of the tokenizer that made it and the number of ids. At load the file is read in the recorded dtype (no
suffix needed); a suffix that contradicts it, another vocabulary size, another tokenizer fingerprint (the same size, another mapping)
or another length is a ValueError naming the file and both values. A file without a sidecar is checked for ids at or beyond the tokenizer's vocabulary, and a
sample of its start for uint32 ids read as uint16 (every second uint16 zero).
"""

from __future__ import annotations

import codecs
import functools
import glob
import hashlib
import json
import os
import pathlib
import re
import sysconfig
from collections.abc import Iterator

import numpy as np

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
_BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SIDECAR_FORMAT = "jaxperf-tokens"  # the "format" of a token file's sidecar (x.bin.json)
_SAMPLE = 1 << 16  # ids of a file without a sidecar looked at for uint32 read as uint16


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


def _parse_bin(source: str) -> tuple[str, np.dtype, bool] | None:
    """("path", dtype, whether a suffix named the dtype) when `source` names a token .bin file, else None."""
    path, dtype = source, "uint16"
    head, sep, tail = source.rpartition(":")
    has_suffix = bool(sep) and tail in _BIN_DTYPES
    if has_suffix:
        path, dtype = head, tail
    elif sep and head.endswith(".bin") and re.fullmatch(r"[A-Za-z_]\w*", tail) and not os.path.exists(source):
        raise ValueError(f"data.source={source!r}: token files hold {' or '.join(_BIN_DTYPES)} ids, not {tail}: "
                         f"write '{head}:uint16' or '{head}:uint32'")
    if not path.endswith(".bin"):
        if has_suffix:
            raise ValueError(f"{source!r}: a ':{dtype}' suffix is only meaningful for a token .bin file")
        return None
    return path, np.dtype(_BIN_DTYPES[dtype]), has_suffix


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


def sidecar_path(path: str | os.PathLike) -> pathlib.Path:
    """Where a token file's description lives: `x.bin` -> `x.bin.json`."""
    return pathlib.Path(f"{os.fspath(path)}.json")


def write_token_file(path: str | os.PathLike, tokens: np.ndarray, tokenizer) -> pathlib.Path:
    """Write `tokens` as a flat token file `path` (uint16 ids when the tokenizer has at most 65536, else uint32) and
    its sidecar `path.json` (dtype, vocabulary size, tokenizer, number of ids), each atomically.

    Read it back with `data.source=path` (no dtype suffix needed: the sidecar says). ValueError when an id does not
    fit the tokenizer's vocabulary.

    Example:
        >>> tok = get_tokenizer("byte")
        >>> write_token_file("train.bin", load_tokens("notes.txt", tok), tok)
    """
    path = pathlib.Path(path)
    vocab = int(tokenizer.vocab_size)
    dtype = np.dtype(np.uint16 if vocab <= 65536 else np.uint32)
    ids = np.asarray(tokens).reshape(-1)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"ids from {int(ids.min())} to {int(ids.max())} do not fit the {tokenizer.name} tokenizer's "
                         f"vocabulary of {vocab}: write them with the tokenizer that made them")
    info = {"format": SIDECAR_FORMAT, "version": 1, "dtype": dtype.name, "vocab_size": vocab,
            "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__),
            "fingerprint": getattr(tokenizer, "fingerprint", None), "tokens": int(ids.size)}
    side = sidecar_path(path)
    side.unlink(missing_ok=True)  # never a new file beside the old description
    for target, write in ((path, lambda f: ids.astype(dtype).tofile(f)),
                          (side, lambda f: f.write(json.dumps(info, indent=1).encode() + b"\n"))):
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, target)
    return path


def _read_sidecar(path: str) -> dict | None:
    side = sidecar_path(path)
    if not side.is_file():
        return None
    try:
        info = json.loads(side.read_text())
        if not isinstance(info, dict) or info.get("format") != SIDECAR_FORMAT:
            raise ValueError(f"no \"format\": \"{SIDECAR_FORMAT}\"")
        if info.get("dtype") not in _BIN_DTYPES:
            raise ValueError(f"dtype {info.get('dtype')!r} is not one of {', '.join(_BIN_DTYPES)}")
        info["vocab_size"], info["tokens"] = int(info["vocab_size"]), int(info["tokens"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{side} does not describe the token file {path} ({e}): write the file again with "
                         f"jaxperf.data.write_token_file, or remove {side.name} to read it without one") from None
    return info


def _check_sidecar(path: str, info: dict, dtype: np.dtype, explicit: bool, size: int, tokenizer) -> np.dtype:
    """The dtype to read `path` in, after checking it against its sidecar (ValueError naming both values)."""
    side, recorded = sidecar_path(path).name, np.dtype(_BIN_DTYPES[info["dtype"]])
    if explicit and dtype != recorded:
        raise ValueError(f"token file {path} holds {recorded.name} ids ({side}) but is read as {dtype.name}: use "
                         f"'{path}' or '{path}:{recorded.name}'")
    if info["vocab_size"] != tokenizer.vocab_size:
        raise ValueError(f"token file {path} was made by a tokenizer of {info['vocab_size']} ids "
                         f"({info.get('tokenizer')}, {side}) but the {tokenizer.name} tokenizer has "
                         f"{tokenizer.vocab_size}: train with the tokenizer that made it")
    made_by, given = info.get("fingerprint"), getattr(tokenizer, "fingerprint", None)
    if made_by and given and made_by != given:
        raise ValueError(f"token file {path} was made by the tokenizer {made_by} ({side}) but the one given is "
                         f"{given}: the same number of ids, another mapping; train with the tokenizer that made it")
    if size != info["tokens"] * recorded.itemsize:
        raise ValueError(f"token file {path} has {size} bytes but {side} records {info['tokens']} {recorded.name} "
                         f"ids ({info['tokens'] * recorded.itemsize} bytes): it changed after it was written; write "
                         f"it again")
    return recorded


def _load_bin(path: str, dtype: np.dtype, tokenizer, explicit: bool = False) -> np.ndarray:
    if not os.path.isfile(path):
        raise ValueError(f"no such token file {path!r}")
    size = os.path.getsize(path)
    info = _read_sidecar(path)
    if info is not None:
        dtype = _check_sidecar(path, info, dtype, explicit, size, tokenizer)
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
        hint = "the right dtype"
        if dtype == np.uint32 and int(np.memmap(path, dtype=np.uint16, mode="r").max()) < tokenizer.vocab_size:
            hint = f"'{path}:uint16': read as uint16 every id fits"
        raise ValueError(
            f"{path!r} holds token id {max_id} but the {tokenizer.name} tokenizer has vocab_size="
            f"{tokenizer.vocab_size}; use the tokenizer the file was made with (or {hint})"
        )
    if info is not None:  # its dtype is on record
        return tokens
    sample = np.asarray(tokens[: min(len(tokens), _SAMPLE) // 2 * 2])
    if dtype == np.uint16 and size % 4 == 0 and len(sample) >= 64 and not sample[1::2].any() and sample[::2].any():
        raise ValueError(f"{path!r} looks like uint32 ids read as uint16: every second one of its first {len(sample)} "
                         f"uint16 values is 0; read it as '{path}:uint32' (a file written by "
                         f"jaxperf.data.write_token_file carries its dtype in {sidecar_path(path).name})")
    return tokens


def load_tokens(source: str, tokenizer, *, cache_dir: str | None = None, max_bytes: int | None = None) -> np.ndarray:
    """Tokens of a source as one flat array.

    Args:
        source: "stdlib", a text file, a glob, or "file.bin[:uint16|uint32]" (see the module docstring; a file
            with a sidecar, `file.bin.json`, is read in the dtype it records and checked against it).
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
        return _load_bin(*parsed[:2], tokenizer, explicit=parsed[2])
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
