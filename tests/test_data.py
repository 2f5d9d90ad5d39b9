"""Tests for jaxperf.data: tokenizers, sources, batches, global arrays and the prefetcher (CPU, 8 devices)."""

import json
import os
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxperf import data
from jaxperf.config import ConfigError, get_config
from jaxperf.data import sources

TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "Grüße aus Köln — naïve café, 東京, emoji 🙂.\n"
    "The quick brown fox jumps over the lazy dog. " * 20
)


# --- tokenizers -------------------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_non_ascii():
    tok = data.ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids.dtype == np.uint32 and tok.vocab_size == 256 and tok.name == "byte"
    assert len(ids) == len(TEXT.encode("utf-8")) > len(TEXT)  # multi-byte characters really became several ids
    assert tok.decode(ids) == TEXT
    assert tok.decode(np.array([0xFF], np.uint32)) == "\ufffd"  # invalid UTF-8 is replaced, not raised


def test_the_byte_tokenizer_saved_as_tokenizer_json_encodes_the_same_ids(tmp_path):
    data.ByteTokenizer().save(tmp_path / "tokenizer.json")  # what `jaxperf export` ships for a byte-level run
    hf = data.HFTokenizer.from_file(tmp_path)
    text = TEXT + "".join(chr(c) for c in range(1, 256)) + "\x00 \r\n  x"
    assert hf.vocab_size == 256
    np.testing.assert_array_equal(hf.encode(text), data.ByteTokenizer().encode(text))
    assert hf.decode(hf.encode(text)) == text


def test_bpe_train_round_trip_and_save_load(tmp_path):
    tok = data.BPETokenizer.train([TEXT] * 4, vocab_size=300)
    assert tok.name == "bpe" and 257 < tok.vocab_size <= 300
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode("utf-8"))  # merges were learned and used
    assert int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == TEXT
    path = tmp_path / "tok" / "tokenizer.json"
    tok.save(path)
    loaded = data.BPETokenizer.from_file(path)
    assert loaded.vocab_size == tok.vocab_size and loaded.fingerprint == tok.fingerprint
    np.testing.assert_array_equal(loaded.encode(TEXT), ids)


def test_get_tokenizer_kinds_and_bpe_cache(tmp_path):
    assert isinstance(data.get_tokenizer("byte"), data.ByteTokenizer)
    with pytest.raises(ValueError, match="byte, bpe, hf"):
        data.get_tokenizer("wordpiece")
    calls = []

    def texts():
        calls.append(1)
        return [TEXT]

    first = data.get_tokenizer("bpe", vocab_size=280, texts_fn=texts, cache_dir=str(tmp_path), cache_key="k")
    assert len(calls) == 1 and len(list(tmp_path.glob("bpe-*.json"))) == 1
    second = data.get_tokenizer("bpe", vocab_size=280, texts_fn=texts, cache_dir=str(tmp_path), cache_key="k")
    assert len(calls) == 1, "second call should load the cached tokenizer.json, not train again"
    np.testing.assert_array_equal(second.encode(TEXT), first.encode(TEXT))
    path = next(tmp_path.glob("bpe-*.json"))
    assert data.get_tokenizer("bpe", path=str(path)).fingerprint == first.fingerprint


def test_hf_tokenizer_reads_the_special_ids_its_directory_declares(tmp_path):
    """config.json first, then generation_config.json, then tokenizer_config.json's token strings; None otherwise."""
    bpe = data.BPETokenizer.train([TEXT] * 4, vocab_size=300)
    bpe.save(tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 5, "eos_token_id": [7, 8]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "pad_token_id": 9}))
    tok = data.get_tokenizer("hf", path=str(tmp_path))  # the directory or its tokenizer.json
    assert (tok.name, tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == ("hf", 5, 7, 9, bpe.vocab_size)
    np.testing.assert_array_equal(tok.encode(TEXT), bpe.encode(TEXT))
    assert tok.fingerprint.startswith("hf-") and tok.fingerprint != bpe.fingerprint  # its own token cache
    (tmp_path / "config.json").unlink()
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    tok = data.HFTokenizer.from_file(tmp_path / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, bpe.eos_id, None)
    cfg = get_config("tiny", ["data.tokenizer=hf", f"data.tokenizer_path={tmp_path}"])
    assert data.tokenizer_for(cfg).vocab_size == bpe.vocab_size
    with pytest.raises(ConfigError, match="data.tokenizer=hf reads a Hugging Face tokenizer.json: set "
                                          "data.tokenizer_path"):
        data.tokenizer_for(get_config("tiny", ["data.tokenizer=hf"]))
    with pytest.raises(ConfigError, match=r"data.tokenizer_path: .*nowhere not found: a Hugging Face"):
        data.tokenizer_for(get_config("tiny", ["data.tokenizer=hf", f"data.tokenizer_path={tmp_path}/nowhere"]))


# --- sources ----------------------------------------------------------------------------------------------------------


def test_stdlib_corpus_files_deterministic_without_tests():
    files = data.stdlib_corpus_files()
    assert len(files) > 100
    assert files == sorted(files) == data.stdlib_corpus_files()
    names = {p.name for p in files}
    assert {"os.py", "functools.py"} <= names
    for p in files:
        parts = set(p.parts)
        assert not parts & {"test", "tests", "idle_test", "site-packages"}, p


def test_load_stdlib_bytes_and_cache(tmp_path, monkeypatch):
    tok = data.ByteTokenizer()
    tokens = data.load_tokens("stdlib", tok, cache_dir=str(tmp_path), max_bytes=200_000)
    assert tokens.dtype == np.uint16 and tokens.shape == (200_000,)
    raw = b"\n".join(p.read_bytes() for p in data.stdlib_corpus_files()[:50])[:200_000]
    assert len(raw) == 200_000, "first 50 stdlib files should exceed 200 kB"
    np.testing.assert_array_equal(tokens, np.frombuffer(raw, np.uint8))
    (cache_file,) = tmp_path.glob("tokens-*.npy")
    mtime = cache_file.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("tokenization ran again instead of reading the cache")

    monkeypatch.setattr(sources, "_tokenize", fail)
    again = data.load_tokens("stdlib", tok, cache_dir=str(tmp_path), max_bytes=200_000)
    np.testing.assert_array_equal(again, tokens)
    assert cache_file.stat().st_mtime_ns == mtime
    with pytest.raises(AssertionError, match="tokenization ran again"):  # a different key must miss the cache
        data.load_tokens("stdlib", tok, cache_dir=str(tmp_path), max_bytes=100_000)


def test_max_bytes_never_splits_a_character(tmp_path):
    (tmp_path / "a.txt").write_text("aé", encoding="utf-8")  # 3 bytes: 'a', then 2 for 'é'
    pieces = list(data.corpus_texts(str(tmp_path / "a.txt"), max_bytes=2))
    assert pieces == ["a"]


def test_text_glob_source(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "c.md").write_text("ignored", encoding="utf-8")
    tok = data.ByteTokenizer()
    tokens = data.load_tokens(str(tmp_path / "*.txt"), tok)
    assert tok.decode(tokens) == "first\nsecond"  # sorted order, newline between files
    assert list(data.corpus_texts(str(tmp_path / "*.txt"))) == ["first\n", "second"]
    assert tok.decode(data.load_tokens(str(tmp_path / "a.txt"), tok)) == "first"
    with pytest.raises(ValueError, match="matches no files"):
        data.load_tokens(str(tmp_path / "*.nothing"), tok)


def test_bin_source(tmp_path):
    ids = np.arange(100, dtype=np.uint16) % 256
    ids.tofile(tmp_path / "train.bin")
    tokens = data.load_tokens(str(tmp_path / "train.bin"), data.ByteTokenizer())
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, ids)
    ids.astype(np.uint32).tofile(tmp_path / "wide.bin")
    wide = data.load_tokens(str(tmp_path / "wide.bin") + ":uint32", data.ByteTokenizer())
    assert wide.dtype == np.uint32
    np.testing.assert_array_equal(wide, ids)


def test_bin_errors(tmp_path):
    tok = data.ByteTokenizer()
    np.arange(3, dtype=np.uint16).tofile(tmp_path / "six.bin")  # 6 bytes: fits uint16, not uint32
    with pytest.raises(ValueError, match=r"6 bytes.*uint32.*uint16"):
        data.load_tokens(str(tmp_path / "six.bin:uint32"), tok)
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match="7 bytes.*uint16"):
        data.load_tokens(str(tmp_path / "odd.bin"), tok)
    np.array([1, 300, 2], np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match=r"token id 300.*vocab_size=256"):
        data.load_tokens(str(tmp_path / "big.bin"), tok)
    with pytest.raises(ValueError, match="holds no text"):
        next(data.corpus_texts(str(tmp_path / "big.bin")))


class _Vocab:
    """A stand-in tokenizer of `vocab_size` ids (a token file is checked against the size alone)."""

    def __init__(self, vocab_size: int, name: str = "bpe"):
        self.vocab_size, self.name, self.fingerprint = vocab_size, name, f"{name}-{vocab_size}"


def test_a_token_file_carries_its_dtype_and_vocabulary(tmp_path):
    ids = np.arange(1000) % 256
    data.write_token_file(tmp_path / "t.bin", ids, data.ByteTokenizer())
    info = json.loads((tmp_path / "t.bin.json").read_text())
    assert (info["dtype"], info["vocab_size"], info["tokenizer"], info["tokens"]) == ("uint16", 256, "byte", 1000)
    np.testing.assert_array_equal(data.load_tokens(str(tmp_path / "t.bin"), data.ByteTokenizer()), ids)
    wide = np.arange(1000) * 50  # ids up to 49950 of a 70000-id tokenizer: uint32 on disk
    data.write_token_file(tmp_path / "w.bin", wide, _Vocab(70_000))
    read = data.load_tokens(str(tmp_path / "w.bin"), _Vocab(70_000))  # the sidecar says uint32: no suffix needed
    assert read.dtype == np.uint32
    np.testing.assert_array_equal(read, wide)
    with pytest.raises(ValueError, match=rf"^token file {tmp_path}/w.bin holds uint32 ids \(w.bin.json\) but is read "
                                         rf"as uint16: use '{tmp_path}/w.bin' or '{tmp_path}/w.bin:uint32'$"):
        data.load_tokens(f"{tmp_path}/w.bin:uint16", _Vocab(70_000))
    with pytest.raises(ValueError, match=r"made by a tokenizer of 256 ids \(byte, t.bin.json\) but the bpe tokenizer "
                                         r"has 300: train with the tokenizer that made it"):
        data.load_tokens(str(tmp_path / "t.bin"), _Vocab(300))
    other = _Vocab(70_000)
    other.fingerprint = "bpe-70000-retrained"  # the same size, trained on other text: another id mapping
    with pytest.raises(ValueError, match=r"w.bin was made by the tokenizer bpe-70000 \(w.bin.json\) but the one given "
                                         r"is bpe-70000-retrained: the same number of ids, another mapping"):
        data.load_tokens(str(tmp_path / "w.bin"), other)
    with open(tmp_path / "t.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match=r"has 2002 bytes but t.bin.json records 1000 uint16 ids \(2000 bytes\)"):
        data.load_tokens(str(tmp_path / "t.bin"), data.ByteTokenizer())
    (tmp_path / "t.bin.json").write_text("{")
    with pytest.raises(ValueError, match=r"t.bin.json does not describe the token file"):
        data.load_tokens(str(tmp_path / "t.bin"), data.ByteTokenizer())
    with pytest.raises(ValueError, match=r"ids from 0 to 300 do not fit the byte tokenizer's vocabulary of 256"):
        data.write_token_file(tmp_path / "x.bin", np.array([0, 300]), data.ByteTokenizer())


def test_a_token_file_without_a_sidecar_is_checked_for_ids_read_in_the_wrong_dtype(tmp_path):
    ids = np.frombuffer(TEXT.encode(), np.uint8)[: len(TEXT.encode()) // 2 * 2]  # whole uint32s either way
    ids.astype(np.uint32).tofile(tmp_path / "wide.bin")  # read as the default uint16: ids interleaved with zeros
    with pytest.raises(ValueError, match=rf"wide.bin' looks like uint32 ids read as uint16: every second one of its "
                                         rf"first {2 * len(ids)} uint16 values is 0; read it as "
                                         rf"'{tmp_path}/wide.bin:uint32'"):
        data.load_tokens(str(tmp_path / "wide.bin"), data.ByteTokenizer())
    assert len(data.load_tokens(f"{tmp_path}/wide.bin:uint32", data.ByteTokenizer())) == len(ids)
    ids.astype(np.uint16).tofile(tmp_path / "narrow.bin")  # uint16 ids read as uint32: ids beyond the vocabulary
    with pytest.raises(ValueError, match=r"vocab_size=256; .*'.*narrow.bin:uint16': read as uint16 every id fits"):
        data.load_tokens(f"{tmp_path}/narrow.bin:uint32", data.ByteTokenizer())
    with pytest.raises(ValueError, match=rf"^data.source='{tmp_path}/wide.bin:int8': token files hold uint16 or uint32 "
                                         rf"ids, not int8: write '{tmp_path}/wide.bin:uint16' or "):
        data.load_tokens(f"{tmp_path}/wide.bin:int8", data.ByteTokenizer())


def test_split_tokens():
    tokens = np.arange(100)
    train, val = data.split_tokens(tokens, 0.1)
    np.testing.assert_array_equal(train, np.arange(90))
    np.testing.assert_array_equal(val, np.arange(90, 100))
    with pytest.raises(ValueError, match="val_fraction"):
        data.split_tokens(tokens, 1.0)


# --- batches ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def dataset():
    return data.TokenDataset(np.arange(1000, dtype=np.uint16), seq_len=16, seed=3)


def test_batch_is_pure_function_of_seed_and_step(dataset):
    b = dataset.batch(5, 8)
    assert b["inputs"].shape == b["targets"].shape == b["mask"].shape == (8, 16)
    assert b["inputs"].dtype == b["targets"].dtype == np.int32 and b["mask"].dtype == np.float32
    np.testing.assert_array_equal(b["mask"], 1.0)
    dataset.batch(0, 8)  # drawing other steps first must not change step 5
    fresh = data.TokenDataset(np.arange(1000, dtype=np.uint16), seq_len=16, seed=3)
    for key in b:
        np.testing.assert_array_equal(fresh.batch(5, 8)[key], b[key])
    assert not np.array_equal(dataset.batch(6, 8)["inputs"], b["inputs"])
    other_seed = data.TokenDataset(np.arange(1000, dtype=np.uint16), seq_len=16, seed=4)
    assert not np.array_equal(other_seed.batch(5, 8)["inputs"], b["inputs"])


def test_targets_are_inputs_shifted(dataset):
    b = dataset.batch(0, 4)
    np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
    np.testing.assert_array_equal(b["targets"][:, -1], b["inputs"][:, -1] + 1)  # tokens are arange: next id
    np.testing.assert_array_equal(np.diff(b["inputs"], axis=1), 1)  # contiguous windows


def test_rows_assemble_to_global_batch(dataset):
    full = dataset.batch(7, 8)
    parts = [dataset.batch(7, 8, rows=data.process_rows(8, i, 4)) for i in range(4)]
    for key in full:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), full[key])
    np.testing.assert_array_equal(dataset.batch(7, 8, rows=slice(3, 4))["inputs"], full["inputs"][3:4])
    assert data.process_rows(8, 2, 4) == slice(4, 6)
    assert data.process_rows(8) == slice(0, 8)
    with pytest.raises(ValueError, match="not divisible by 3"):
        data.process_rows(8, 0, 3)


def test_windows_stay_in_bounds():
    ds = data.TokenDataset(np.arange(17, dtype=np.uint16), seq_len=16, seed=0)  # exactly one window fits
    b = ds.batch(0, 4)
    np.testing.assert_array_equal(b["inputs"], np.tile(np.arange(16), (4, 1)))
    np.testing.assert_array_equal(b["targets"], np.tile(np.arange(1, 17), (4, 1)))


def test_too_short_data_raises():
    with pytest.raises(ValueError, match="has 10 tokens, one sequence needs 17"):
        data.TokenDataset(np.arange(10), seq_len=16, seed=0)


def test_to_global_array_data_sharding(dataset):
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    host = dataset.batch(0, 16, rows=data.process_rows(16))
    out = data.to_global_array(host, sharding, 16)
    assert set(out) == {"inputs", "targets", "mask"}
    for key, arr in out.items():
        assert arr.shape == (16, 16) and arr.sharding == sharding
        assert {s.data.shape for s in arr.addressable_shards} == {(2, 16)}  # really split over 8 devices
        np.testing.assert_array_equal(np.asarray(arr), host[key])
    with pytest.raises(ValueError, match="rows"):
        data.to_global_array({"inputs": host["inputs"][:8]}, sharding, 16)


# --- prefetcher -------------------------------------------------------------------------------------------------------


def test_prefetcher_yields_steps_in_order(dataset):
    made = []

    def make(step):
        made.append(step)
        return {k: jax.device_put(v) for k, v in dataset.batch(step, 4).items()}

    with data.Prefetcher(make, start_step=10, depth=2) as it:
        got = [next(it) for _ in range(5)]
    assert [s for s, _ in got] == [10, 11, 12, 13, 14]
    for step, batch in got:
        np.testing.assert_array_equal(np.asarray(batch["inputs"]), dataset.batch(step, 4)["inputs"])
    assert made[:5] == [10, 11, 12, 13, 14] and len(made) <= 5 + 2 + 1  # ahead by at most depth (+1 in hand)


def test_prefetcher_propagates_exception():
    def make(step):
        if step == 2:
            raise RuntimeError("boom at step 2")
        return {"x": np.full((1,), step)}

    it = data.Prefetcher(make, start_step=0)
    assert next(it)[0] == 0 and next(it)[0] == 1
    with pytest.raises(RuntimeError, match="boom at step 2"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    it.close()


def test_prefetcher_close_is_prompt_with_full_queue():
    it = data.Prefetcher(lambda step: {"x": np.zeros(1)}, start_step=0, depth=1)
    deadline = time.monotonic() + 5
    while not it._queue.full() and time.monotonic() < deadline:  # let the producer block on a full queue
        time.sleep(0.01)
    assert it._queue.full()
    start = time.monotonic()
    it.close()
    assert time.monotonic() - start < 1.0
    assert not it._thread.is_alive()
    assert not any(t.name == "jaxperf-prefetch" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(StopIteration):
        next(it)
    it.close()  # idempotent


def test_cache_dir_tokens_are_reused_across_tokenizers_only_when_equal(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    cache = tmp_path / "cache"
    bpe_a = data.BPETokenizer.train([TEXT], vocab_size=270)
    bpe_b = data.BPETokenizer.train([TEXT], vocab_size=290)
    a = data.load_tokens(str(tmp_path / "t.txt"), bpe_a, cache_dir=str(cache))
    b = data.load_tokens(str(tmp_path / "t.txt"), bpe_b, cache_dir=str(cache))
    assert len(os.listdir(cache)) == 2 and len(a) != len(b)
    assert bpe_a.decode(a) == TEXT and bpe_b.decode(b) == TEXT
