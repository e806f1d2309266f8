"""Hugging Face directories in and out: safetensors + config.json <-> our Transformer, through the family adapters.

Import (``load_hf_pretrained``, ``init_from_hf``): ``config.json``'s ``model_type`` picks the family from an
explicit table (never a class imported by name), the family adapter turns the config into ``TransformerArgs`` and
the HF state dict into ours; weights are read only from ``*.safetensors`` (one file, or shards listed in
``model.safetensors.index.json``), which holds raw tensors and cannot carry code. ``pytorch_model.bin`` files are
pickles and are refused with a message saying how to convert them.

Export (``save_hf``): our state dict -> HF names (``to_hf_state_dict``), the tied output matrix dropped (HF
re-ties it from ``tie_word_embeddings``), written as ``model.safetensors`` or, above ``max_shard_bytes``, as
``model-0000i-of-0000n.safetensors`` plus an index; ``config.json`` from ``to_hf_config`` (token ids filled in),
``generation_config.json`` and the tokenizer (``tokenizer.json`` copied, or a SentencePiece ``tokenizer.model``)
with a ``tokenizer_config.json``. ``transformers`` is never imported here.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from llmtrain.errors import CheckpointError
from llmtrain.models import FAMILIES, Transformer, TransformerArgs, build_model

# config.json model_type -> our family name (explicit registry).
HF_MODEL_TYPES: dict[str, str] = {
    "llama": "llama3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "glm": "glm4",
    "baichuan": "baichuan2",
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- import
def read_hf_config(path: str | Path) -> tuple[dict[str, Any], TransformerArgs]:
    """``(config.json dict, TransformerArgs)`` of the HF directory ``path``."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(
            f"{path}: no config.json; model.init_from: hf:PATH needs a Hugging Face model directory "
            "(config.json + *.safetensors)."
        )
    d = json.loads(cfg_file.read_text())
    family = HF_MODEL_TYPES.get(str(d.get("model_type")))
    if family is None:
        raise CheckpointError(
            f"{cfg_file}: model_type {d.get('model_type')!r} is not supported; supported: "
            f"{', '.join(HF_MODEL_TYPES)}."
        )
    return d, _hf_adapter(family).args_from_hf_config(d)


def _hf_adapter(family: str) -> ModuleType:
    """The family's Hugging Face adapter module (``FamilySpec.hf``; every registered family has one)."""
    adapter = FAMILIES[family].hf
    assert adapter is not None, f"model family {family!r} has no Hugging Face adapter"
    return adapter


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the HF directory ``path`` from safetensors (never a pickle)."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")]
        hint = (
            f" It has {', '.join(pickled)}: pickle files are never loaded; convert them once with "
            "transformers (`model.save_pretrained(out, safe_serialization=True)`)."
            if pickled
            else ""
        )
        raise CheckpointError(f"{path}: no *.safetensors weights.{hint}")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        sd.update(load_file(str(path / name)))
    return sd


def load_hf_pretrained(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[Transformer, TransformerArgs]:
    """A model built from the HF directory ``path`` with its weights, on ``device``."""
    _, args = read_hf_config(path)
    model = build_model(args, device="meta")
    model.to_empty(device=device)
    model.init_weights(seed=0)  # buffers (RoPE tables); every parameter is overwritten below
    init_from_hf(model, path)
    return model, args


def init_from_hf(model: torch.nn.Module, path: str | Path) -> TransformerArgs:
    """Overwrite ``model``'s weights with the HF directory's (strict); returns the directory's arguments.

    Works on a plain model and on one already sharded (FSDP2 / DTensor TP): every rank reads the full tensors
    and ``set_model_state_dict`` keeps its own shards. A pipeline stage's pruned model takes only the keys it
    holds (see ``_drop_pruned``); a key missing for the model's own modules is still an error."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    _, args = read_hf_config(path)
    ours_args = getattr(model, "args", None)
    if ours_args is not None:
        fields = (
            "family",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "qkv_bias",
            "qk_norm",
            "tie_word_embeddings",
        )
        diff = [
            f"{f}: run {getattr(ours_args, f)} vs {getattr(args, f)}"
            for f in fields
            if getattr(ours_args, f) != getattr(args, f)
        ]
        if diff:
            raise CheckpointError(
                f"model.init_from: {path} does not match the configured model ({'; '.join(diff)}). Set the model "
                "section to the directory's architecture (or use its config.json values)."
            )
    sd = _hf_adapter(args.family).from_hf_state_dict(read_hf_state_dict(path), args)
    sd = _drop_pruned(model, sd, args)
    opts = StateDictOptions(full_state_dict=True, strict=True)
    # torch annotates the state dict as an invariant dict[str, ValueType]; a dict of tensors is one
    set_model_state_dict(model, sd, options=opts)  # type: ignore[arg-type]
    return args


def _drop_pruned(
    model: torch.nn.Module, sd: dict[str, torch.Tensor], args: TransformerArgs
) -> dict[str, torch.Tensor]:
    """``sd`` without the keys of modules a pipeline stage pruned away (other stages' layers, a missing
    embedding or head), so the strict load still names what ``model`` itself lacks, and keys no full model has.

    Names are compared without the activation-checkpoint / compile wrapper prefixes."""
    own = {k.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "") for k in model.state_dict()}
    full = set(build_model(args, device="meta").state_dict())  # meta: no memory, whatever the size
    return {k: v for k, v in sd.items() if k in own or k not in full}


# ----------------------------------------------------------------------------- export
def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_hf(
    state_dict: dict[str, torch.Tensor],
    args: TransformerArgs,
    out_dir: str | Path,
    tokenizer_file: str | Path | None = None,
    eos_id: int | None = None,
    bos_id: int | None = None,
    max_shard_bytes: int = 4 << 30,
) -> list[Path]:
    """Write a HF directory for our ``state_dict`` (see the module docstring); returns the files written."""
    from safetensors.torch import save_file

    adapter = _hf_adapter(args.family)
    config = adapter.to_hf_config(args)  # raises ConfigError when HF cannot express the model
    hf_sd = adapter.to_hf_state_dict(state_dict, args)
    if args.tie_word_embeddings:
        hf_sd.pop("lm_head.weight", None)
    hf_sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in hf_sd.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(hf_sd):
        nbytes = hf_sd[key].numel() * hf_sd[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = hf_sd[key]
        size += nbytes
    meta = {"format": "pt", "producer": "llmtrain"}
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata=meta)
        written.append(out / SINGLE_FILE)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata=meta)
            weight_map.update(dict.fromkeys(shard, name))
            written.append(out / name)
        total = sum(t.numel() * t.element_size() for t in hf_sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _fsync_write(out / INDEX_FILE, json.dumps(index, indent=2))
        written.append(out / INDEX_FILE)

    config.update({"torch_dtype": str(next(iter(hf_sd.values())).dtype).removeprefix("torch.")})
    if eos_id is not None:
        config["eos_token_id"] = eos_id
    if bos_id is not None:
        config["bos_token_id"] = bos_id
    _fsync_write(out / "config.json", json.dumps(config, indent=2))
    gen = {k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id)) if v is not None}
    _fsync_write(out / "generation_config.json", json.dumps(gen, indent=2))
    written += [out / "config.json", out / "generation_config.json"]
    if tokenizer_file is not None:
        written += _write_tokenizer(Path(tokenizer_file), out, eos_id, bos_id)
    return written


def _write_tokenizer(src: Path, out: Path, eos_id: int | None, bos_id: int | None) -> list[Path]:
    """tokenizer.json (HF) or tokenizer.model (SentencePiece) plus a tokenizer_config.json naming the specials."""
    tok_cfg: dict[str, Any] = {"model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}
    if src.suffix == ".json":
        shutil.copyfile(src, out / "tokenizer.json")
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_file(str(src))
        for key, tid in (("eos_token", eos_id), ("bos_token", bos_id)):
            if tid is not None and backend.id_to_token(tid) is not None:
                tok_cfg[key] = backend.id_to_token(tid)
        name = "tokenizer.json"
    else:
        shutil.copyfile(src, out / "tokenizer.model")
        tok_cfg.update(tokenizer_class="LlamaTokenizer", add_bos_token=False, add_eos_token=False)
        name = "tokenizer.model"
    _fsync_write(out / "tokenizer_config.json", json.dumps(tok_cfg, indent=2))
    return [out / name, out / "tokenizer_config.json"]
