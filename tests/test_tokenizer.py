"""Tokenizer wrappers against the libraries themselves, and deterministic byte-level BPE training."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrain.data.prep.tokenizer_training import train_bpe
from llmtrain.data.tokenizer import load_tokenizer
from llmtrain.errors import DataError

SHARED = Path(__file__).resolve().parents[2] / "shared"
TOKENIZERS = SHARED / "tokenizers"
SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "Call me Ishmael. Some years ago—never mind how long precisely—having little money",
    "学而时习之，不亦说乎？有朋自远方来，不亦乐乎？",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tprint('tabs\\t and \"quotes\"')\n",
    "  leading spaces, trailing spaces  \n\n",
]
TRAIN_TEXTS = [
    "hello world, the world says hello back to the whole wide world.",
    "子曰：学而时习之，不亦说乎？有朋自远方来，不亦乐乎？人不知而不愠，不亦君子乎？",
    "for i in range(10):\n    print(i * i)\n\ndef main():\n    return 0\n",
] * 4


def need(name: str) -> Path:
    path = TOKENIZERS / name
    if not path.is_file():
        pytest.skip(f"shared tokenizer {path} not present")
    return path


def test_hf_json_matches_library():
    from tokenizers import Tokenizer as HF

    path = need("deepseek_v3_tokenizer.json")
    tok = load_tokenizer(str(path))
    ref = HF.from_file(str(path))
    assert tok.kind == "hf"
    assert tok.vocab_size == 129280
    assert tok.eos_id == 1 and tok.bos_id == 0  # <｜end▁of▁sentence｜>, <｜begin▁of▁sentence｜>
    for s in SAMPLES:
        ids = tok.encode(s)
        assert ids == ref.encode(s, add_special_tokens=False).ids
        assert tok.decode(ids) == s
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]
    assert len(tok.sha256) == 64


def test_hf_special_token_text_is_not_injected():
    path = need("deepseek_v3_tokenizer.json")
    tok = load_tokenizer(str(path))
    assert tok.eos_id not in tok.encode("end <｜end▁of▁sentence｜> here")
    assert load_tokenizer(str(path), eos_token="<｜begin▁of▁sentence｜>").eos_id == 0


def test_sentencepiece_matches_library():
    import sentencepiece as spm

    path = need("mistral_v1_sentencepiece.model")
    tok = load_tokenizer(str(path))
    ref = spm.SentencePieceProcessor(model_file=str(path))
    assert tok.kind == "sentencepiece"
    assert tok.vocab_size == 32000
    assert tok.eos_id == 2 and tok.bos_id == 1
    for s in SAMPLES:
        assert tok.encode(s) == ref.encode(s)
    assert tok.encode_batch(SAMPLES) == [ref.encode(s) for s in SAMPLES]
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="missing.json' does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="bad.json' could not be read"):
        load_tokenizer(str(bad))
    bad_model = tmp_path / "bad.model"
    bad_model.write_bytes(b"\x00garbage")
    with pytest.raises(DataError, match="bad.model' could not be read"):
        load_tokenizer(str(bad_model))
    other = tmp_path / "vocab.txt"
    other.write_text("a")
    with pytest.raises(DataError, match="unknown type"):
        load_tokenizer(str(other))


def test_train_bpe_deterministic_and_round_trips(tmp_path):
    a = train_bpe(iter(TRAIN_TEXTS), 300, str(tmp_path / "a.json"))
    b = train_bpe(iter(TRAIN_TEXTS), 300, str(tmp_path / "b.json"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert a.sha256 == b.sha256
    assert a.vocab_size == 300
    assert a.eos_id == 0 and a.bos_id is None
    for s in [
        "plain ASCII text, hello world!",
        "有朋自远方来，不亦乐乎",
        "def g(y):\n\treturn [y, {'k': 1}]\n",
        *SAMPLES,
    ]:
        ids = a.encode(s)
        assert a.decode(ids) == s
        assert ids == b.encode(s)
    # merges learned: a frequent word takes fewer tokens than its bytes
    assert len(a.encode("hello world")) < len("hello world")
    # the EOS string inside text stays text
    assert 0 not in a.encode("<|endoftext|>")


def test_train_bpe_too_small(tmp_path):
    with pytest.raises(DataError, match="too small"):
        train_bpe(iter(TRAIN_TEXTS), 100, str(tmp_path / "t.json"))


def test_sentencepiece_bad_eos(tmp_path):
    path = need("mistral_v1_sentencepiece.model")
    with pytest.raises(DataError, match="not a piece"):
        load_tokenizer(str(path), eos_token="<definitely-not-a-piece>")
