"""``llmtrain export CKPT_OR_RUN_DIR --to hf OUT``: a checkpoint as a Hugging Face model directory.

The source is a run directory (its newest committed checkpoint is used) or one checkpoint directory inside it;
the model is rebuilt from the run's ``config.yaml`` exactly as ``llmtrain generate`` does, its weights loaded
from DCP without a process group (any saved layout reshards to one process), and written by
``models.hf_io.save_hf``: safetensors (sharded above ``--max-shard-gb``), config.json, generation_config.json
and the run's tokenizer. ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` then gives our logits.

This module is the export (:func:`export_hf`); the command's flags are in :mod:`llmtrain.commands.export`.
"""

from __future__ import annotations

from pathlib import Path

FORMATS = ("hf",)


def export_hf(source: str | Path, out: str | Path, max_shard_bytes: int = 4 << 30) -> list[Path]:
    """Export ``source`` (run or checkpoint directory) to the HF directory ``out``; returns the files written."""
    from llmtrain.models.hf_io import save_hf
    from llmtrain.train.sample import load_for_generation

    model, tok, _ = load_for_generation(source)
    return save_hf(
        model.state_dict(),
        model.args,
        out,
        tokenizer_file=tok.path,
        eos_id=tok.eos_id,
        bos_id=tok.bos_id,
        max_shard_bytes=max_shard_bytes,
    )
