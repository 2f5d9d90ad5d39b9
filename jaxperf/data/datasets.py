"""The tokenizer and datasets of a run, from its DataConfig.

    tok = tokenizer_for(cfg)                       # byte, or BPE (from a file, the cache, or trained on the corpus)
    cfg = with_vocab(cfg, tok)                     # model.vocab_size follows the tokenizer (before validation)
    train, val = datasets_for(cfg, tok)            # TokenDatasets over the token stream, the tail held out

Training, generation and serving all call `tokenizer_for`, so a run's tokenizer is found the same way everywhere.
"""

from __future__ import annotations

import dataclasses
import os

from jaxperf.config import ConfigError, ModelConfig, TrainConfig
from jaxperf.data.loader import TokenDataset
from jaxperf.data.sources import corpus_texts, load_tokens, source_fingerprint, split_tokens
from jaxperf.data.tokenizer import get_tokenizer


def tokenizer_for(cfg: TrainConfig):
    """The tokenizer cfg.data describes: byte; BPE from `tokenizer_path`, the cache, or trained on the corpus; or a
    Hugging Face model's tokenizer.json (`hf`, from `tokenizer_path`)."""
    d = cfg.data
    if d.tokenizer == "byte":
        return get_tokenizer("byte")
    if d.tokenizer == "hf":
        if not d.tokenizer_path:
            raise ConfigError("data.tokenizer=hf reads a Hugging Face tokenizer.json: set data.tokenizer_path to it "
                              "(or to its model directory), or start from the model with init_from=DIR")
        try:
            return get_tokenizer("hf", path=os.path.expanduser(d.tokenizer_path))
        except FileNotFoundError as e:
            raise ConfigError(f"data.tokenizer_path: {e}") from None
    return get_tokenizer(d.tokenizer, vocab_size=cfg.model.vocab_size, path=d.tokenizer_path,
                         texts_fn=lambda: corpus_texts(d.source, max_bytes=d.max_bytes),
                         cache_dir=os.path.expanduser(d.cache_dir),
                         cache_key=source_fingerprint(d.source, d.max_bytes))


def with_vocab(cfg: TrainConfig, tokenizer) -> TrainConfig:
    """cfg with model.vocab_size equal to the tokenizer's; ConfigError if the tokenizer has more tokens than the
    model's (padded) vocabulary."""
    if tokenizer.vocab_size > cfg.model.padded_vocab:
        raise ConfigError(f"the {cfg.data.tokenizer} tokenizer has {tokenizer.vocab_size} tokens but the model's "
                          f"vocabulary is {cfg.model.padded_vocab}: set model.vocab_size={tokenizer.vocab_size}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=max(tokenizer.vocab_size, 1)))


def vocab_note(cfg: TrainConfig, tokenizer) -> str | None:
    """The line that says model.vocab_size is not used, when cfg sets one other than the tokenizer's (`with_vocab`
    replaces it: the byte tokenizer always has 256 ids, a BPE or tokenizer.json its own number), else None. A value
    equal to ModelConfig's default counts as not set."""
    asked, have = cfg.model.vocab_size, int(tokenizer.vocab_size)
    if asked in (have, ModelConfig().vocab_size):
        return None
    return (f"model.vocab_size={asked} is not used: the {getattr(tokenizer, 'name', 'given')} tokenizer has {have} "
            f"ids and the model's vocabulary follows its tokenizer ({have}); drop the setting, or choose a tokenizer "
            f"of {asked} ids (data.tokenizer=bpe trains one)")


def datasets_for(cfg: TrainConfig, tokenizer) -> tuple[TokenDataset, TokenDataset | None]:
    """(train, validation) TokenDatasets over cfg.data.source; validation is None when the held-out tail is shorter
    than one sequence."""
    d = cfg.data
    tokens = load_tokens(d.source, tokenizer, cache_dir=os.path.expanduser(d.cache_dir), max_bytes=d.max_bytes)
    train, val = split_tokens(tokens, d.val_fraction)
    seq = cfg.train_seq_len
    val_ds = TokenDataset(val, seq, cfg.seed + 1) if len(val) > seq + 1 else None
    return TokenDataset(train, seq, cfg.seed), val_ds
