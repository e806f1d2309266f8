"""Hugging Face directories in and out: safetensors + config.json <-> our Transformer, through the family adapters.

Import (``read_hf_config``, ``load_hf_pretrained``, ``init_from_hf``): ``config.json``'s ``model_type`` picks the
family from an explicit table (never a class imported by name), the family adapter turns the config into
``TransformerArgs`` (``models/common/hf_config.py``: every setting that changes the computation is honoured or
refused) and the HF state dict into ours. Weights are read only from ``*.safetensors`` (one file, or the shards
``model.safetensors.index.json`` lists), which hold raw tensors and cannot carry code; ``*.bin`` / ``*.pt``
files are pickles and are refused by name, never opened. Every tensor's shape is checked against the model
before anything is loaded, so a config.json that does not belong to its weights is a CheckpointError naming
the tensor, not a failure half-way through the copy.

Export (``save_hf``): our state dict -> HF names (``to_hf_state_dict``), the tied output matrix dropped (HF
re-ties it from ``tie_word_embeddings``), cast to ``dtype`` (but the adapter's ``KEEP_FP32`` tensors), written as ``model.safetensors`` or, above
``max_shard_bytes``, as ``model-0000i-of-0000n.safetensors`` plus an index; ``config.json`` is ``base_config``
(the imported model's own config.json, so every key it had comes back) or ``to_hf_config``, and
``generation_config.json``. The tokenizer and the atomic placement of the directory are ``llmtrain.export``'s.
``transformers`` is never imported here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.models import FAMILIES, Transformer, TransformerArgs, build_model

# config.json model_type -> our family name (explicit registry).
HF_MODEL_TYPES: dict[str, str] = {
    "llama": "llama3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "glm": "glm4",
    "baichuan": "baichuan2",
    "mistral": "mistral",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2",
    "qwen3_moe": "qwen3",
    "glm4": "glm4",  # GLM-4-0414 (post norms)
    "deepseek_v3": "deepseek_v3",
}
# config.json model_type -> why it is refused (named instead of the generic "not supported").
REFUSED_MODEL_TYPES: dict[str, str] = {
    kind: "Gemma's RMSNorm scales by (1 + weight), the embeddings are multiplied by sqrt(hidden_size), the MLP is "
    "GeGLU and Gemma 2 / 3 add logit soft-capping, alternating local / global attention and extra norms; "
    "llmtrain's blocks implement none of these, so the model would compute something else"
    for kind in ("gemma", "gemma2", "gemma3", "gemma3_text", "recurrent_gemma")
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Architecture fields an init_from source must share with the model it loads into.
ARCH_FIELDS = (
    "family",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "qkv_bias",
    "attention_out_bias",
    "mlp_bias",
    "qk_norm",
    "norm_head",
    "tie_word_embeddings",
    "hidden_act",
    "rms_norm_eps",
    "position_embedding",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
    "rope_interleaved",
    "sliding_window",
    "sliding_window_layers",
    "post_norms",
    "num_experts",
    "top_k",
    "moe_hidden_size",
    "shared_experts",
    "shared_expert_gate",
    "router_score",
    "route_norm",
    "moe_every",
    "first_dense_layers",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


# ----------------------------------------------------------------------------- import
def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; CheckpointError naming the file when it is unreadable, not JSON or no object."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the {what} ({e}).") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); the {what} must be the "
            "JSON file transformers writes."
        ) from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: the {what} must be a JSON object, got a {type(d).__name__}.")
    return d


def read_hf_config(path: str | Path) -> tuple[dict[str, Any], TransformerArgs]:
    """``(config.json dict, TransformerArgs)`` of the HF directory ``path``."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(
            f"{path}: no config.json; model.init_from: hf:PATH needs a Hugging Face model directory "
            "(config.json + *.safetensors)."
        )
    d = read_json_object(cfg_file, "model config")
    family = HF_MODEL_TYPES.get(str(d.get("model_type")))
    if str(d.get("model_type")) in REFUSED_MODEL_TYPES:
        raise ConfigError(
            f"{cfg_file}: model_type {d['model_type']!r} is refused: "
            f"{REFUSED_MODEL_TYPES[str(d['model_type'])]}. Supported: {', '.join(HF_MODEL_TYPES)}."
        )
    if family is None:
        raise CheckpointError(
            f"{cfg_file}: model_type {d.get('model_type')!r} is not supported; supported: "
            f"{', '.join(HF_MODEL_TYPES)}."
        )
    return d, _hf_adapter(family).args_from_hf_config(d, source=str(cfg_file))


def _hf_adapter(family: str) -> ModuleType:
    """The family's Hugging Face adapter module (``FamilySpec.hf``; every registered family has one)."""
    adapter = FAMILIES[family].hf
    assert adapter is not None, f"model family {family!r} has no Hugging Face adapter"
    return adapter


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of the HF directory ``path`` (the index's shards, or the single file, or every
    ``*.safetensors``); CheckpointError when there are none (pickles are named and refused) or a shard is
    missing."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        index = read_json_object(path / INDEX_FILE, "safetensors index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(
                f"{path / INDEX_FILE}: weight_map must map tensor names to shard file names."
            )
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{path / INDEX_FILE} names shard(s) {', '.join(missing)}, which are not in {path}; the download "
                "or copy is incomplete."
            )
        return [path / f for f in files]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES) if path.is_dir() else []
    hint = (
        f" It has {', '.join(pickled)}: pickle files are never loaded (unpickling runs code); convert them once "
        "with transformers (`model.save_pretrained(out, safe_serialization=True)`)."
        if pickled
        else ""
    )
    raise CheckpointError(f"{path}: no *.safetensors weights.{hint}")


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the HF directory ``path`` from safetensors (never a pickle)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        try:
            sd.update(load_file(str(file)))
        except SafetensorError as e:
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({e}); it is truncated or corrupt: copy it again."
            ) from None
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


def check_shapes(hf_sd: dict[str, torch.Tensor], args: TransformerArgs, source: str | Path) -> None:
    """CheckpointError naming the first HF tensors whose shape differs from what config.json describes
    (checked on the HF names, before fused tensors are split)."""
    meta = build_model(args, device="meta").state_dict()
    expected = _hf_adapter(args.family).to_hf_state_dict(meta, args)
    wrong = [
        f"{k} {tuple(v.shape)} (config.json implies {tuple(expected[k].shape)})"
        for k, v in hf_sd.items()
        if k in expected and tuple(v.shape) != tuple(expected[k].shape)
    ]
    if wrong:
        raise CheckpointError(
            f"{source}: the weights do not have the shapes its config.json describes: {'; '.join(wrong[:3])}"
            f"{' ...' if len(wrong) > 3 else ''}. config.json and the safetensors files belong to different models."
        )


def init_from_hf(model: torch.nn.Module, path: str | Path) -> TransformerArgs:
    """Overwrite ``model``'s weights with the HF directory's (strict); returns the directory's arguments.

    Works on a plain model and on one already sharded (FSDP2 / DTensor TP): every rank reads the full tensors
    and ``set_model_state_dict`` keeps its own shards. A pipeline stage's pruned model takes only the keys it
    holds (see ``_drop_pruned``); a key missing for the model's own modules is still an error."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    _, args = read_hf_config(path)
    ours_args = getattr(model, "args", None)
    if ours_args is not None:
        diff = [
            f"{f}: run {getattr(ours_args, f)!r} vs {getattr(args, f)!r}"
            for f in ARCH_FIELDS
            if getattr(ours_args, f) != getattr(args, f)
        ]
        if diff:
            raise CheckpointError(
                f"model.init_from: {path} does not match the configured model ({'; '.join(diff)}). Set the model "
                "section to the directory's architecture (or leave it out: config.json then decides)."
            )
    hf_sd = read_hf_state_dict(path)
    check_shapes(hf_sd, args, path)
    head, embed = hf_sd.get("lm_head.weight"), hf_sd.get("model.embed_tokens.weight")
    if args.tie_word_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
        raise ConfigError(
            f"{path}: config.json sets tie_word_embeddings true but the weights hold an lm_head.weight that "
            "differs from model.embed_tokens.weight (transformers 5 then unties them); set tie_word_embeddings "
            "to false in config.json to import both matrices."
        )
    sd = _hf_adapter(args.family).from_hf_state_dict(hf_sd, args)
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
def fsync_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and flush it to disk."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def hf_config_for(
    args: TransformerArgs,
    base_config: dict[str, Any] | None,
    dtype: torch.dtype,
    eos_id: int | None = None,
    bos_id: int | None = None,
) -> dict[str, Any]:
    """config.json for ``args``: the imported ``base_config`` with only its dtype key set to ``dtype`` (every
    other key as it was), or ``to_hf_config`` with the tokenizer's ids. The result must read back to ``args``."""
    adapter = _hf_adapter(args.family)
    dtype_name = str(dtype).removeprefix("torch.")
    if base_config is None:
        config = adapter.to_hf_config(args)  # raises ConfigError when HF cannot express the model
        config["torch_dtype"] = dtype_name
        if eos_id is not None:
            config["eos_token_id"] = eos_id
        if bos_id is not None:
            config["bos_token_id"] = bos_id
        return config
    config = dict(base_config)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = dtype_name
    back = adapter.args_from_hf_config(config)
    diff = [f for f in ARCH_FIELDS if getattr(back, f) != getattr(args, f)]
    if diff:  # the run's model must be the imported one (resolve refuses any other); a bug otherwise
        raise CheckpointError(
            f"the imported config.json no longer describes the trained model ({', '.join(diff)}); export "
            "without it is needed."
        )
    return config


def check_norm_scheme_exportable(args: TransformerArgs) -> None:
    """ConfigError unless ``args`` has no post norms or is a GLM-4 model (``Glm4ForCausalLM``).

    A sandwich / dssn block normalises each sub-layer's output before its residual add. The only transformers
    architecture with those two norms per layer is GLM-4-0414's ``Glm4ForCausalLM``, which also fixes GLM-4's
    other choices (partial interleaved RoPE, fused gate/up projection, no o_proj bias), so only a ``glm4``
    model computes its function exactly (tests/test_norm_init.py checks the logits); DSSN differs from
    sandwich only in the initial gains, which the export carries as weights."""
    if args.post_norms and args.family != "glm4":
        raise ConfigError(
            f"this {args.family} model has model.norm_scheme {args.norm_scheme} (an RMSNorm on every attention and "
            "MLP output before its residual add), which no transformers class of its family has: the only "
            "architecture with those norms is Glm4ForCausalLM (GLM-4-0414), and it also has GLM-4's partial "
            f"interleaved RoPE, so a {args.family} model exported there would compute another function. Train with "
            "model.model_type: glm4 to export a sandwich / dssn model, or use model.norm_scheme: pre."
        )


def save_hf(
    state_dict: dict[str, torch.Tensor],
    args: TransformerArgs,
    out_dir: str | Path,
    eos_id: int | None = None,
    bos_id: int | None = None,
    max_shard_bytes: int = 4 << 30,
    dtype: torch.dtype | None = None,
    base_config: dict[str, Any] | None = None,
) -> list[Path]:
    """Write weights, config.json and generation_config.json of a HF directory for our ``state_dict`` into
    ``out_dir`` (see the module docstring); ``dtype`` None keeps the tensors' own. Returns the files written."""
    from safetensors.torch import save_file

    check_norm_scheme_exportable(args)
    adapter = _hf_adapter(args.family)
    hf_sd = adapter.to_hf_state_dict(state_dict, args)
    if args.tie_word_embeddings:
        hf_sd.pop("lm_head.weight", None)
    # an adapter's KEEP_FP32 names tensors its checkpoints store in fp32 whatever the dtype (DeepSeek's
    # e_score_correction_bias); config.json's dtype is the other tensors'
    keep = tuple(getattr(adapter, "KEEP_FP32", ()))

    def cast(k: str, v: torch.Tensor) -> torch.Tensor:
        to = torch.float32 if k.endswith(keep) else dtype or v.dtype
        return v.detach().to("cpu", dtype=to).contiguous().clone()

    hf_sd = {k: cast(k, v) for k, v in hf_sd.items()}
    main_dtype = next((v.dtype for k, v in hf_sd.items() if not k.endswith(keep)), torch.float32)
    config = hf_config_for(args, base_config, main_dtype, eos_id, bos_id)
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
        fsync_write(out / INDEX_FILE, json.dumps(index, indent=2))
        written.append(out / INDEX_FILE)
    fsync_write(out / "config.json", json.dumps(config, indent=2))
    gen = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None
    }
    fsync_write(out / "generation_config.json", json.dumps(gen, indent=2))
    written += [out / "config.json", out / "generation_config.json"]
    return written
