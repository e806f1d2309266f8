"""One feasibility check for parallel layouts (``llmtrain.feasibility``), seen the same way by every consumer.

For every fatal rule in ``RULES``: ``llmtrain check CONFIG --world-size N`` exits 2 with the message (no
traceback), and what ``llmtrain train`` runs before building (``load_config`` + ``validate(cfg, world_size,
require_data=True)``, as in ``commands/train.py``) raises a ConfigError with the same text, which is also the
first fatal problem ``layout_problems`` reports for that rule. Two rules that used to be refused only inside
``parallelize`` (after the process groups were up) go through a real ``llmtrain train`` under 2 gloo processes;
the builders' own assertion gives the same text. The planner's search proposes no candidate that training
refuses (each candidate is written as a user would and validated), and the module imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmtrain.cli import main as cli_main
from llmtrain.config import apply_overrides, config_from_dict, load_config
from llmtrain.errors import ConfigError
from llmtrain.feasibility import FATAL_RULES, RULES, layout_problems
from llmtrain.resolve import check_config, derive, validate

MOE = ["model.model_type=qwen3", "model.flavor=debug_moe"]
PP2 = ["model.num_layers=4", "parallel.pipeline_parallel=2"]

# fatal rule -> (world size, overrides of the base config) that make it the first fatal problem
CASES: dict[str, tuple[int, list[str]]] = {
    "world_size": (0, []),
    "degree_min": (2, ["parallel.tensor_parallel=0"]),
    "dp_derive": (6, ["parallel.tensor_parallel=4"]),
    "dp_value": (2, ["parallel.data_parallel=0"]),
    "world_product": (6, ["parallel.data_parallel=4", "parallel.tensor_parallel=2"]),
    "hsdp_replicate": (2, ["parallel.zero_stage=3", "parallel.data_parallel_replicate=3"]),
    "ep_divides": (2, ["parallel.expert_parallel=3"]),
    "cp_seq": (2, ["parallel.context_parallel=2", "model.seq_length=30"]),
    "tp_heads": (3, ["parallel.tensor_parallel=3"]),
    "tp_kv_heads": (4, ["parallel.tensor_parallel=4"]),
    "tp_ffn": (2, ["parallel.tensor_parallel=2", "model.intermediate_size=255"]),
    "tp_seq": (2, ["parallel.tensor_parallel=2", "model.seq_length=31"]),
    "tp_moe_ffn": (2, [*MOE, "parallel.tensor_parallel=2", "model.moe.moe_hidden_size=63"]),
    "ep_without_moe": (2, ["parallel.expert_parallel=2", "parallel.zero_stage=3"]),
    "ep_experts": (3, [*MOE, "parallel.expert_parallel=3", "train.batch_size=6"]),
    "pipeline_layers_without_pp": (1, ["parallel.pipeline_layers=[1, 1]"]),
    "pp_layers_min": (4, ["parallel.pipeline_parallel=4"]),
    "pp_single_stage": (2, [*PP2, "parallel.schedule=gpipe", "parallel.virtual_stages=2"]),
    "pp_zbv_stages": (2, [*PP2, "parallel.schedule=zbv"]),
    "pp_1f1b_microbatches": (2, [*PP2, "train.micro_batch_size=8"]),
    "pp_dualpipev_microbatches": (2, [*PP2, "parallel.schedule=dualpipev", "parallel.virtual_stages=2",
                                      "train.micro_batch_size=4"]),
    "pp_rounds": (2, [*PP2, "parallel.schedule=zero_bubble", "parallel.virtual_stages=2", "parallel.micro_batch_num=5"]),
    "pp_batch_split": (4, [*PP2, "parallel.micro_batch_num=3"]),
    "pp_even_split": (2, [*PP2, "model.num_layers=6", "parallel.schedule=zbv", "parallel.virtual_stages=2"]),
    "pipeline_layers_shape": (2, [*PP2, "parallel.pipeline_layers=[1, 2]"]),
    "pipeline_layers_entries": (2, [*PP2, "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                                    "parallel.pipeline_layers=[2, 0, 1, 1]"]),
}  # fmt: skip
# the texts that pin each message to its numbers (the rest of the paragraph is checked by equality)
NEEDLES = {
    "world_size": "integer >= 1, got 0",
    "dp_derive": "world size 6 is not divisible by tensor_parallel 4",
    "world_product": "data_parallel 4 x tensor_parallel 2 x pipeline_parallel 1 x context_parallel 1 = 8",
    "tp_heads": "model.num_heads 4 is not divisible by parallel.tensor_parallel 3",
    "tp_kv_heads": "model.num_kv_heads 2 is not divisible by parallel.tensor_parallel 4",
    "tp_ffn": "model.intermediate_size 255 is not divisible by parallel.tensor_parallel 2",
    "tp_seq": "model.seq_length 31 is not divisible by parallel.tensor_parallel 2",
    "ep_divides": "x tensor-parallel (2 x 1 x 1 = 2)",
    "ep_experts": "num_experts 4 is not divisible by parallel.expert_parallel 3",
    "tp_moe_ffn": "model.moe.moe_hidden_size 63 is not divisible by parallel.tensor_parallel 2",
    "pp_layers_min": "pipeline_parallel 4 x virtual_stages 1 = 4",
    "pp_batch_split": "data-parallel size 2 x 3 pipeline micro-batches (parallel.micro_batch_num) = 6",
    "pp_rounds": "5 pipeline micro-batches (parallel.micro_batch_num) must be a multiple of its 2 rounds",
    "pp_even_split": "model.num_layers 6 is not divisible by pipeline_parallel 2 x virtual_stages 2 = 4",
    "pipeline_layers_shape": "it has 2 entries summing to 3",
}


def base(prefix: str) -> dict:
    return {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32, "tie_word_embeddings": False},
        "train": {"batch_size": 8, "micro_batch_size": 2, "max_steps": 2, "log_steps": 1},
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.1},
        "checkpoint": {"save_steps": 0, "save_at_end": False, "resume": "none"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False},
        "run": {"device_target": "cpu", "output_dir": "unused", "threads": 1},
    }


@pytest.fixture(scope="module")
def config_file(tiny_corpus, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("feasibility") / "run.yaml"
    path.write_text(yaml.safe_dump(base(tiny_corpus)), encoding="utf-8")
    return path


def trainer_verdict(path: Path, overrides: list[str], world: int) -> str | None:
    """What `llmtrain train` does before building (commands/train.py): the ConfigError text, or None if it passes."""
    cfg, _ = load_config(path, overrides)
    try:
        validate(cfg, world_size=world, require_data=True)
    except ConfigError as e:
        return str(e)
    return None


def check_cli(capsys, path: Path, overrides: list[str], world: int) -> tuple[int, str, str]:
    rc = cli_main(["check", str(path), *overrides, "--world-size", str(world)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_every_fatal_rule_has_a_case():
    assert set(CASES) == set(FATAL_RULES)
    assert len(FATAL_RULES) == 26 and {"tp_vocab", "tp_compile", "pp_bubble"} <= set(RULES) - set(FATAL_RULES)


# Degrees out of range are refused as the file is read (config/ranges.py), before any layout rule: the rule
# still guards configs built in code (the planner's candidates); the CLI names the key and the range.
READ_TIME = {
    "degree_min": "parallel.tensor_parallel: expected",
    "dp_value": "parallel.data_parallel: expected -1 or",
}


@pytest.mark.parametrize("rule", list(CASES))
def test_check_and_train_give_the_same_refusal(rule, config_file, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    world, overrides = CASES[rule]
    if rule in READ_TIME:
        with pytest.raises(ConfigError, match=READ_TIME[rule]):
            load_config(config_file, overrides)
        rc, out, err = check_cli(capsys, config_file, overrides, world)
        assert rc == 2 and out == "" and "Traceback" not in err and READ_TIME[rule] in err
        cfg, _ = load_config(config_file, [])
        key, value = overrides[0].split("=")
        cfg.parallel = dataclasses.replace(cfg.parallel, **{key.split(".")[1]: int(value)})  # built in code
        first = next(p for p in layout_problems(cfg, world) if p.fatal)
        assert first.rule == rule and RULES[rule].fatal
        return
    message = trainer_verdict(config_file, overrides, world)
    assert message is not None, f"{rule}: training's validation accepted {overrides} on {world}"
    rc, out, err = check_cli(capsys, config_file, overrides, world)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert err == f"llmtrain check: error: {message}\n"
    # ... and it is this rule's own message, first among layout_problems' fatal problems
    cfg, _ = load_config(config_file, overrides)
    try:
        args = derive(cfg, world).model_args
    except ConfigError:  # the degree rules: derive (ParallelDims.from_config) raises them itself
        args = None
    first = next(p for p in layout_problems(cfg, world, args) if p.fatal)
    assert (first.rule, first.message) == (rule, message)
    assert first.key in message and RULES[rule].fatal
    assert NEEDLES.get(rule, first.key) in message


@pytest.mark.parametrize(
    "rule, world, overrides, needle",
    [  # the two former disagreements, now warnings everywhere (training runs them)
        ("tp_vocab", 2, ["parallel.tensor_parallel=2", "model.vocab_size=513"], "vocabulary 513 is not divisible"),
        ("tp_compile", 2, ["parallel.tensor_parallel=2", "train.compile=true"], "train.compile is ignored"),
        ("pp_compile_zero_bubble", 2, [*PP2, "parallel.micro_batch_num=4",
                                       "parallel.schedule=zero_bubble", "parallel.virtual_stages=2",
                                       "train.compile=true"], "train.compile is ignored with parallel.schedule"),
    ],
)  # fmt: skip
def test_warnings_are_warnings_in_check_and_train(rule, world, overrides, needle, config_file, capsys):
    cfg, _ = load_config(config_file, overrides)
    warnings = validate(cfg, world_size=world, require_data=True)
    (mine,) = [w for w in warnings if needle in w]
    assert not RULES[rule].fatal
    rc, out, err = check_cli(capsys, config_file, overrides, world)
    assert rc == 0 and f"- {mine}" in out.split("# warnings\n", 1)[1] and err == ""


def test_builders_assert_with_the_same_message(config_file):
    """parallelize / PipelineRunner refuse with validation's text if reached without it (no process group)."""
    from llmtrain.distributed.parallel_dims import ParallelDims
    from llmtrain.distributed.parallelize import parallelize
    from llmtrain.distributed.pipeline import PipelineRunner
    from llmtrain.models import build_model

    for rule, runner in (
        ("ep_experts", False),
        ("pp_1f1b_microbatches", True),
    ):
        world, overrides = CASES[rule]
        message = trainer_verdict(config_file, overrides, world)
        cfg, _ = load_config(config_file, overrides)
        d = derive(cfg, world, vocab_size=512)
        model = build_model(d.model_args)  # meta device
        with pytest.raises(ConfigError) as e:
            if runner:
                PipelineRunner(cfg, d.dims, {}, model, None, None)  # type: ignore[arg-type]
            else:
                parallelize(model, cfg, d.dims, None, "cpu")
        assert str(e.value) == message, rule
    assert ParallelDims.from_config(load_config(config_file)[0].parallel, 2).dp == 2


@pytest.mark.parametrize("rule", ["tp_moe_ffn", "ep_without_moe"])
def test_real_train_under_two_gloo_processes(rule, config_file, tmp_path):
    """Refused before any process group: `llmtrain train` under torchrun prints the check message, exits 2."""
    world, overrides = CASES[rule]
    assert world == 2
    message = trainer_verdict(config_file, overrides, world)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "llmtrain", "train", str(config_file), *overrides, f"run.output_dir={tmp_path / 'run'}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    # every rank that got to print printed the same message; the agent may stop the slower one first (SIGTERM)
    assert proc.stderr.count(f"llmtrain train: error: {message}\n") >= 1, proc.stderr[-3000:]
    # ... and no rank printed another one: each occurrence starts the same message (two ranks writing to the one
    # pipe at once may interleave, and the agent's SIGTERM may cut the slower rank short)
    for part in proc.stderr.split("llmtrain train: error: ")[1:]:
        line = part.split("\n", 1)[0]
        assert message.startswith(line) or line.startswith(message), (line, message)
    assert "exitcode  : 2" in proc.stderr and "Traceback" not in proc.stderr.split("llmtrain train: error")[0]


def test_planner_proposes_only_what_training_runs(tiny_corpus):
    """Every search candidate, written as a user would write it, passes training's validation."""
    from llmtrain.plan.catalog import load_catalog, parse_cluster
    from llmtrain.plan.search import candidate_layouts, layout_from_config

    cluster = parse_cluster("8xh100", load_catalog())
    setups = {  # name -> (model overrides, compile)
        "long_seq": (["model.seq_length=32768", "train.batch_size=64"], False),  # CP: trained since issue 17
        "moe": ([*MOE, "train.batch_size=64"], False),  # MoE x TP: refused once, now trained (moe_tp.py)
        "tied": (["model.tie_word_embeddings=true", "train.batch_size=64"], False),  # tied x PP: trained
        "vocab_513": (["model.vocab_size=513", "train.batch_size=64"], True),  # uneven vocab: now proposed
    }
    seen: dict[str, set] = {}
    for name, (overrides, compile_) in setups.items():
        d0 = apply_overrides(base(tiny_corpus), [*overrides, f"train.compile={str(compile_).lower()}"])
        layout, args, tokens = layout_from_config(config_from_dict(d0), 8)
        global_batch = tokens // layout.seq_length
        cands = candidate_layouts(args, layout, cluster, global_batch, compile=compile_)
        assert len(cands) >= 20, name
        # Candidates that differ only in what a run config cannot say (recompute) are one config: each distinct
        # config is checked by training's validation without the data (the layout, batch, fp8 and long-context
        # rules: raises for a refused layout), and the data checks, which do not depend on the layout, run in
        # full once per degree tuple (tp, pp, cp, ep, dp).
        checked: set[tuple] = set()
        with_data: set[tuple] = set()
        for lay in cands:
            key = (lay.tp, lay.pp, lay.cp, lay.ep, lay.dp, lay.zero_stage, lay.schedule, lay.virtual_stages,
                   lay.micro_batch_size)  # fmt: skip
            if key in checked:
                continue
            checked.add(key)
            user = [f"parallel.tensor_parallel={lay.tp}", f"parallel.pipeline_parallel={lay.pp}",
                    f"parallel.context_parallel={lay.cp}", f"parallel.expert_parallel={lay.ep}",
                    f"parallel.data_parallel={lay.dp}", f"parallel.zero_stage={lay.zero_stage}",
                    f"parallel.schedule={lay.schedule}", f"parallel.virtual_stages={lay.virtual_stages}",
                    f"train.micro_batch_size={lay.micro_batch_size}"]  # fmt: skip
            cfg = config_from_dict(apply_overrides(d0, user))
            derived, _ = check_config(cfg, world_size=8, require_data=False)  # raises for a refused layout
            assert derived.grad_accum == lay.grad_accum
            if key[:5] not in with_data:
                with_data.add(key[:5])
                validate(cfg, world_size=8, require_data=True)
                assert not [p for p in layout_problems(cfg, 8, args) if p.fatal]
        seen[name] = {(lay.tp, lay.pp, lay.cp) for lay in cands}
    assert {cp for _, _, cp in seen["long_seq"]} == {1, 2, 4, 8}  # each one validated above
    assert {cp for _, _, cp in seen["moe"]} == {1, 2, 4, 8}  # CP x MoE: trained since issue 28
    assert {tp for tp, _, _ in seen["long_seq"]} == {1, 2} and (1, 2, 1) in seen["long_seq"]  # kv heads 2
    assert (
        {tp for tp, _, _ in seen["moe"]} == {1, 2} and (1, 2, 1) in seen["moe"] and (2, 1, 1) in seen["moe"]
    )
    assert {pp for _, pp, _ in seen["tied"]} == {1, 2} and (2, 1, 1) in seen["tied"]  # tied x PP: trained
    assert (2, 1, 1) in seen["vocab_513"]  # compile with TP: a warning, so TP 2 is proposed too
    # the refused layouts really are refused (the filter is not vacuous)
    over = [*MOE, "parallel.tensor_parallel=2", "parallel.expert_parallel=8", "parallel.zero_stage=3"]
    moe = config_from_dict(apply_overrides(base(tiny_corpus), over))
    assert [p.rule for p in layout_problems(moe, 8, derive(moe, 8).model_args) if p.fatal] == ["ep_experts"]


def test_feasibility_imports_no_torch():
    code = """
import json, sys, types
import llmtrain.feasibility as f
from llmtrain.config import config_from_dict
assert "torch" not in sys.modules, "llmtrain.feasibility imported torch"
cfg = config_from_dict({"parallel": {"tensor_parallel": 2, "pipeline_parallel": 2}, "model": {"seq_length": 31}})
shape = types.SimpleNamespace(num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=511, num_layers=4,
                              tie_word_embeddings=True, num_experts=0, num_moe_layers=0)
problems = [(p.rule, p.fatal) for p in f.layout_problems(cfg, 8, shape)]
print(json.dumps({"problems": problems, "no_model": [p.rule for p in f.layout_problems(cfg, 6)],
                  "torch": "torch" in sys.modules}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert got["torch"] is False
    assert got["problems"] == [["tp_seq", True], ["tp_vocab", False]]  # (tied x PP trains: issue 28)
    assert got["no_model"] == ["dp_derive"]  # 6 processes for tp 2 x pp 2


def test_stage_layouts_are_checked(tiny_corpus):
    """A stage that changes model.seq_length is checked against the layout like the base config."""
    d = apply_overrides(base(tiny_corpus), ["parallel.tensor_parallel=2"])
    d["stages"] = [
        {"name": "short", "steps": 1},
        {"name": "odd", "steps": 1, "overrides": {"model.seq_length": 31}},
    ]
    cfg = config_from_dict(d)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2, require_data=True)
    assert str(e.value).startswith(
        "stages[1] (odd): model.seq_length 31 is not divisible by parallel.tensor_parallel 2"
    )
    d["stages"][1]["overrides"] = {"model.seq_length": 64}
    assert validate(config_from_dict(d), world_size=2, require_data=True) is not None
