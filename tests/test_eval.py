"""Downstream evaluation (llmtrain/eval/): the numbers agree with lm-eval's own ``hf`` model, offline only.

The proof: a tiny 2-step run is scored by ``llmtrain eval`` (our LM over our model) and by lm-eval's ``HFLM``
over ``llmtrain export CKPT --to hf`` of the same checkpoint, on the shipped multiple-choice task
(stdlib_mc), the shipped rolling-perplexity task (stdlib_ppl) and a local generate_until task: the same
accuracies, per-request log-likelihoods to 1e-4, perplexities to 1e-4 relative, the same generated text.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("lm_eval")

from conftest import gen_task, tiny_config  # noqa: E402
from llmtrain.cli import main as cli  # noqa: E402
from llmtrain.errors import ConfigError  # noqa: E402
from llmtrain.eval import stdlib_tasks  # noqa: E402
from llmtrain.eval.run import evaluate, metric_fields, write_results  # noqa: E402
from llmtrain.eval.tasks import check_specs, shipped_dir, task_configs  # noqa: E402

LIMIT, MAX_LENGTH = 20, 64
GEN_ROWS = [{"prompt": p, "answer": a} for p, a in [("import ", "os"), ("def ", "main"), ("class ", "A"),
            ("    return ", "None"), ("from ", "os"), ("if __name__", " == '__main__':")]]  # fmt: skip


def _gen_task(folder: Path) -> Path:
    return gen_task(folder, GEN_ROWS, max_gen_toks=12)


@pytest.fixture(scope="module")
def tiny_run(tiny_corpus, tmp_path_factory) -> Path:
    """A tiny 2-step run (tests/conftest.py's config) with its checkpoint at step 2."""
    from llmtrain.config import load_config
    from llmtrain.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("evalrun")
    cfg_file = tmp / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_config(tiny_corpus, tmp / "run")))
    cfg, _ = load_config(cfg_file)
    Trainer(cfg).fit()
    return tmp / "run"


def _samples(results: dict) -> dict[str, list]:
    """task -> the model's raw answers in doc order (loglikelihoods, rolling sums or generated text)."""
    out = {}
    for task, rows in results["samples"].items():
        out[task] = [[r[0] for r in s["resps"]] for s in sorted(rows, key=lambda s: s["doc_id"])]
    return out


def test_llmtrain_eval_agrees_with_lm_eval_hf_on_the_export(tiny_run, tmp_path, capsys):
    import lm_eval
    from lm_eval.tasks import TaskManager

    HFLM = pytest.importorskip(
        "lm_eval.models.huggingface", reason="lm-eval's hf model needs lm-eval[hf]"
    ).HFLM

    from llmtrain.train.sample import load_for_generation

    gen = _gen_task(tmp_path / "tasks")
    specs = ["stdlib_mc", "stdlib_ppl", str(gen)]
    out = tmp_path / "results.json"
    assert cli(["eval", str(tiny_run), "--tasks", ",".join(specs[:2]), str(gen), "--limit", str(LIMIT),
                "--batch-size", "8", "--max-length", str(MAX_LENGTH), "--output", str(out)]) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert "stdlib_mc" in table and "acc_norm" in table and "bits_per_byte" in table
    written = json.loads(out.read_text())
    assert written["llmtrain"]["tasks"] == specs and written["llmtrain"]["checkpoint"].endswith(
        "step_00000002"
    )

    hf_dir = tmp_path / "hf"
    assert cli(["export", str(tiny_run), "--to", "hf", str(hf_dir)]) == 0
    # a 64-token context on both sides (llmtrain's default is model.seq_length, lm-eval's hf reads the flavor's
    # max_position_embeddings): long MC items are cut to it, the rolling windows are 64 tokens
    hf = HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=1, max_length=MAX_LENGTH)
    theirs = lm_eval.simple_evaluate(
        model=hf, tasks=task_configs(specs), task_manager=TaskManager(include_defaults=False), limit=LIMIT,
        bootstrap_iters=0, log_samples=True,
    )  # fmt: skip
    model, tok, _ = load_for_generation(tiny_run)
    ours = evaluate(model, tok, specs, limit=LIMIT, batch_size=8, max_length=MAX_LENGTH, log_samples=True)

    for results in (ours, written):  # the command's file holds the same scores as the in-process call
        r = results["results"]
        assert r["stdlib_mc"]["acc,none"] == theirs["results"]["stdlib_mc"]["acc,none"]
        assert r["stdlib_mc"]["acc_norm,none"] == theirs["results"]["stdlib_mc"]["acc_norm,none"]
        assert r["tiny_gen"]["exact_match,none"] == theirs["results"]["tiny_gen"]["exact_match,none"]
        for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
            assert r["stdlib_ppl"][metric] == pytest.approx(theirs["results"]["stdlib_ppl"][metric], rel=1e-4)
    mine, ref = _samples(ours), _samples(theirs)
    assert len(mine["stdlib_mc"]) == len(mine["stdlib_ppl"]) == LIMIT
    for task in ("stdlib_mc", "stdlib_ppl"):
        flat_mine = [x for doc in mine[task] for x in doc]
        flat_ref = [x for doc in ref[task] for x in doc]
        a = [v[0] if isinstance(v, (list, tuple)) else v for v in flat_mine]
        b = [v[0] if isinstance(v, (list, tuple)) else v for v in flat_ref]
        assert len(a) == len(b) == LIMIT * (4 if task == "stdlib_mc" else 1)
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, task
        greedy = [v[1] for v in flat_mine if isinstance(v, (list, tuple))]
        assert greedy == [v[1] for v in flat_ref if isinstance(v, (list, tuple))]
    assert mine["tiny_gen"] == ref["tiny_gen"] and any(t for doc in mine["tiny_gen"] for t in doc)
    # an untrained-looking model is far from chance on nothing: the figures are real numbers of this model
    bpb = ours["results"]["stdlib_ppl"]["bits_per_byte,none"]
    assert 1.0 < bpb < 9.0 and 0.0 <= ours["results"]["stdlib_mc"]["acc,none"] <= 1.0
    fields = metric_fields(ours)
    assert fields["eval/stdlib_mc/acc"] == ours["results"]["stdlib_mc"]["acc,none"]
    assert fields["eval/stdlib_mc/acc_stderr"] == ours["results"]["stdlib_mc"]["acc_stderr,none"]
    assert fields["eval/stdlib_ppl/bits_per_byte"] == bpb


def test_a_task_that_would_download_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.tasks\[0\]: 'hellaswag' is neither one of llmtrain's tasks"):
        check_specs(["hellaswag"])
    hub = tmp_path / "hub.yaml"
    hub.write_text("task: my_hellaswag\ndataset_path: Rowan/hellaswag\noutput_type: multiple_choice\n")
    with pytest.raises(ConfigError, match=r"task 'my_hellaswag' \(.*hub.yaml\) reads dataset_path 'Rowan/hellaswag'"
                       r" from the Hugging Face Hub.*dataset_path: json"):  # fmt: skip
        task_configs([str(hub)])
    missing = tmp_path / "missing.yaml"
    missing.write_text(
        "task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: nowhere.jsonl\n"
    )
    with pytest.raises(ConfigError, match=r"data file .*nowhere.jsonl does not exist"):
        task_configs([str(missing)])
    remote = tmp_path / "remote.yaml"
    remote.write_text("task: r\ndataset_path: json\ndataset_kwargs:\n  data_files: https://x.org/a.jsonl\n")
    with pytest.raises(ConfigError, match=r"is not a local file path"):
        task_configs([str(remote)])
    group = tmp_path / "group.yaml"
    group.write_text("group: g\ntask: [a, b]\n")
    with pytest.raises(ConfigError, match=r"is a task group \(g\)"):
        task_configs([str(group)])
    with pytest.raises(ConfigError, match=r"task file 'no/such.yaml' does not exist"):
        check_specs(["no/such.yaml"])


def test_the_command_refuses_unknown_tasks_and_foreign_output_files(tiny_run, tmp_path, capsys):
    assert cli(["eval", str(tiny_run), "--tasks", "hellaswag"]) == 2
    err = capsys.readouterr().err
    assert "--tasks[0]: 'hellaswag'" in err and "dataset_path: json" in err and "Traceback" not in err
    foreign = tmp_path / "mine.json"
    foreign.write_text('{"results": {}}\n')
    assert cli(["eval", str(tiny_run), "--tasks", "stdlib_mc", "--limit", "2", "--output", str(foreign)]) == 2
    assert "not a results file written by `llmtrain eval`" in capsys.readouterr().err
    assert foreign.read_text() == '{"results": {}}\n'  # untouched
    ours = tmp_path / "ours.json"
    write_results({"results": {"x": {"acc,none": 0.5}}}, ours, {"tasks": ["x"]})
    assert cli(["eval", str(tiny_run), "--tasks", "stdlib_mc", "--limit", "2", "--output", str(ours)]) == 0
    replaced = json.loads(ours.read_text())
    assert list(replaced["results"]) == ["stdlib_mc"] and replaced["n-samples"]["stdlib_mc"]["effective"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left behind


def test_shipped_tasks_are_what_the_generator_writes(tmp_path):
    shipped = shipped_dir()
    mc = [json.loads(x) for x in (shipped / "stdlib_mc.jsonl").read_text().splitlines()]
    ppl = [json.loads(x) for x in (shipped / "stdlib_ppl.jsonl").read_text().splitlines()]
    assert len(mc) == stdlib_tasks.MC_ITEMS and len(ppl) == stdlib_tasks.PPL_DOCS
    assert all(len(r["choices"]) == 4 and len(set(r["choices"])) == 4 and 0 <= r["label"] < 4 for r in mc)
    assert sum(f.stat().st_size for f in shipped.iterdir()) < 200_000
    demo_files = {Path(f).name for f in __import__("llmtrain.demo", fromlist=["x"]).stdlib_sources()}
    assert not {r["source"] for r in ppl} & demo_files  # held out from the demo's corpus (top-level files)
    made_by = yaml.safe_load((shipped / "stdlib_mc.yaml").read_text())["metadata"]["python"]
    if made_by != f"{sys.version_info.major}.{sys.version_info.minor}":
        pytest.skip(f"the shipped items were made by Python {made_by}; this is another standard library")
    stdlib_tasks.write_tasks(tmp_path)
    for name in ("stdlib_mc.yaml", "stdlib_mc.jsonl", "stdlib_ppl.yaml", "stdlib_ppl.jsonl"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name


def test_metric_fields_flatten_lm_eval_results():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.25, "acc_stderr,none": 0.1, "sample_len": 4,
                                 "f1,strict": 0.5, "bits_per_byte,none": 2.0, "bits_per_byte_stderr,none": "N/A"}}}  # fmt: skip
    assert metric_fields(results) == {
        "eval/t/acc": 0.25, "eval/t/acc_stderr": 0.1, "eval/t/f1_strict": 0.5, "eval/t/bits_per_byte": 2.0,
    }  # fmt: skip
    assert math.isfinite(sum(metric_fields(results).values()))


def test_in_loop_scores_rows_events_time_and_tensorboard(tiny_corpus, tmp_path):
    """eval.tasks every 2 steps of a 4-step run (and at step 0): one metrics row per evaluation, equal to
    ``evaluate`` on the final checkpoint; the time is in the split; events and TensorBoard scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from llmtrain.config import config_from_dict
    from llmtrain.train.sample import load_for_generation
    from llmtrain.train.trainer import Trainer

    out = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus, out, train={"max_steps": 4}, logging={"tensorboard": True},
        eval={"at_start": True, "tasks": ["stdlib_mc", "stdlib_ppl"], "downstream_steps": 2, "limit": 6,
              "batch_size": 4},
    )  # fmt: skip
    Trainer(config_from_dict(cfg)).fit()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "eval/stdlib_mc/acc" in r]
    assert [r["step"] for r in scored] == [0, 2, 4]
    for r in scored:
        assert set(r) >= {"eval/stdlib_mc/acc", "eval/stdlib_mc/acc_stderr", "eval/stdlib_mc/acc_norm",
                          "eval/stdlib_ppl/bits_per_byte", "eval/stdlib_ppl/word_perplexity", "eval/time_s"}  # fmt: skip
        assert r["eval/time_s"] > 0 and 0 <= r["eval/stdlib_mc/acc"] <= 1
    assert scored[0]["eval/stdlib_ppl/bits_per_byte"] != scored[-1]["eval/stdlib_ppl/bits_per_byte"]
    model, tok, _ = load_for_generation(out)  # the same weights offline: the same numbers
    offline = metric_fields(evaluate(model, tok, ["stdlib_mc", "stdlib_ppl"], limit=6, batch_size=4))
    for key, value in offline.items():
        assert scored[-1][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    train = {r["step"]: r for r in rows if "loss" in r}
    # the evaluation of step 2 runs after that step's row: it is charged to the interval of step 3
    assert train[3]["time_eval_frac"] > 0 and train[2]["time_eval_frac"] == 0
    assert train[3]["time_phase_s"]["eval"] > 0
    fracs = ("data", "compute", "comm", "eval", "other")
    assert abs(sum(train[3][f"time_{k}_frac"] for k in fracs) - 1) < 1e-9
    evs = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evs if e["event"] == "downstream_eval"] == [0, 2, 4]
    acc = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in acc.Scalars("eval/stdlib_mc/acc")] == [0, 2, 4]
    assert acc.Scalars("eval/stdlib_ppl/bits_per_byte")[-1].value == pytest.approx(
        scored[-1]["eval/stdlib_ppl/bits_per_byte"], rel=1e-6
    )


def test_config_rules_for_downstream_eval(tiny_corpus, tmp_path):
    from llmtrain.config import config_from_dict
    from llmtrain.resolve import validate

    def cfg(**ev):
        return config_from_dict(tiny_config(tiny_corpus, tmp_path / "r", eval=ev))

    validate(cfg(tasks=["stdlib_mc"], downstream_steps=2))
    validate(cfg(tasks=["hellaswag"], downstream_steps=0))  # off: not looked at
    with pytest.raises(ConfigError, match=r"eval.tasks\[0\]: 'hellaswag' is neither"):
        validate(cfg(tasks=["hellaswag"], downstream_steps=2))
    validate(
        cfg(tasks=["stdlib_mc"], downstream_steps=2), world_size=2
    )  # DP2: every rank scores (forward.py)
    cp2 = tiny_config(tiny_corpus, tmp_path / "r", eval={"tasks": ["stdlib_mc"], "downstream_steps": 2},
                      parallel={"context_parallel": 2})  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"parallel.context_parallel = 2: in-loop downstream evaluation does not"
    ):
        validate(config_from_dict(cp2), world_size=2)
    with pytest.raises(ConfigError, match=r"eval.downstream_steps.*>= 0"):
        validate(cfg(downstream_steps=-1))
    with pytest.raises(ConfigError, match=r"eval.limit"):
        validate(cfg(tasks=["stdlib_mc"], downstream_steps=2, limit=0))
