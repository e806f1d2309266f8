"""Hugging Face models as they are: ``model.init_from: hf:DIR`` takes the architecture from config.json, every
setting that changes the computation is honoured (parity with transformers, the reference) or refused, and
``llmtrain export`` writes back exactly what was trained, atomically.

The "published" configs are 2-layer, hidden-64 versions of the config.json files on the Hub (every other key
kept, token ids folded into the 512-token vocabulary); models are built by transformers from them with seeded
random weights (norm weights and biases perturbed too) and saved with ``save_pretrained``. The config.json is
then replaced by the published spelling (transformers 4: ``rope_theta`` + ``rope_scaling``, ``torch_dtype``) or
kept as transformers 5 wrote it (``rope_parameters``, ``dtype``).
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from llmtrain.cli import main as cli_main
from llmtrain.config import config_from_dict
from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.models.hf_io import load_hf_pretrained
from llmtrain.resolve import derive

transformers = pytest.importorskip("transformers")

VOCAB = 512
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA32_1B = {
    **LLAMA31_8B,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "rope_scaling": {**LLAMA31_8B["rope_scaling"], "factor": 32.0},
    "tie_word_embeddings": True,
    "transformers_version": "4.45.0.dev0",
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
GLM4_9B = {
    "architectures": ["GlmForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 13696,
    "max_position_embeddings": 131072,
    "model_type": "glm",
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "pad_token_id": 151329,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1.5625e-07,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.0.dev0",
    "use_cache": True,
    "vocab_size": 151552,
}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 49152,
}
PUBLISHED = {
    "llama3.1": LLAMA31_8B,
    "llama3.2": LLAMA32_1B,
    "qwen2.5": QWEN25_05B,
    "qwen3": QWEN3_06B,
    "glm4": GLM4_9B,
    "smollm2": SMOLLM2_135M,
}


def tiny(published: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The published config at 2 layers, hidden 64, 4 heads of 16, 2 KV heads, ffn 128, vocab 512."""
    d = json.loads(json.dumps(published))
    d.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    d.update(num_key_value_heads=2, vocab_size=VOCAB)
    if "head_dim" in d:
        d["head_dim"] = 16
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids folded into the tiny vocabulary
        if isinstance(d.get(key), list):
            d[key] = [i % VOCAB for i in d[key]]
        elif isinstance(d.get(key), int):
            d[key] = d[key] % VOCAB
    d.update(json.loads(json.dumps(changes)))  # a copy: transformers edits rope dicts in place
    return d


def make_hf_dir(path: Path, config: dict[str, Any], seed: int = 0, v5_spelling: bool = False) -> Path:
    """A transformers model of ``config`` with seeded random weights, saved to ``path`` (see the module doc)."""
    hf_config = transformers.CONFIG_MAPPING[config["model_type"]].from_dict(config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        config.get("torch_dtype"), torch.float32
    )
    model.to(dtype).save_pretrained(str(path))
    if not v5_spelling:
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def hf_reference(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def run_config(corpus: str, out: Path, model: dict[str, Any], max_steps: int = 1) -> dict[str, Any]:
    return {
        "model": {"seq_length": 32, **model},
        "train": {
            "batch_size": 2,
            "micro_batch_size": 2,
            "max_steps": max_steps,
            "lr": 1e-3,
            "warmup_steps": 0,
            "decay_style": "constant",
            "log_steps": 1,
            "eval_steps": 0,
            "seed": 5,
        },
        "data": {"datasets": [{"path": corpus, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 0, "resume": "auto"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"eval_iters": 1, "at_start": False},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1},
    }


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def tree_digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in path.rglob("*")
        if p.is_file()
    }


# ----------------------------------------------------------------------------- the published families
@pytest.fixture(scope="module", params=list(PUBLISHED))
def trained(request, tiny_corpus, tmp_path_factory):
    """(name, HF dir, input config.json, first-step losses, run dir, export dir) for one published family."""
    from llmtrain.train.trainer import Trainer

    name = request.param
    root = tmp_path_factory.mktemp(name.replace(".", "_"))
    hf_dir = make_hf_dir(root / "hf", tiny(PUBLISHED[name]), v5_spelling=name in ("glm4", "qwen3"))
    trainer = Trainer(config_from_dict(run_config(tiny_corpus, root / "run", {"init_from": f"hf:{hf_dir}"})))
    mb = trainer.batches.next_step()[0]
    n = int((mb["labels"] != -100).sum())
    ours = trainer.forward_loss(mb).item() / n
    with torch.no_grad():
        logits = hf_reference(hf_dir)(input_ids=mb["input_ids"]).logits
    theirs = F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100).item()
    trainer.fit()
    out = root / "export"
    assert cli_main(["export", str(root / "run"), "--to", "hf", str(out)]) == 0
    config_in = json.loads((hf_dir / "config.json").read_text())
    return name, hf_dir, config_in, (ours, theirs), root / "run", out


def test_first_step_loss_equals_transformers(trained):
    name, _, _, (ours, theirs), _, _ = trained
    assert theirs > 5.0  # random weights over 512 tokens: ~ln(512) = 6.2, so not a degenerate comparison
    assert ours == pytest.approx(theirs, rel=1e-5), name


def test_export_logits_equal_transformers(trained, tmp_path):
    """The default export (bf16, the imported dtype) is the trained model rounded to bf16; --dtype fp32 is the
    trained model itself. transformers computes our logits from either."""
    from llmtrain.train.sample import load_for_generation

    name, hf_dir, _, _, run, out = trained
    ours, _, _ = load_for_generation(run)
    rounded, _, _ = load_for_generation(run)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    fp32 = tmp_path / "fp32"
    assert cli_main(["export", str(run), "--to", "hf", str(fp32), "--dtype", "fp32"]) == 0
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_reference(out)(input_ids=ids).logits
        assert max_diff(rounded(ids), expected) < 1e-5, name
        expected32 = hf_reference(fp32)(input_ids=ids).logits
        assert max_diff(ours(ids), expected32) < 1e-5, name
        assert expected.abs().max().item() > 0.1
        # one optimizer step moved the weights away from the imported ones
        assert max_diff(hf_reference(hf_dir)(input_ids=ids).logits, expected32) > 1e-3


def test_export_config_round_trips_every_key(trained):
    name, _, config_in, _, run, out = trained
    config_out = json.loads((out / "config.json").read_text())
    changed = {
        k: (v, config_out.get(k, "<absent>"))
        for k, v in config_in.items()
        if config_out.get(k, "<absent>") != v
    }
    assert changed == {}, name  # bf16 imports export as bf16 by default: even the dtype key is unchanged
    dtype_key = "dtype" if "dtype" in config_in else "torch_dtype"
    assert config_out[dtype_key] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    marker = json.loads((out / "llmtrain_export.json").read_text())
    assert sorted(marker["files"]) == sorted(
        p.name for p in out.iterdir() if p.name != "llmtrain_export.json"
    )
    # the run's config.yaml spells out the imported architecture
    import yaml

    model = yaml.safe_load((run / "config.yaml").read_text().split("\n", 1)[1])["model"]
    assert model["hidden_size"] == 64 and model["num_layers"] == 2 and model["vocab_size"] == VOCAB
    assert (
        model["model_type"]
        == {"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3", "glm": "glm4"}[config_in["model_type"]]
    )


def test_check_shows_the_real_model(trained, tiny_corpus, tmp_path, capsys):
    name, hf_dir, config_in, _, _, _ = trained
    yaml_path = tmp_path / "run.yaml"
    import yaml

    yaml_path.write_text(
        yaml.safe_dump(run_config(tiny_corpus, tmp_path / "r", {"init_from": f"hf:{hf_dir}"}))
    )
    capsys.readouterr()
    assert cli_main(["check", str(yaml_path)]) == 0
    printed = capsys.readouterr().out
    hf_params = sum(p.numel() for p in hf_reference(hf_dir).parameters())
    assert f"({hf_params:,})" in printed, name
    assert "hidden 64, 2 layers, 4 heads (2 KV), ffn 128, vocab 512, seq 32" in printed


def test_yaml_disagreeing_with_config_json_names_both_values(trained, tiny_corpus, tmp_path):
    name, hf_dir, _, _, _, _ = trained
    base = {"init_from": f"hf:{hf_dir}"}
    cfg = config_from_dict(
        run_config(tiny_corpus, tmp_path, {**base, "hidden_size": 128, "rms_norm_eps": 0.5})
    )
    with pytest.raises(
        ConfigError, match=r"model\.hidden_size is 128, config.json gives 64.*rms_norm_eps is 0\.5"
    ):
        derive(cfg)
    agreeing = config_from_dict(
        run_config(tiny_corpus, tmp_path, {**base, "hidden_size": 64, "num_layers": 2})
    )
    assert derive(agreeing).model_args.hidden_size == 64


# ----------------------------------------------------------------------------- settings honoured: parity
def logits_parity(tmp_path: Path, config: dict[str, Any], positions: torch.Tensor | None = None) -> float:
    """Max |ours - transformers| logits of a model built from ``config`` (fresh HF model: dynamic RoPE caches)."""
    hf_dir = make_hf_dir(tmp_path / "hf", {**config, "torch_dtype": "float32"})
    ours, _ = load_hf_pretrained(hf_dir)
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_reference(hf_dir)(input_ids=ids, position_ids=positions).logits
        got = ours.eval()(ids, position_ids=positions)
    assert expected.abs().max().item() > 0.1
    return max_diff(got, expected)


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.8,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 12.0, 16.0],
        "original_max_position_embeddings": 32,
    },
}


@pytest.mark.parametrize("kind", list(ROPE_CASES))
@pytest.mark.parametrize("far", [False, True])
def test_rope_scaling_logits_parity(kind: str, far: bool, tmp_path: Path) -> None:
    """Llama with each rope_scaling type; far positions (5000+) exercise dynamic growth and longrope's long
    factors, 48 tokens past max_position_embeddings 40 the dynamic base change on plain positions."""
    config = tiny(SMOLLM2_135M, rope_scaling=ROPE_CASES[kind], max_position_embeddings=40, rope_theta=10000.0)
    positions = torch.arange(5000, 5048)[None] if far else None
    assert logits_parity(tmp_path, config, positions) < 1e-5


def test_rope_scaling_changes_the_model(tmp_path: Path) -> None:
    """The parity above is not vacuous: each scaling type changes our logits at these positions."""
    from llmtrain.models.common.rope import RotaryEmbedding, normalize_rope_scaling

    pos = torch.arange(5000, 5048)[None]
    plain = RotaryEmbedding(16, 10000.0, None, 40)(pos)[0]
    for kind, scaling in ROPE_CASES.items():
        scaled = RotaryEmbedding(16, 10000.0, normalize_rope_scaling(scaling, 40, 16), 40)(pos)[0]
        assert max_diff(plain, scaled) > 1e-2, kind


@pytest.mark.parametrize(
    "family, changes",
    [
        ("llama_gelu", {"hidden_act": "gelu"}),
        ("llama_gelu_new", {"hidden_act": "gelu_new"}),
        ("llama_gelu_tanh", {"hidden_act": "gelu_pytorch_tanh"}),
        ("llama_biases", {"attention_bias": True, "mlp_bias": True}),
        ("qwen3_attention_bias", {"attention_bias": True}),
        (
            "qwen2_yarn",
            {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}},
        ),
        (
            "glm_dynamic_partial",
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "max_position_embeddings": 24},
        ),
        ("glm_no_qkv_bias", {"attention_bias": False}),
        ("qwen3_default_head_dim", {"head_dim": None}),
        (
            "llama_top_level_original_context",  # transformers lets it override the one inside rope_scaling
            {
                "rope_scaling": {**ROPE_CASES["yarn"], "original_max_position_embeddings": 64},
                "original_max_position_embeddings": 12,
            },
        ),
    ],
)
def test_settings_logits_parity(family: str, changes: dict[str, Any], tmp_path: Path) -> None:
    base = {"llama": SMOLLM2_135M, "qwen3": QWEN3_06B, "qwen2": QWEN25_05B, "glm": GLM4_9B}[
        family.split("_")[0]
    ]
    config = tiny(base, **changes)
    if changes.get("head_dim", 0) is None:
        del config["head_dim"]  # absent: Qwen3Config's default head_dim is 128, not hidden / heads
    assert logits_parity(tmp_path, config) < 1e-5
    ours, _ = load_hf_pretrained(tmp_path / "hf")
    assert ours.args.num_params() == sum(p.numel() for p in hf_reference(tmp_path / "hf").parameters())
    if family == "qwen3_default_head_dim":
        assert ours.args.head_dim == 128
    if family == "llama_biases":
        assert (
            ours.layers["0"].attention.wo.bias is not None
            and ours.layers["0"].feed_forward.w2.bias is not None
        )


def test_rope_scaling_none_turns_llama3_scaling_off() -> None:
    from llmtrain.config.schema import ModelConfig
    from llmtrain.models import resolve_model_args

    assert resolve_model_args(ModelConfig(flavor="debug")).rope_scaling["rope_type"] == "llama3"
    for off in ("none", {"rope_type": "default"}):
        assert resolve_model_args(ModelConfig(flavor="debug", rope_scaling=off)).rope_scaling is None
    yarn = resolve_model_args(
        ModelConfig(flavor="debug", rope_scaling={"type": "yarn", "factor": 4}, max_position_embeddings=4096)
    )
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096}
    with pytest.raises(ConfigError, match="mrope_section"):
        resolve_model_args(
            ModelConfig(
                flavor="debug", rope_scaling={"rope_type": "linear", "factor": 2, "mrope_section": [1]}
            )
        )


# ----------------------------------------------------------------------------- settings refused
@pytest.mark.parametrize(
    "base, changes, match",
    [
        # (active sliding windows are honoured now: tests/test_families.py shows their parity)
        (SMOLLM2_135M, {"attention_dropout": 0.1}, "attention_dropout"),
        (SMOLLM2_135M, {"hidden_act": "relu2"}, "hidden_act 'relu2'"),
        (SMOLLM2_135M, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (SMOLLM2_135M, {"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_type 'mrope'"),
        (SMOLLM2_135M, {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ],
)
def test_unsupported_settings_are_refused(base, changes, match, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny(base, **changes)))
    with pytest.raises(ConfigError, match=match):
        load_hf_pretrained(tmp_path)


def test_sliding_window_off_or_unused_is_accepted(tmp_path: Path) -> None:
    from llmtrain.models.hf_io import read_hf_config

    for i, changes in enumerate(
        ({"use_sliding_window": False}, {"use_sliding_window": True, "max_window_layers": 2})
    ):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(tiny(QWEN25_05B, **changes)))
        assert read_hf_config(folder)[1].family == "qwen2"


# ----------------------------------------------------------------------------- bad inputs
@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("good") / "hf", tiny(SMOLLM2_135M, torch_dtype="float32"))


def broken_copy(good: Path, tmp_path: Path) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    return bad


@pytest.mark.parametrize(
    "case, match",
    [
        ("not_json", r"config.json is not valid JSON \(line 1"),
        ("not_object", "must be a JSON object, got a list"),
        ("string_size", r"hidden_size must be an integer >= 1, got '64'"),
        ("float_size", r"num_hidden_layers must be an integer >= 1, got 2.5"),
        ("bool_flag", r"tie_word_embeddings must be true or false, got 'yes'"),
        ("shape_mismatch", r"model.embed_tokens.weight \(512, 64\) \(config.json implies \(600, 64\)\)"),
        ("truncated", "not a readable safetensors file"),
        ("missing_shard", "names shard\\(s\\) model-00002-of-00002.safetensors"),
        ("pickle", "pytorch_model.bin: pickle files are never loaded"),
    ],
)
def test_bad_hf_directories_are_clean_errors(
    case, match, good_dir, tmp_path, monkeypatch, tiny_corpus, capsys
):
    bad = broken_copy(good_dir, tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    edits = {"string_size": ("hidden_size", "64"), "float_size": ("num_hidden_layers", 2.5)}
    edits |= {"bool_flag": ("tie_word_embeddings", "yes"), "shape_mismatch": ("vocab_size", 600)}
    if case == "not_json":
        (bad / "config.json").write_text("{'hidden_size': 64}")
    elif case == "not_object":
        (bad / "config.json").write_text("[1, 2]")
    elif case in edits:
        key, value = edits[case]
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
    elif case == "truncated":
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif case == "missing_shard":
        (bad / "model.safetensors").rename(bad / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    elif case == "pickle":
        (bad / "model.safetensors").unlink()
        torch.save({"x": torch.zeros(1)}, bad / "pytorch_model.bin")

        def never(*a, **k):
            raise AssertionError("a pickle was opened")

        monkeypatch.setattr(torch, "load", never)
        import pickle

        monkeypatch.setattr(pickle, "load", never)
        monkeypatch.setattr(pickle, "Unpickler", never)
    with pytest.raises((CheckpointError, ConfigError), match=match):
        load_hf_pretrained(bad)
    # through the command line: exit code 2, one paragraph, no traceback
    import yaml

    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(
        yaml.safe_dump(run_config(tiny_corpus, tmp_path / "run", {"init_from": f"hf:{bad}"}))
    )
    capsys.readouterr()
    assert cli_main(["train", str(yaml_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(bad) in err


# ----------------------------------------------------------------------------- export: atomic, refusing
@pytest.fixture(scope="module")
def small_run(tiny_corpus, tmp_path_factory) -> Path:
    from llmtrain.train.trainer import Trainer

    root = tmp_path_factory.mktemp("small_run")
    Trainer(config_from_dict(run_config(tiny_corpus, root / "run", {"flavor": "debug"}))).fit()
    return root / "run"


def test_export_dtype_flag_and_default(small_run, tmp_path):
    from safetensors import safe_open

    for flag, dtype in ((None, torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out = tmp_path / str(flag)
        assert (
            cli_main(["export", str(small_run), "--to", "hf", str(out), *(["--dtype", flag] if flag else [])])
            == 0
        )
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {dtype}
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix(
            "torch."
        )
    assert cli_main(["export", str(small_run), "--to", "hf", str(tmp_path / "x"), "--dtype", "int8"]) == 2


def test_export_refuses_a_users_folder_and_a_file(small_run, tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "config.json").write_text('{"my": "own"}')
    (user / "notes.txt").write_text("keep me")
    before = tree_digest(user)
    capsys.readouterr()
    assert cli_main(["export", str(small_run), "--to", "hf", str(user)]) == 2
    err = capsys.readouterr().err
    assert "llmtrain did not write" in err and str(user) in err and "Traceback" not in err
    assert tree_digest(user) == before
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert cli_main(["export", str(small_run), "--to", "hf", str(a_file)]) == 2
    assert f"export target {a_file} exists and is not a directory" in capsys.readouterr().err
    assert a_file.read_text() == "x"


def test_export_replaces_an_earlier_export_whole(small_run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # an empty folder is a valid target
    assert cli_main(["export", str(small_run), "--to", "hf", str(out), "--max-shard-gb", "0.00004"]) == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 3 and (out / "model.safetensors.index.json").is_file()
    assert cli_main(["export", str(small_run), "--to", "hf", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert not any(n.startswith("model-") for n in names) and "model.safetensors.index.json" not in names
    assert names == sorted(
        [*json.loads((out / "llmtrain_export.json").read_text())["files"], "llmtrain_export.json"]
    )
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary or old folder left behind
    (out / "extra.txt").write_text("a user's file inside our export")
    assert cli_main(["export", str(small_run), "--to", "hf", str(out)]) == 2
    assert (out / "extra.txt").read_text() == "a user's file inside our export"


def test_export_failure_mid_write_changes_nothing(small_run, tmp_path, monkeypatch, capsys):
    import llmtrain.export.tokenizer as tokenizer_module

    out = tmp_path / "out"
    assert cli_main(["export", str(small_run), "--to", "hf", str(out)]) == 0
    before = tree_digest(out)

    def disk_full(src, dst, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(tokenizer_module.shutil, "copyfile", disk_full)
    capsys.readouterr()
    for target in (out, tmp_path / "fresh"):
        assert cli_main(["export", str(small_run), "--to", "hf", str(target)]) == 2
        err = capsys.readouterr().err
        assert "No space left on device" in err and "Traceback" not in err and str(target) in err
    assert tree_digest(out) == before  # the previous export intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no fresh/ and no temporary folder


def test_export_read_only_parent_names_the_path(small_run, tmp_path, monkeypatch, capsys):
    target = tmp_path / "ro" / "out"
    real_mkdir = Path.mkdir

    def read_only(self, *a, **k):
        if self.parent == tmp_path / "ro" or self == tmp_path / "ro":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only)
    capsys.readouterr()
    assert cli_main(["export", str(small_run), "--to", "hf", str(target)]) == 2
    err = capsys.readouterr().err
    assert "Read-only file system" in err and str(tmp_path / "ro") in err and "Traceback" not in err


# ----------------------------------------------------------------------------- tokenizer round trip
def corpus_texts(shared: Path) -> list[str]:
    texts = []
    for name in ("code", "en", "zh"):
        with gzip.open(shared / "corpus" / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"][:4000] for line in itertools.islice(f, 40)]
    return texts + [
        "  leading spaces, trailing spaces  \n\n",
        " one leading space",
        "def f(x):\n    if x:\n        return [\n                1,\n            ]\n\treturn None\n",
        "a" + " " * 40 + "b   \n    \n",
        "",
    ]


@pytest.mark.parametrize("name", ["mistral_v1_sentencepiece.model", "deepseek_v3_tokenizer.json"])
def test_exported_tokenizer_encodes_like_llmtrain(name, shared_dir, tmp_path):
    from llmtrain.data.tokenizer import load_tokenizer
    from llmtrain.export.tokenizer import write_tokenizer

    path = shared_dir / "tokenizers" / name
    if not path.is_file():
        pytest.skip(f"{path} not present")
    tok = load_tokenizer(str(path))
    write_tokenizer(tok, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny(SMOLLM2_135M)))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    texts = corpus_texts(shared_dir)
    assert sum(len(t) for t in texts) > 100_000
    mismatched = [t[:40] for t in texts if hf.encode(t, add_special_tokens=False) != tok.encode(t)]
    assert mismatched == []
    assert hf.eos_token_id == tok.eos_id and hf.convert_tokens_to_ids(hf.bos_token) == tok.bos_id


def test_fused_tensor_shape_mismatch_is_named_before_splitting(tmp_path):
    hf_dir = make_hf_dir(tmp_path / "glm", tiny(GLM4_9B, torch_dtype="float32"))
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(
        CheckpointError, match=r"gate_up_proj.weight \(256, 64\) \(config.json implies \(192, 64\)\)"
    ):
        load_hf_pretrained(hf_dir)


def test_tied_config_with_a_different_lm_head_is_refused(good_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = broken_copy(good_dir, tmp_path)
    sd = load_file(str(bad / "model.safetensors"))
    save_file(
        {**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, str(bad / "model.safetensors")
    )
    same, _ = load_hf_pretrained(bad)  # an equal copy is just the tie written out
    assert torch.equal(same.output.weight, sd["model.embed_tokens.weight"])
    save_file(
        {**sd, "lm_head.weight": torch.zeros_like(sd["model.embed_tokens.weight"])},
        str(bad / "model.safetensors"),
    )
    with pytest.raises(ConfigError, match="tie_word_embeddings true but the weights hold an lm_head.weight"):
        load_hf_pretrained(bad)


def test_tokenizer_larger_than_the_embedding_is_refused(good_dir, tiny_corpus, tmp_path):
    bad = broken_copy(good_dir, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    cfg = config_from_dict(run_config(tiny_corpus, tmp_path / "run", {"init_from": f"hf:{bad}"}))
    with pytest.raises(ConfigError, match="the tokenizer has 512 tokens but .* has vocab_size 256"):
        derive(cfg)
