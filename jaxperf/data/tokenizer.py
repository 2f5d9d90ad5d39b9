"""Tokenizers: a file-free byte tokenizer, a byte-level BPE built on HF `tokenizers`, and any Hugging Face model's own
`tokenizer.json`.

Both share one small interface that the rest of jaxperf relies on:

    tok.name          "byte" | "bpe" | "hf"
    tok.vocab_size    number of ids (every id is < vocab_size)
    tok.eos_id        id of the end-of-text token, or None
    tok.fingerprint   a short string that changes whenever the id mapping changes (used in cache keys)
    tok.encode(text)  -> np.ndarray[uint32] of ids
    tok.encode_batch(texts) -> list of such arrays
    tok.decode(ids)   -> str

Example:
    >>> tok = get_tokenizer("byte")
    >>> tok.decode(tok.encode("héllo"))
    'héllo'
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_KINDS = ("byte", "bpe", "hf")
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


class ByteTokenizer:
    """UTF-8 bytes as ids: vocab of 256, no files, no special tokens."""

    name = "byte"
    vocab_size = 256
    eos_id = None
    fingerprint = "byte-256"

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as a uint32 array of shape [len(bytes)]."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` applied to each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """Ids back to text; byte sequences that are not valid UTF-8 become U+FFFD."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= 256):
            raise ValueError(f"byte ids must lie in [0, 256), got min {ids.min()} max {ids.max()}")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, path: str | os.PathLike) -> None:
        """Writes the same mapping as a Hugging Face tokenizer.json (byte-level symbols, id = byte value, no merges),
        atomically: what `export` ships, so that `init_from` of the export (and transformers) encode as this does."""
        byte_symbols = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of GPT-2's byte level
        table = {ch: _byte_of(ch) for ch in byte_symbols}
        tok = Tokenizer(models.BPE(vocab=table, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        BPETokenizer(tok).save(path)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


@functools.cache
def _byte_values() -> dict[str, int]:
    """GPT-2's byte-level stand-in character of each byte -> the byte (printable bytes stand for themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {c: b for b, c in chars.items()}


def _byte_of(symbol: str) -> int:
    return _byte_values()[symbol]


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) wrapping a `tokenizers.Tokenizer`.

    The vocabulary holds the 256 byte symbols, the learned merges and one special token, `<|endoftext|>` (`eos_id`).
    """

    name = "bpe"

    def __init__(self, tokenizer):
        """Wraps an existing `tokenizers.Tokenizer`; use `train` or `from_file` to make one."""
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.eos_id = tokenizer.token_to_id(EOS_TOKEN)
        digest = hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()[:16]
        self.fingerprint = f"{self.name}-{self.vocab_size}-{digest}"

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Learns merges on `texts` until the vocabulary has `vocab_size` entries (fewer if the texts run out).

        Args:
            texts: training documents.
            vocab_size: target vocabulary size, including 256 byte symbols and `<|endoftext|>`.

        Returns:
            the trained tokenizer; its `vocab_size` is the real size reached.
        """
        if vocab_size < 257:
            raise ValueError(f"BPE {vocab_size=} is too small: it needs 256 byte symbols + 1 special token (>= 257)")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            show_progress=False,
            special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> BPETokenizer:
        """Loads a `tokenizer.json` written by `save` (or any HF byte-level BPE tokenizer file)."""
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | os.PathLike) -> None:
        """Writes the tokenizer as one JSON file (atomically: a reader never sees half a file)."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self._tok.save(str(tmp))
        os.replace(tmp, path)

    def encode(self, text: str) -> np.ndarray:
        """Ids of `text` as a uint32 array."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text, encoded in parallel by the Rust library."""
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def decode(self, ids) -> str:
        """Ids back to text (special tokens are kept, so `decode(encode(s)) == s`)."""
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


class HFTokenizer(BPETokenizer):
    """The `tokenizer.json` of a Hugging Face model (any `tokenizers` model: BPE, Unigram, WordPiece), with the special
    token ids its directory declares.

    `bos_id`, `eos_id` and `pad_id` come from the directory's config.json, else generation_config.json, else the token
    strings of tokenizer_config.json (see `special_token_ids`); each is None when nothing declares it. Text is encoded
    without added special tokens, as a token stream for training.
    """

    name = "hf"

    def __init__(self, tokenizer, special: dict[str, int | None] | None = None, path: str | None = None):
        super().__init__(tokenizer)
        special = special or {}
        self.bos_id = special.get("bos_token_id")
        self.eos_id = special.get("eos_token_id")
        self.pad_id = special.get("pad_token_id")
        self.path = path  # the tokenizer.json read

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> HFTokenizer:
        """Loads `path`: a tokenizer.json, or a model directory that holds one."""
        path = pathlib.Path(path).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: a Hugging Face model directory holds its tokenizer as "
                                    f"tokenizer.json (save it with tokenizer.save_pretrained(dir))")
        tok = Tokenizer.from_file(str(file))
        return cls(tok, special_token_ids(file.parent, tok), str(file.resolve()))

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, path={self.path!r})"


def _first_id(value) -> int | None:
    """A token id as config files write it: an int, a list of ints (the first is the main one), or null."""
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _read_json(path: pathlib.Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def special_token_ids(directory: str | os.PathLike, tokenizer=None) -> dict[str, int | None]:
    """{"bos_token_id", "eos_token_id", "pad_token_id"} of a Hugging Face model directory.

    Each id is taken from config.json, else generation_config.json, else (with a `tokenizers.Tokenizer`) the token
    string tokenizer_config.json names (`"eos_token": "</s>"`); None when none of them says.
    """
    directory = pathlib.Path(directory)
    config = _read_json(directory / "config.json")
    generation = _read_json(directory / "generation_config.json")
    tok_config = _read_json(directory / "tokenizer_config.json")
    out: dict[str, int | None] = {}
    for key in SPECIAL_TOKENS:
        value = _first_id(config.get(key))
        if value is None:
            value = _first_id(generation.get(key))
        if value is None and tokenizer is not None:
            token = tok_config.get(key.removesuffix("_id"))
            token = token.get("content") if isinstance(token, dict) else token
            value = tokenizer.token_to_id(token) if isinstance(token, str) else None
        out[key] = value
    return out


def _hash_texts(texts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def get_tokenizer(
    kind: str,
    *,
    vocab_size: int | None = None,
    path: str | None = None,
    texts_fn: Callable[[], Iterable[str]] | None = None,
    cache_dir: str | None = None,
    cache_key: str | None = None,
):
    """Builds, loads or trains a tokenizer.

    Args:
        kind: "byte", "bpe" or "hf".
        vocab_size: BPE only: target vocabulary size when training.
        path: BPE: a tokenizer.json to load (no training happens); hf (required): a Hugging Face model's tokenizer.json
            or the directory that holds it.
        texts_fn: BPE only: returns the training texts (called at most twice: once to hash if `cache_key` is None,
            once to train).
        cache_dir: BPE only: where trained tokenizers are kept as `bpe-<hash>.json`; a second call with the same texts
            and vocab size loads the file instead of training.
        cache_key: a string that identifies the training texts (e.g. `sources.source_fingerprint(source)`); when None,
            the texts themselves are hashed.

    Returns:
        a `ByteTokenizer`, `BPETokenizer` or `HFTokenizer`.

    Example:
        >>> tok = get_tokenizer("bpe", vocab_size=4096, texts_fn=lambda: corpus_texts("stdlib"), cache_dir="~/.cache")
    """
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        if path is None:
            raise ValueError("the hf tokenizer needs path=<tokenizer.json or the model directory that holds it>")
        return HFTokenizer.from_file(path)
    if kind != "bpe":
        raise ValueError(f"unknown tokenizer kind {kind!r}; valid kinds: {', '.join(TOKENIZER_KINDS)}")
    if path is not None:
        return BPETokenizer.from_file(path)
    if texts_fn is None or vocab_size is None:
        raise ValueError("a BPE tokenizer needs either path=<tokenizer.json> or both texts_fn and vocab_size to train")
    cache_file = None
    if cache_dir is not None:
        source_key = cache_key if cache_key is not None else _hash_texts(texts_fn())
        key = hashlib.sha256(f"{source_key}|vocab={vocab_size}".encode()).hexdigest()[:20]
        cache_file = pathlib.Path(cache_dir).expanduser() / f"bpe-{key}.json"
        if cache_file.exists():
            return BPETokenizer.from_file(cache_file)
    tok = BPETokenizer.train(texts_fn(), vocab_size)
    if cache_file is not None:
        tok.save(cache_file)
    return tok
