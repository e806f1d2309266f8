"""Config system: YAML round trip, dotted overrides, every class of user error, the two seed files, ParallelDims."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.config import (
    Config,
    DatasetSpec,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)
from llmtrain.config.schema import ParallelConfig
from llmtrain.distributed.parallel_dims import ParallelDims, default_world_size
from llmtrain.errors import ConfigError, DataError
from llmtrain.resolve import derive, validate

REPO = Path(__file__).resolve().parents[1]
SEED_NATIVE = REPO / "configs" / "seed" / "llm_pretrain.yaml"
SEED_70B = REPO / "configs" / "seed" / "pretrain_llama3_70b_64card.yaml"

DEBUG = {"model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32}}


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def debug_cfg(*overrides: str) -> Config:
    return config_from_dict(apply_overrides(DEBUG, overrides))


def write_dataset(prefix: Path, sha: str, vocab: int) -> str:
    """A dataset prefix with a manifest in the `prepare` format: one 10-token document (ids 0-9) in a real
    MMIDIDX .bin/.idx (check verifies the index), the manifest naming a tokenizer by sha only."""
    import numpy as np

    from llmtrain.data.indexed import IndexedDatasetWriter

    prefix.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedDatasetWriter(str(prefix), np.dtype("uint16"))
    writer.add_document(np.arange(10, dtype=np.uint16))
    writer.finalize()
    manifest = {
        "format": "llmtrain.tokens",
        "version": 1,
        "tokenizer": {"file": "t.json", "kind": "hf", "sha256": sha, "vocab_size": vocab, "eos_id": 0},
        "dtype": "uint16",
        "documents": 1,
        "tokens": 10,
        "files": {},
    }
    Path(f"{prefix}.manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return str(prefix)


# ----------------------------------------------------------------------------------------------- round trip


def test_save_load_round_trip(tmp_path):
    cfg = config_from_dict(
        {
            "model": {
                "flavor": "debug",
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "seq_length": 64,
            },
            "parallel": {"tensor_parallel": 2, "zero_stage": 3},
            "train": {"lr": 1.5e-4, "batch_size": 16, "grad_clip_norm": None, "loss_scale": 1024.0},
            "data": {"datasets": [{"path": "a", "weight": 0.25}, "b"], "tokenizer": "tok.json"},
            "run": {"name": "中文 run"},
        }
    )
    assert cfg.data.datasets == [DatasetSpec("a", 0.25), DatasetSpec("b", 1.0)]
    path = tmp_path / "sub" / "saved.yaml"
    save_config(cfg, path)
    loaded, notes = load_config(path)
    assert loaded == cfg and notes == []
    assert config_to_dict(loaded)["train"]["lr"] == 1.5e-4
    save_config(Config(), tmp_path / "default.yaml")
    assert load_config(tmp_path / "default.yaml")[0] == Config()


def test_yaml11_numbers_and_coercion(tmp_path):
    path = write(tmp_path, "train:\n  lr: 1e-4\n  min_lr: 1e-6\n  max_steps: 1e3\n  batch_size: '32'\n")
    cfg, _ = load_config(path)
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.min_lr == 1e-6
    assert cfg.train.max_steps == 1000 and isinstance(cfg.train.max_steps, int)
    assert cfg.train.batch_size == 32


# ----------------------------------------------------------------------------------------------- overrides


def test_dotted_overrides(tmp_path):
    path = write(tmp_path, "model:\n  flavor: debug\ntrain:\n  lr: 3.0e-4\n")
    cfg, _ = load_config(
        path,
        [
            "train.lr=1e-3",
            "data.datasets=[{path: x, weight: 1}, {path: y, weight: 3}]",
            "train.decay_steps=null",
            "model.rope_scaling={factor: 4}",
            "model.rope_scaling.factor=8",
            "parallel.tensor_parallel=2",
            "run.output_dir=runs/a=b",
        ],
    )
    assert cfg.train.lr == 1e-3
    assert cfg.data.datasets == [DatasetSpec("x", 1.0), DatasetSpec("y", 3.0)]
    assert cfg.train.decay_steps is None
    assert cfg.model.rope_scaling == {"factor": 8}
    assert cfg.parallel.tensor_parallel == 2
    assert cfg.run.output_dir == "runs/a=b"  # only the first '=' splits


def test_override_errors():
    with pytest.raises(ConfigError, match=r"'train\.lrr'.*did you mean 'train\.lr'"):
        apply_overrides({}, ["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"not of the form section\.key=value"):
        apply_overrides({}, ["train.lr"])
    with pytest.raises(ConfigError, match=r"unknown key 'trian'.*did you mean 'train'"):
        apply_overrides({}, ["trian.lr=1"])
    with pytest.raises(ConfigError, match=r"train\.lr is a single value"):
        apply_overrides({}, ["train.lr.x=1"])


# ----------------------------------------------------------------------------------------------- file errors


def test_unknown_key_names_file_key_and_suggestion(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.1\n  warmup_step: 10\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and "'train.warmup_step'" in msg and "did you mean 'train.warmup_steps'" in msg
    path = write(tmp_path, "lr: 0.1\n", "top.yaml")
    with pytest.raises(ConfigError, match=r"unknown top-level section 'lr'.*did you mean 'train\.lr'"):
        load_config(path)
    path = write(tmp_path, "modle:\n  flavor: debug\n", "typo.yaml")
    with pytest.raises(ConfigError, match=r"'modle'.*did you mean 'model'"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lr=abc", "train.lr: expected a number, got 'abc'"),
        ("train.max_steps=2.5", "train.max_steps: expected an integer, got 2.5"),
        ("train.compile=3", "train.compile: expected true or false, got 3"),
        ("data.datasets=x", "data.datasets: expected a list, got 'x'"),
        ("model={a: 1}", "unknown key 'model.a'"),
        ("train.lr=.nan", "train.lr: expected a number > 0, got nan"),
    ],
)
def test_wrong_types(tmp_path, override, expected):
    path = write(tmp_path, "model:\n  flavor: debug\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, [override])
    assert expected in str(e.value) and str(path) in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="line 3"):
        load_config(write(tmp_path, "train:\n  lr: 1\n  bad: ]\n", "a.yaml"))
    with pytest.raises(ConfigError, match="'lr' appears twice"):
        load_config(write(tmp_path, "train:\n  lr: 1\n  lr: 2\n", "b.yaml"))
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n", "c.yaml"))


# ----------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("train.decay_style=cosin", r"train\.decay_style: 'cosin' is not one of .*did you mean 'cosine'"),
        ("train.precision=float16", r"train\.precision: 'float16' is not one of fp32, bf16, fp16"),
        ("train.optimizer=sgd", r"train\.optimizer: 'sgd' is not one of adamw"),
        ("run.device_target=tpu", r"run\.device_target: 'tpu' is not one of auto, cpu, cuda, npu"),
        ("parallel.schedule=1F1B", r"parallel\.schedule: '1F1B' .*did you mean '1f1b'"),
        ("train.lr=-1", r"train\.lr: expected a number > 0, got -1"),
        ("train.beta2=1.0", r"train\.beta2: expected a number in \[0, 1\)"),
        ("checkpoint.keep_checkpoint_max=0", r"checkpoint\.keep_checkpoint_max: expected an integer >= 1"),
        ("parallel.zero_stage=4", r"parallel\.zero_stage: expected 0, 1, 2, 3 or null, got 4"),
        ("train.min_lr=0.1", r"train\.min_lr 0\.1 is larger than train\.lr"),
        ("train.loss_scale=big", r"train\.loss_scale: expected 'dynamic' or a number > 0, got 'big'"),
        ("data.datasets=[{path: a, weight: 0}]", r"data\.datasets\[0\]\.weight: expected a number > 0"),
    ],
)
def test_choices_and_ranges(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(debug_cfg(override), require_data=False)


def test_batch_divisibility():
    cfg = debug_cfg("train.batch_size=12", "train.micro_batch_size=2")
    assert derive(cfg, world_size=2).grad_accum == 3  # 12 = 2 x 2 x 3
    with pytest.raises(
        ConfigError, match=r"train\.batch_size 12 .* train\.micro_batch_size 2 x data-parallel size 4 = 8"
    ):
        validate(cfg, world_size=4, require_data=False)
    cfg = debug_cfg("train.batch_size=12", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2")
    with pytest.raises(
        ConfigError, match=r"train\.gradient_accumulation_steps 2 = 8; set gradient_accumulation"
    ):
        validate(cfg, world_size=2, require_data=False)


def test_model_shape_errors():
    with pytest.raises(ConfigError, match=r"model\.num_heads"):
        validate(debug_cfg("model.hidden_size=66"), require_data=False)  # 4 heads do not divide 66
    with pytest.raises(ConfigError, match=r"model\.num_kv_heads"):
        validate(debug_cfg("model.num_kv_heads=3"), require_data=False)
    with pytest.raises(
        ConfigError, match=r"model\.num_kv_heads 2 is not divisible by parallel\.tensor_parallel 4"
    ):
        validate(debug_cfg("parallel.tensor_parallel=4"), world_size=4, require_data=False)
    with pytest.raises(ConfigError, match=r"model\.num_layers 2 is fewer than the pipeline stages"):
        validate(debug_cfg("parallel.pipeline_parallel=4"), world_size=4, require_data=False)


def test_parallel_degrees_vs_world_size():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tensor_parallel 4"):
        validate(debug_cfg("parallel.tensor_parallel=4"), world_size=6, require_data=False)
    with pytest.raises(
        ConfigError, match=r"data_parallel 4 x tensor_parallel 2 .* = 8, but the world size is 6"
    ):
        validate(
            debug_cfg("parallel.data_parallel=4", "parallel.tensor_parallel=2"),
            world_size=6,
            require_data=False,
        )


def test_datasets_vocab_and_tokenizer(tmp_path):
    a = write_dataset(tmp_path / "a", sha="aa" * 32, vocab=1000)
    b = write_dataset(tmp_path / "b", sha="bb" * 32, vocab=1000)
    cfg = debug_cfg(f"data.datasets=[{{path: {a}}}]", "model.vocab_size=null")
    assert validate(cfg) == []
    assert derive(cfg).model_args.vocab_size == 1000  # the tokenizer's vocabulary, from the manifest
    with pytest.raises(
        ConfigError, match=r"model\.vocab_size 512 is smaller than the tokenizer's vocabulary 1000"
    ):
        validate(debug_cfg(f"data.datasets=[{{path: {a}}}]", "model.vocab_size=512"))
    with pytest.raises(ConfigError, match=r"data\.datasets\[1\] was tokenized with a different tokenizer"):
        validate(debug_cfg(f"data.datasets=[{{path: {a}}}, {{path: {b}}}]"))

    from llmtrain.data.prep.tokenizer_training import train_bpe

    tok = train_bpe(["hello world, hello tokens"] * 20, 300, str(tmp_path / "tok.json"))
    c = write_dataset(tmp_path / "c", sha=tok.sha256, vocab=tok.vocab_size)
    assert validate(debug_cfg(f"data.datasets=[{{path: {c}}}]", f"data.tokenizer={tok.path}")) == []
    with pytest.raises(ConfigError, match=r"data\.tokenizer .* is not the tokenizer data\.datasets\[0\]"):
        validate(debug_cfg(f"data.datasets=[{{path: {a}}}]", f"data.tokenizer={tok.path}"))


def test_missing_data_is_error_for_train_warning_for_check(tmp_path):
    cfg = debug_cfg(f"data.datasets=[{{path: {tmp_path / 'nope'}}}]")
    with pytest.raises(DataError, match=r"data\.datasets\[0\]: dataset prefix .*nope"):
        validate(cfg, require_data=True)
    warnings = validate(cfg, require_data=False)
    assert any("nope" in w and "llmtrain train" in w for w in warnings)
    with pytest.raises(ConfigError, match=r"data\.datasets is empty"):
        validate(debug_cfg(), require_data=True)


# ----------------------------------------------------------------------------------------------- seeds


def test_seed_native_llm_pretrain():
    cfg, notes = load_config(SEED_NATIVE)
    p, t = cfg.parallel, cfg.train
    assert (cfg.model.model_type, cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == (
        "llama", 8192, 80, 64,
    )  # fmt: skip
    assert (cfg.model.seq_length, cfg.model.vocab_size) == (4096, 32000)
    assert (p.tensor_parallel, p.pipeline_parallel, p.data_parallel, p.effective_zero_stage()) == (
        8,
        4,
        -1,
        3,
    )
    assert (p.micro_batch_num, p.schedule, p.virtual_stages) == (2, "interleaved_1f1b", 2)
    assert (t.epochs, t.batch_size, t.lr, t.min_lr, t.warmup_steps, t.loss_scale) == (
        2,
        512,
        1e-4,
        1e-5,
        1000,
        "dynamic",
    )
    assert t.compile is True and cfg.run.device_target == "npu"
    text = "\n".join(notes)
    for key in ("run.mode", "run.enable_graph_kernel", "run.graph_kernel_flags", "run.device_target"):
        assert key in text
    assert default_world_size(p) == 32
    warnings = validate(cfg, world_size=32, require_data=False)
    d = derive(cfg, world_size=32)
    assert (d.data_parallel, d.grad_accum, d.global_batch, d.tokens_per_step) == (1, 512, 512, 512 * 4096)
    assert any("warmup_steps 1000 >= train.max_steps 100" in w for w in warnings)
    assert validate(cfg, world_size=64, require_data=False) is not None  # dp 2, grad-acc 256
    assert derive(cfg, world_size=64).grad_accum == 256


def test_seed_mindformers_70b():
    cfg, notes = load_config(SEED_70B)
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.checkpoint
    assert (m.model_type, m.flavor, m.seq_length, m.intermediate_size, m.rms_norm_eps) == (
        "llama3", "70b", 8192, 28672, 1e-5,
    )  # fmt: skip
    assert m.rope_scaling == 1.0  # explicit identity: no scaling
    assert (p.tensor_parallel, p.pipeline_parallel, p.data_parallel, p.zero_stage) == (4, 2, 8, 2)
    assert (t.lr, t.min_lr, t.decay_steps, t.decay_style, t.gradient_accumulation_steps) == (
        1e-4, 1e-6, 1_200_000, "cosine", 4,
    )  # fmt: skip
    assert (t.batch_size, t.micro_batch_size, t.max_steps, t.epochs) == (64, 2, 1_200_000, 1)
    assert (t.weight_decay, t.beta1, t.beta2, t.grad_clip_norm, t.loss_scale) == (
        0.01,
        0.9,
        0.999,
        1.0,
        "dynamic",
    )
    assert (t.log_steps, t.eval_steps, c.save_steps, c.keep_checkpoint_max) == (100, 5000, 1000, 20)
    assert cfg.data.datasets == [DatasetSpec("/mnt/pretrain_data/llama3_70b_8192", 1.0)]
    text = "\n".join(notes)
    for key in ("run_mode", "model_size", "batch_size", "rope_scaling", "CosineAnnealingLR", "dynamic_loss_scale",
                "train_dataset_dir", "num_train_epochs"):  # fmt: skip
        assert key in text, key
    warnings = validate(cfg, world_size=64, require_data=False)
    assert any("enable_alltoall" in w for w in warnings)
    assert any("/mnt/pretrain_data/llama3_70b_8192" in w for w in warnings)
    d = derive(cfg, world_size=64)
    assert (d.data_parallel, d.grad_accum, d.global_batch) == (8, 4, 64)  # 64 = 2 x 8 x 4
    assert d.tokens_per_step == 64 * 8192 and d.total_tokens == 1_200_000 * 64 * 8192
    assert abs(d.num_params - 70.55e9) < 0.05e9
    assert d.model_args.rope_scaling in (None, {"rope_type": "linear", "factor": 1.0})
    with pytest.raises(ConfigError, match="world size is 32"):
        validate(cfg, world_size=32, require_data=False)
    with pytest.raises(DataError, match="llama3_70b_8192"):
        validate(cfg, world_size=64, require_data=True)


def test_mindformers_errors(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"'parallel_config\.tensor_paralel'.*did you mean 'parallel_config\.tensor_parallel'",
    ):
        load_config(write(tmp_path, "model_size: 8b\nparallel_config:\n  tensor_paralel: 2\n"))
    with pytest.raises(ConfigError, match=r"run_mode 'predict' is not supported"):
        load_config(write(tmp_path, "run_mode: predict\n", "b.yaml"))
    with pytest.raises(ConfigError, match=r"optimizer\.lr_scheduler\.type: 'Polynomial' is not supported"):
        load_config(write(tmp_path, "optimizer:\n  lr_scheduler:\n    type: Polynomial\n", "c.yaml"))
    with pytest.raises(ConfigError, match=r"mixes the MindFormers flat layout"):
        load_config(write(tmp_path, "model_size: 8b\ntrain:\n  lr: 1\n", "d.yaml"))
    # command-line overrides apply after the adapter, in native names
    cfg, _ = load_config(SEED_70B, ["train.lr=2e-4", "parallel.data_parallel=-1"])
    assert cfg.train.lr == 2e-4 and cfg.parallel.data_parallel == -1


def test_run_mode_values(tmp_path):
    cfg, notes = load_config(write(tmp_path, "run:\n  mode: 1\n  device_target: GPU\n"))
    assert cfg.train.compile is False and cfg.run.device_target == "cuda"
    cfg, notes = load_config(write(tmp_path, "run:\n  mode: 0\ntrain:\n  compile: false\n", "b.yaml"))
    assert cfg.train.compile is False and "train.compile is given explicitly" in "\n".join(notes)
    with pytest.raises(ConfigError, match=r"run\.mode: expected 0 \(GRAPH_MODE"):
        load_config(write(tmp_path, "run:\n  mode: 2\n", "c.yaml"))


# ----------------------------------------------------------------------------------------------- ParallelDims


def test_parallel_dims_from_config():
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel=2, pipeline_parallel=2), 16)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp, dims.tp, dims.pp) == (
        4,
        1,
        4,
        2,
        2,
    )  # ZeRO 0: replicas
    dims = ParallelConfig(tensor_parallel=2, zero_stage=3, data_parallel_replicate=2)
    dims = ParallelDims.from_config(dims, 16)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp, dims.fsdp_enabled) == (2, 4, 8, True)
    assert dims.mesh_shape() == {"pp": 1, "dp_replicate": 2, "dp_shard": 4, "cp": 1, "tp": 2}
    with pytest.raises(
        ConfigError, match=r"data_parallel_replicate 3 does not divide the data-parallel size 8"
    ):
        ParallelDims.from_config(ParallelConfig(data_parallel_replicate=3), 8)
    with pytest.raises(ConfigError, match=r"expert_parallel 3 must divide"):
        ParallelDims.from_config(ParallelConfig(expert_parallel=3), 8)
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel: expected an integer >= 1, got 0"):
        ParallelDims.from_config(ParallelConfig(tensor_parallel=0), 8)
    with pytest.raises(ConfigError, match=r"do not equal the world size 8"):
        ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=1, cp=1, ep=1, world_size=8)


def test_build_mesh_single_process():
    import torch.distributed as dist

    dims = ParallelDims.from_config(ParallelConfig(), 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        meshes = dims.build_meshes("cpu")
        assert meshes["world"].mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert {name: m.size() for name, m in meshes.items()} == dict.fromkeys(meshes, 1)
        assert meshes["dp"].mesh_dim_names == ("dp",) and meshes["tp"].mesh_dim_names == ("tp",)
    finally:
        dist.destroy_process_group()


_MESH_SCRIPT = """
import json, sys
from pathlib import Path
import torch.distributed as dist
import torch.multiprocessing as mp
from llmtrain.config.schema import ParallelConfig
from llmtrain.distributed.parallel_dims import ParallelDims

def worker(rank, world_size, out_dir):
    store = dist.FileStore(str(Path(out_dir, "store")), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        meshes = ParallelDims.from_config(ParallelConfig(tensor_parallel=2, zero_stage=3), world_size).build_meshes("cpu")
        groups = {n: sorted(dist.get_process_group_ranks(m.get_group())) for n, m in meshes.items() if n != "world"}
        Path(out_dir, f"{rank}.json").write_text(json.dumps(groups))
    finally:
        dist.destroy_process_group()

if __name__ == "__main__":
    # fork from this fresh interpreter: the children inherit the imported torch (spawn re-imports it 4 times)
    mp.start_processes(worker, args=(4, sys.argv[1]), nprocs=4, join=True, start_method="fork")
"""


def test_build_meshes_four_processes(tmp_path):
    script = tmp_path / "mesh.py"
    script.write_text(_MESH_SCRIPT, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    groups = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    # world 4 = dp_shard 2 x tp 2, row-major: tp neighbours are consecutive ranks
    assert [g["tp"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["dp_shard"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["dp"] for g in groups] == [g["dp_shard_cp"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(g["pp"] == [r] and g["dp_replicate"] == [r] for r, g in enumerate(groups))
