"""Hugging Face export and import: a tiny trained run exported with ``llmtrain export`` loads in transformers with
our logits; importing the directory back (load_hf_pretrained / init_from_hf) gives the same loss; pickles are
refused and mismatched architectures are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmtrain.cli import main as cli_main
from llmtrain.config import config_from_dict
from llmtrain.errors import CheckpointError
from llmtrain.models.hf_io import init_from_hf, load_hf_pretrained, read_hf_state_dict, save_hf
from llmtrain.train.sample import load_for_generation
from llmtrain.train.trainer import Trainer

transformers = pytest.importorskip("transformers")


def tiny_config(prefix: str, out: Path, family: str, resume: str = "auto") -> dict:
    return {
        "model": {"model_type": family, "flavor": "debug", "seq_length": 32},
        "train": {
            "batch_size": 4,
            "micro_batch_size": 4,
            "max_steps": 2,
            "lr": 3e-3,
            "warmup_steps": 1,
            "log_steps": 1,
            "eval_steps": 0,
            "seed": 3,
        },
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 0, "resume": resume},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"eval_iters": 1, "at_start": False},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1},
    }


def loss_of(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        logits = model(mb["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100).item()


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def exported(request, tiny_corpus, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"export_{family}")
    Trainer(config_from_dict(tiny_config(tiny_corpus, root / "run", family))).fit()
    out = root / "hf"
    assert cli_main(["export", str(root / "run"), "--to", "hf", str(out)]) == 0
    return family, root, out


def test_export_files_and_transformers_logits(exported):
    family, root, out = exported
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "llmtrain_export.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("llama" if family == "llama3" else "qwen3")
    ours, tok, ckpt = load_for_generation(root / "run")
    assert ckpt.name == "step_00000002" and config["eos_token_id"] == tok.eos_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    ids = torch.tensor([tok.encode("def main(argv):\n    return sorted(argv)\n")[:30]])
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids)
    assert got.shape == expected.shape and got.shape[-1] == 512
    assert (got - expected).abs().max().item() < 1e-5
    assert expected.std().item() > 0.05
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "import os\nprint(os.sep)"
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)


def test_import_round_trip_and_first_step_loss(exported, tiny_corpus):
    family, root, out = exported
    src, _, _ = load_for_generation(root / "run")
    model, args = load_hf_pretrained(out)
    assert args.family == family and args.vocab_size == 512
    for (k, a), b in zip(src.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    # a fresh run whose model is initialised from the HF directory starts at the source model's loss
    fresh = Trainer(config_from_dict(tiny_config(tiny_corpus, root / f"fresh_{family}", family, "none")))
    mb = fresh.batches.next_step()[0]
    before = loss_of(fresh.model, mb)
    init_from_hf(fresh.model, out)
    after, source = loss_of(fresh.model, mb), loss_of(src, mb)
    assert after == source and abs(before - source) > 1e-3
    n = int((mb["labels"] != -100).sum())
    assert fresh.forward_loss(mb).item() / n == pytest.approx(source, abs=1e-6)


def test_sharded_export_and_pickle_refusal(exported, tmp_path):
    _, root, out = exported
    src, _, _ = load_for_generation(root / "run")
    files = save_hf(src.state_dict(), src.args, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = [f for f in files if f.name.startswith("model-")]
    assert len(shards) > 3 and (tmp_path / "sharded" / "model.safetensors.index.json") in files
    assert read_hf_state_dict(tmp_path / "sharded").keys() == read_hf_state_dict(out).keys()
    model, _ = load_hf_pretrained(tmp_path / "sharded")
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), model.parameters()))
    bad = tmp_path / "pickled"
    bad.mkdir()
    (bad / "config.json").write_text((out / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle files are never loaded"):
        load_hf_pretrained(bad)


def test_mismatch_and_unknown_type(exported, tmp_path):
    family, _, out = exported
    other = "qwen3" if family == "llama3" else "llama3"
    from llmtrain.models import FAMILIES, build_model

    wrong = build_model(FAMILIES[other].flavor_args("debug"), "cpu")
    with pytest.raises(CheckpointError, match="does not match the configured model"):
        init_from_hf(wrong, out)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="gpt2"):
        load_hf_pretrained(odd)
    assert cli_main(["export", str(tmp_path / "nowhere"), "--to", "hf", str(tmp_path / "x")]) == 2
    assert cli_main(["export", str(tmp_path), "--to", "onnx", str(tmp_path / "x")]) == 2
