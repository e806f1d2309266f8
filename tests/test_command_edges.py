"""Every command's edges (issue 34): a user's task file, generate / export / merge / launch values, the events and
catalogs the report and the planner read. One test per class, through the command (in process): exit code 2 with
one message naming the file or flag (or the documented safe result), no traceback, the user's files
byte-identical."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from llmtrain.cli import main as cli

SHIPPED_MC = Path(__file__).resolve().parents[1] / "src/llmtrain/configs/eval/stdlib_mc.yaml"


def run(argv: list[str], capfd) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``llmtrain ARGV`` in process (argparse's own refusals included)."""
    try:
        code = cli(argv)
    except SystemExit as e:  # argparse: exit 2 with its usage line and the flag
        code = int(e.code or 0)
    out, err = capfd.readouterr()
    assert "Traceback" not in err, err[-3000:]
    return code, out, err


def refused(argv: list[str], capfd, *needles: str) -> str:
    """The command exits 2 with one `error:` message holding every needle."""
    code, _, err = run(argv, capfd)
    assert code == 2, (argv, err[-2000:])
    assert "error:" in err and all(n in err for n in needles), (needles, err[-2000:])
    return err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_run(tiny_corpus, tmp_path_factory) -> Path:
    """A tiny 2-step run with its checkpoint at step 2 (written by this llmtrain: it records its tokenizer)."""
    tmp = tmp_path_factory.mktemp("edges")
    cfg = tmp / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_corpus, tmp / "run")))
    assert cli(["train", str(cfg)]) == 0
    return tmp / "run"


# ----------------------------------------------------------------------------- eval: a user's task file
_MC = yaml.safe_load(SHIPPED_MC.read_text())
_DATA = SHIPPED_MC.with_suffix(".jsonl")


def _task(**changes) -> str:
    cfg = {**_MC, "dataset_kwargs": {"data_files": {"test": str(_DATA)}}, "task": "mine", **changes}
    return yaml.safe_dump({k: v for k, v in cfg.items() if v is not ...})


BAD_TASK_FILES = {
    "invalid_yaml": ("task: [unclosed\n", "not valid YAML"),
    "python_tag": ("task: !!python/object/apply:os.system [echo hi]\n", "not valid YAML"),
    "a_list": ("- a\n- b\n", "holds a list"),
    "empty": ("", "is empty"),
    "deep": ("task: deep\nx: " + "[" * 100 + "]" * 100 + "\n", "nested more than"),
    "include_cycle": ("include: include_cycle.yaml\ntask: loop\n", "cycle"),
    "include_missing": ("include: nowhere.yaml\ntask: gone\n", "does not exist"),
    "kwargs_list": (_task(dataset_kwargs=[1, 2]), "dataset_kwargs must be a mapping"),
    "kwargs_files": (_task(dataset_kwargs={"data_files": 5}), "data_files must be"),
    "function_missing": (
        _task().replace("doc_to_text: '{{context}}'", "doc_to_text: !function nomodule.doc_to_text"),
        "nomodule",
    ),
    "class_missing": ("class: !function nomodule.MyTask\ntask: cls\n", "Python task class"),
    "empty_name": (_task(task=""), "task must be a non-empty task name"),
    "number_name": (_task(task=5), "task must be a string"),
    "output_type": (_task(output_type="nonsense"), "output_type must be one of"),
    "not_utf8": (b"\xff\xfe task: x\n", "not UTF-8"),
    "nul": ("task: a\x00b\n", "control character"),
    "num_fewshot": (_task(num_fewshot=-3), "num_fewshot must be an integer >= 0"),
    "generation": (
        _task(output_type="generate_until", generation_kwargs={"until": 5}),
        "generation_kwargs.until must be",
    ),
}


def test_eval_refuses_bad_task_files_naming_them(tiny_run, tmp_path, capfd):
    for name, (text, needle) in BAD_TASK_FILES.items():
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        before = snapshot(tmp_path)
        err = refused(["eval", str(tiny_run), "--tasks", str(path), "--limit", "1"], capfd, needle)
        assert f"{name}.yaml" in err and len(err.strip().splitlines()) <= 2, (name, err)
        assert snapshot(tmp_path) == before, name


def test_eval_num_fewshot_beyond_the_data_and_lm_eval_errors(tiny_run, tmp_path, capfd):
    path = tmp_path / "mine.yaml"
    path.write_text(_task())
    refused(["eval", str(tiny_run), "--tasks", str(path), "--limit", "1", "--num-fewshot", "500"], capfd,
            "500 few-shot examples", "holds only 300", "mine.yaml")  # fmt: skip
    bad_split = tmp_path / "split.yaml"  # lm-eval's own error (a KeyError in datasets) becomes one message
    bad_split.write_text(_task(test_split="nope"))
    refused(["eval", str(tiny_run), "--tasks", str(bad_split), "--limit", "1"], capfd, "split.yaml", "nope")


# ----------------------------------------------------------------------------- generate
def _generated(run_dir: Path, capfd, *flags: str) -> str:
    code, out, err = run(
        ["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "6", *flags], capfd
    )
    assert code == 0, err
    return out


def test_generate_underflowing_values_are_the_greedy_limit(tiny_run, capfd):
    greedy = _generated(tiny_run, capfd, "--temperature", "0")
    for flags in (["--temperature", "1e-300"], ["--temperature", "5e-324"], ["--top-p", "1e-300"],
                  ["--top-p", "5e-324", "--temperature", "1"]):  # fmt: skip
        assert _generated(tiny_run, capfd, *flags) == greedy, flags


def test_generate_refuses_seed_memory_and_bytes(tiny_run, capfd):
    base = ["generate", str(tiny_run), "--max-new-tokens", "2"]
    refused([*base, "--prompt", "x", "--seed", str(2**64)], capfd, "--seed")
    assert _generated(tiny_run, capfd, "--seed", str(2**64 - 1))  # the largest seed torch takes
    err = refused(["generate", str(tiny_run), "--prompt", "x", "--max-new-tokens", str(10**12)], capfd,
                  "max_new_tokens 1000000000000", "new tokens fit")  # fmt: skip
    assert "GiB" in err
    refused([*base, "--prompt", "ab\udcffc"], capfd, "--prompt is not valid UTF-8", "0xff")


def test_generate_and_export_refuse_a_dataset_reprepared_with_another_tokenizer(tiny_run, tmp_path, capfd):
    import glob
    import sysconfig

    from llmtrain.data.prep.prepare import prepare

    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[20:23]
    other = tmp_path / "data" / "other"
    prepare(files, str(other), train_tokenizer=300, log=None)
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    cfg = run_dir / "config.yaml"
    old = yaml.safe_load(cfg.read_text())["data"]["datasets"][0]["path"]
    cfg.write_text(cfg.read_text().replace(old, str(other)))
    before = snapshot(run_dir)
    err = refused(["generate", str(run_dir), "--prompt", "x"], capfd, "re-prepared with another tokenizer",
                  f"{old}.tokenizer.json", f"{other}.tokenizer.json")  # fmt: skip
    assert "vocabulary 512" in err and "vocabulary 300" in err
    refused(["export", str(run_dir), "--to", "hf", str(tmp_path / "hf")], capfd, "another tokenizer")
    assert snapshot(run_dir) == before and not (tmp_path / "hf").exists()


def test_a_checkpoint_without_a_tokenizer_record_loads_with_a_warning(tiny_run, tmp_path, capfd):
    from llmtrain.data.describe import describe_dataset
    from llmtrain.train.sample import check_tokenizer

    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    state = json.loads((tiny_run / "checkpoints/step_00000002/trainer_state.json").read_text())
    assert state["tokenizer"]["vocab_size"] == 512 and len(state["tokenizer"]["sha256"]) == 64
    del state["tokenizer"]  # as an older llmtrain wrote it
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    cfg = yaml.safe_load((tiny_run / "config.yaml").read_text())
    check_tokenizer(ckpt, describe_dataset(cfg["data"]["datasets"][0]["path"], None))
    assert "does not record the tokenizer" in capfd.readouterr().err


# ----------------------------------------------------------------------------- export
def test_export_refuses_the_current_directory_and_odd_shard_sizes(tiny_run, tmp_path, capfd, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for target in (".", "./", "..", str(here)):
        refused(["export", str(tiny_run), "--to", "hf", target], capfd, "the current directory")
    assert list(here.iterdir()) == [] and snapshot(tmp_path) == {}
    for value in ("nan", "inf", "-inf", "0", "-1"):
        refused(
            ["export", str(tiny_run), "--to", "hf", "out", "--max-shard-gb", value], capfd, "--max-shard-gb"
        )
    assert list(here.iterdir()) == []


def test_export_on_a_full_disk_leaves_the_earlier_export_intact(tiny_run, tmp_path, capfd, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    out = tmp_path / "hf"
    assert run(["export", str(tiny_run), "--to", "hf", str(out), "--dtype", "bf16"], capfd)[0] == 0
    before = snapshot(out)
    real = safetensors.torch.save_file

    def full(tensors, filename, metadata=None):  # half a file written, then the disk is full
        real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:100])
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    refused(["export", str(tiny_run), "--to", "hf", str(out)], capfd, "No space left on device",
            f"Nothing was changed at {out}")  # fmt: skip
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# ----------------------------------------------------------------------------- merge
@pytest.fixture()
def partitions(tiny_corpus, tmp_path, capfd) -> str:
    import glob
    import sysconfig

    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:4]
    prefix = str(tmp_path / "merged" / "ds")
    for i in range(2):
        argv = ["prepare", "--input", *files, "--output", prefix, "--partition", f"{i}/2",
                "--tokenizer", f"{tiny_corpus}.tokenizer.json"]  # fmt: skip
        assert run(argv, capfd)[0] == 0
    return prefix


def test_merge_refuses_bad_lengths_a_second_merge_and_missing_parts(partitions, tmp_path, capfd):
    root = tmp_path / "merged"
    before = snapshot(root)
    for flag in (["--seq-length", "-5"], ["--seq-length", "0"], ["--num-shards", "-1"]):
        refused(["merge", "--output", partitions, *flag], capfd, flag[0])
    # a merge in progress holds PREFIX.partitions' lock (train/rundir.py RunLock): a second one is refused
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from llmtrain.train.rundir import RunLock
        RunLock({partitions + '.partitions'!r}).acquire()
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        refused(["merge", "--output", partitions], capfd, "another merge", f'"pid": {holder.pid}')
    finally:
        holder.kill()
        holder.wait()
    after = snapshot(root)
    after.pop("ds.partitions/.llmtrain.lock", None)
    assert after == before
    part = next(p.with_suffix(".bin") for p in sorted((root / "ds.partitions/1-of-2").glob("part-*.json"))
                if json.loads(p.read_text())["kept"] > 0)  # fmt: skip
    part.unlink()  # a part that kept documents lost its tokens: no merge that looks complete
    refused(["merge", "--output", partitions], capfd, "is missing", "1-of-2")
    assert not Path(f"{partitions}.bin").exists() and not Path(f"{partitions}.manifest.json").exists()


# ----------------------------------------------------------------------------- report and plan
def test_report_skips_events_of_the_wrong_types_and_a_garbage_config(tiny_run, tmp_path, capfd):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    bad = ['{"event": "resumed", "step": "x"}', '{"event": "checkpoint", "step": 1e400}',
           '{"event": "run_start", "hosts": [[1]], "world_size": "2", "max_steps": 1.5}',
           '{"event": "straggler", "step": 1, "step_time": "slow"}', '{"event": "x", "time": "noon"}',
           '{"event": 5}', "[1, 2]"]  # fmt: skip
    with open(run_dir / "events.jsonl", "a") as f:
        f.write("\n".join(bad) + "\n")
    (run_dir / "config.yaml").write_bytes(b"\xff\xfe\x00 garbage")
    before = snapshot(run_dir)
    code, out, err = run(["report", str(run_dir), "--out", str(tmp_path / "r.html"), "--no-plan"], capfd)
    assert code == 0 and "report:" in out, err
    assert snapshot(run_dir) == before and (tmp_path / "r.html").stat().st_size > 1000


CATALOG = {"peak_tflops": 100, "memory_gib": 80, "memory_bw_gbs": 1000, "intra_node_bw_gbs": 100,
           "inter_node_bw_gbs": 10, "devices_per_node": 8}  # fmt: skip


def test_plan_refuses_garbage_and_wrong_typed_catalogs_and_claims(tiny_run, tmp_path, capfd):
    cfg = str(tiny_run / "config.yaml")
    cases = {
        "garbage": (b"\xff\xfe\x00\x01 garbage", "not UTF-8"),
        "nul": (b"devices: {x1: \x00}\n", "control character"),
        "string": (yaml.safe_dump({"devices": {"x1": {**CATALOG, "peak_tflops": "100"}}}).encode(), "peak_tflops"),
        "nan": (yaml.safe_dump({"devices": {"x1": {**CATALOG, "memory_gib": float("nan")}}}).encode(), "memory_gib"),
        "half": (yaml.safe_dump({"devices": {"x1": {**CATALOG, "devices_per_node": 8.5}}}).encode(), "integer"),
        "aliases": (b"aliases: [1, 2]\n", "aliases"),
        "alias_target": (b"aliases: {mine: nowhere}\n", "nowhere"),
        "list": (b"- 1\n", "expected a mapping"),
    }  # fmt: skip
    for name, (data, needle) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(data)
        refused(["plan", cfg, "--cluster", "1xcpu", "--catalog", str(path)], capfd, needle, f"{name}.yaml")
    for claim in ("days=inf", "days=nan", "days=-1", "mfu=1"):
        refused(["plan", cfg, "--cluster", "1xcpu", "--claim", claim], capfd, "--claim")
    refused(["plan", cfg, "--cluster", "99999999999999999999xh100"], capfd, "--cluster")
    for name, data, needle in (("garbage_cfg", b"\xff\xfe\x00 garbage", "UTF-8"),
                               ("typed_cfg", b"model: [1]\ntrain: 5\n", "model")):  # fmt: skip
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(data)
        refused(["plan", str(path), "--cluster", "1xcpu"], capfd, needle, f"{name}.yaml")
        assert path.read_bytes() == data


# ----------------------------------------------------------------------------- launch
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--max-restarts", "-1"], "--max-restarts"),
        (["--node-rank", "1"], "--node-rank 1 is not below --nnodes 1"),
        (["--nnodes", "2", "--master-addr", "h", "--node-rank", "2"], "--node-rank 2"),
        (["--run-id", "x"], "--run-id"),
        (["--run-id", "a/b", "--nnodes", "2", "--master-addr", "h"], "--run-id"),
        (["--rdzv-conf", "join_timeout=10"], "--rdzv-conf"),
        (["--nnodes", "1:2", "--master-addr", "h", "--rdzv-conf", "garbage"], "--rdzv-conf"),
        (["--nnodes", "1:2", "--master-addr", "h", "--rdzv-conf", "join_timeout=-5"], "join_timeout"),
        (["--master-addr", ""], "--master-addr"),
        (["--connect-timeout", "1e300"], "--connect-timeout"),
        (["--master-port", "29600"], "--master-port"),  # a single-node launch would ignore it
        (["--connect-timeout", "5"], "--connect-timeout 5 is the wait for a remote"),  # no remote host
    ],
)
def test_launch_flags_out_of_range_never_reach_torchrun(flags, needle, tiny_run, capfd):
    refused(
        ["launch", str(tiny_run / "config.yaml"), "--nproc-per-node", "1", *flags, "--dry-run"], capfd, needle
    )


def test_check_reads_the_task_files_of_eval_tasks(tiny_corpus, tmp_path, capfd):
    """A run's eval.tasks file is read and shape-checked by `check` (and at train start), not first at the
    downstream evaluation many steps in."""
    task = tmp_path / "bad.yaml"
    task.write_text(_task(dataset_kwargs="text"))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_corpus, tmp_path / "run",
                                              eval={"tasks": [str(task)], "downstream_steps": 1})))  # fmt: skip
    refused(["check", str(cfg)], capfd, "eval.tasks[0]", "bad.yaml", "dataset_kwargs must be a mapping")
    task.write_text(_task())
    code, _, err = run(["check", str(cfg)], capfd)
    assert code == 0, err
