"""Deterministic byte-level BPE training: what ``prepare --train-tokenizer VOCAB_SIZE`` runs on its inputs.

:func:`train_bpe` trains a GPT-2 style byte-level BPE: ByteLevel pre-tokenizer and decoder (lossless round trip
for any Unicode text), all 256 byte symbols in the initial alphabet, and ``<|endoftext|>`` (:data:`TRAINED_EOS`)
as the only special token (id 0), which is the EOS. The same texts in the same order give a byte-identical
file. :func:`train_on_documents` is the form ``prepare`` uses on a stream of input documents: an input error
hit while the Rust trainer pulls documents is re-raised as itself once training returns, instead of surfacing
wrapped by the trainer.

Offline only: loading a tokenizer (what training and sampling need) is :mod:`llmtrain.data.tokenizer`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from llmtrain.data.tokenizer import Tokenizer, load_tokenizer
from llmtrain.errors import DataError

TRAINED_EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` on ``texts``, save it as tokenizer JSON at ``out_path``, load it.

    Deterministic: the same texts in the same order give a byte-identical file. ``<|endoftext|>`` is id 0 and is
    the EOS. ``vocab_size`` must leave room for the 256 byte symbols and the special token.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(
            f"--train-tokenizer {vocab_size} is too small: a byte-level BPE needs at least "
            f"{len(alphabet) + 1} entries (256 byte symbols and {TRAINED_EOS})."
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[TRAINED_EOS],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return load_tokenizer(str(out_path), eos_token=TRAINED_EOS)


def train_on_documents(texts: Iterable[str], vocab_size: int, out_path: str) -> None:
    """:func:`train_bpe`, re-raising an error (a DataError of a malformed input) hit while the Rust trainer was
    pulling documents."""
    errors: list[BaseException] = []

    def guarded() -> Iterator[str]:
        try:
            yield from texts
        except Exception as e:  # surfaced after training; the trainer would otherwise wrap it
            errors.append(e)

    train_bpe(guarded(), vocab_size, out_path)
    if errors:
        raise errors[0]
