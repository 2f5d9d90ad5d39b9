"""Data: tokenizers, token sources (default corpus, text, token .bin), per-process batches and prefetch to device.

Example:
    >>> from jaxperf import data
    >>> tok = data.get_tokenizer("byte")
    >>> train, val = data.split_tokens(data.load_tokens("stdlib", tok, max_bytes=1 << 20), 0.05)
    >>> ds = data.TokenDataset(train, seq_len=256, seed=0)
    >>> host = ds.batch(step=0, batch_size=8, rows=data.process_rows(8))
"""

from jaxperf.data.datasets import datasets_for, tokenizer_for, vocab_note, with_vocab
from jaxperf.data.loader import DataError, Prefetcher, TokenDataset, process_rows, to_global_array
from jaxperf.data.sources import (corpus_texts, load_tokens, source_fingerprint, split_tokens, stdlib_corpus_files,
                                  write_token_file)
from jaxperf.data.tokenizer import BPETokenizer, ByteTokenizer, HFTokenizer, get_tokenizer, special_token_ids

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "Prefetcher",
    "TokenDataset",
    "corpus_texts",
    "datasets_for",
    "get_tokenizer",
    "load_tokens",
    "process_rows",
    "source_fingerprint",
    "special_token_ids",
    "split_tokens",
    "stdlib_corpus_files",
    "to_global_array",
    "tokenizer_for",
    "vocab_note",
    "with_vocab",
    "write_token_file",
]
