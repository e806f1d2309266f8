"""The run's tokenizer as Hugging Face files that ``AutoTokenizer`` loads and that encode exactly as llmtrain does.

* A ``tokenizers`` JSON (``*.json``) is copied byte for byte to ``tokenizer.json``, with a
  ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast`` (transformers 5: ``TokenizersBackend``) and the
  EOS / BOS strings. ``encode(text, add_special_tokens=False)`` then gives llmtrain's ids; the file's own
  post-processor (a BOS template, say) still applies when special tokens are requested.
* A SentencePiece model (``*.model``) is copied to ``tokenizer.model`` with ``tokenizer_class:
  SentencePieceBackend``: transformers 5 then encodes with the sentencepiece library itself, so the ids are
  llmtrain's exactly, leading spaces and runs of indentation included. (Converting the model to a
  ``tokenizers`` BPE, what ``LlamaTokenizer`` does, is not exact: SentencePiece breaks ties between its
  equal-score whitespace pieces by position, which a merge list cannot express, so runs of spaces in code
  split differently.) ``add_bos_token`` / ``add_eos_token`` are false because llmtrain's data has no BOS.
  With transformers 4, load it with ``LlamaTokenizer.from_pretrained(out, legacy=True)`` (the slow class).

One difference stays by design: llmtrain encodes a special token's text inside a document as plain text,
while transformers turns it into the special token.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from llmtrain.data.tokenizer import Tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_tokenizer(tok: Tokenizer, out: Path) -> list[Path]:
    """Write the tokenizer files for ``tok`` into ``out``; returns them."""
    src = Path(tok.path)
    cfg: dict[str, Any] = {
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if tok.kind == "hf":
        from tokenizers import Tokenizer as HFTokenizer

        name = "tokenizer.json"
        shutil.copyfile(src, out / name)
        backend = HFTokenizer.from_file(str(src))
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        for key, tid in (("eos_token", tok.eos_id), ("bos_token", tok.bos_id)):
            if tid is not None and backend.id_to_token(tid) is not None:
                cfg[key] = backend.id_to_token(tid)
    else:
        import sentencepiece as spm

        name = "tokenizer.model"
        shutil.copyfile(src, out / name)
        sp = spm.SentencePieceProcessor(model_file=str(src))
        cfg.update(tokenizer_class="SentencePieceBackend", legacy=True)
        for key, tid in (("eos_token", tok.eos_id), ("bos_token", tok.bos_id), ("unk_token", sp.unk_id())):
            if tid is not None and 0 <= tid < sp.vocab_size():
                cfg[key] = sp.id_to_piece(tid)
    _write_json(out / "tokenizer_config.json", cfg)
    return [out / name, out / "tokenizer_config.json"]
