"""``llmtrain export CKPT_OR_RUN_DIR --to hf OUT``: a checkpoint as a Hugging Face model directory.

The source is a run directory (its newest valid checkpoint is used) or one checkpoint directory inside it;
the model is rebuilt from the run's ``config.yaml`` exactly as ``llmtrain generate`` does
(``train.sample.load_for_generation``, which verifies the checkpoint), and written back as exactly what was
trained:

* weights: ``models.hf_io.save_hf`` (safetensors, sharded above ``--max-shard-gb``) in ``--dtype``. The default
  is the imported model's own dtype (its config.json ``torch_dtype`` / ``dtype``) when the run started from
  ``model.init_from: hf:DIR``, else fp32: llmtrain keeps fp32 master weights in every ``train.precision``, so
  fp32 is what was trained (bf16 / fp16 halve the files; a bf16 import exported by default stays bf16).
* config.json: for an ``init_from: hf:DIR`` run, DIR's own config.json with every key kept (bos/eos ids and
  eos lists, max_position_embeddings, rope_scaling, initializer_range, architectures, unknown keys...) except
  the dtype key, set to the written dtype; otherwise the family adapter's ``to_hf_config`` with the tokenizer's
  ids. (When DIR is gone, the second form is used and a note says so.)
* the tokenizer: ``export.tokenizer`` (encodes exactly as llmtrain's).

Files are written atomically (``export.target``): into a temporary sibling folder renamed into place, with a
marker ``llmtrain_export.json`` listing them; the target must be new, empty or an earlier export of ours
(replaced whole). The command's flags are in :mod:`llmtrain.commands.export`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

FORMATS = ("hf",)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def imported_config(source: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """(config.json of the run's ``model.init_from: hf:DIR``, note) for the run or checkpoint ``source``;
    (None, None) for a run without one, (None, note) when DIR/config.json is no longer readable."""
    from llmtrain.config import load_config
    from llmtrain.errors import LLMTrainError
    from llmtrain.models.hf_io import read_json_object
    from llmtrain.models.hf_resolve import hf_init_dir
    from llmtrain.train.checkpoint import is_committed, run_dir_of

    run = Path(source)
    if is_committed(run):
        run = run_dir_of(run)
    cfg, _ = load_config(run / "config.yaml")
    folder = hf_init_dir(cfg.model)
    if folder is None:
        return None, None
    try:
        return read_json_object(folder / "config.json", "model config"), None
    except LLMTrainError:
        return None, (
            f"{folder / 'config.json'} (the run's model.init_from) is not readable any more; config.json is "
            "written from the run's own architecture instead of the imported file."
        )


def default_dtype(base: dict[str, Any] | None) -> str:
    """The ``--dtype`` default: the imported config's dtype when it is fp32/bf16/fp16, else fp32."""
    name = (base or {}).get("dtype") or (base or {}).get("torch_dtype")
    return _HF_DTYPES.get(str(name), "fp32")


def export_hf(
    source: str | Path, out: str | Path, max_shard_bytes: int = 4 << 30, dtype: str | None = None
) -> list[Path]:
    """Export ``source`` (run or checkpoint directory) to the HF directory ``out``; returns the files written."""
    from llmtrain.export.target import MARKER, check_target, publish
    from llmtrain.export.tokenizer import write_tokenizer
    from llmtrain.models.hf_io import save_hf
    from llmtrain.train.sample import load_for_generation

    check_target(Path(out))  # a user's folder is refused before anything is loaded
    model, tok, ckpt = load_for_generation(source)
    base, note = imported_config(source)
    if note:
        print(f"llmtrain: note: {note}", file=sys.stderr)
    name = dtype or default_dtype(base)
    info = {"format": "hf", "source": str(ckpt), "dtype": name}
    with publish(out, info) as tmp:
        files = save_hf(
            model.state_dict(),
            model.args,
            tmp,
            eos_id=tok.eos_id,
            bos_id=tok.bos_id,
            max_shard_bytes=max_shard_bytes,
            dtype=DTYPES[name],
            base_config=base,
        )
        files += write_tokenizer(tok, tmp)
    return [Path(out) / f.name for f in files] + [Path(out) / MARKER]
