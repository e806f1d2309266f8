"""In-loop downstream evaluation under a parallel layout scores what one process scores from the same weights.

One torchrun launch (world 2, gloo; this file is also the worker) trains four tiny runs one after another, DP2
ZeRO-3, EP2 (qwen3 ``debug_moe``, experts split over the two ranks: every forward dispatches by all-to-all), TP2 (sequence parallel: requests are right-padded to an even length) and PP2 (interleaved 1F1B, two
stages per rank, so the forward-only pass goes 0 -> 1 -> 2 -> 3 across the ranks), each 2 steps with
``eval.tasks = [stdlib_mc, stdlib_ppl]`` scored in the loop at step 2 (``eval.downstream_steps: 2``) and a
checkpoint saved at that step. In this process each checkpoint is then scored by
:func:`llmtrain.eval.run.evaluate` on one process (KV cache, the model called directly): the rank-0 metrics row
must equal it, accuracies exactly and the log-likelihood metrics (bits per byte, perplexities) to 1e-6
relative. A local ``generate_until`` task is scored too, so generation under a layout (recompute, the token
broadcast from rank 0) gives the same text. Only rank 0 writes the row and the event.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from conftest import gen_task, tiny_config  # noqa: E402

TASKS = ["stdlib_mc", "stdlib_ppl"]
LIMIT, STEPS = 20, 2
LAYOUTS = {
    "zero3_dp2": {"zero_stage": 3},
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline_parallel": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"},
    "ep2": {"expert_parallel": 2, "zero_stage": 3},  # an MoE model: the experts' all-to-all on every forward
}
MOE = {"model_type": "qwen3", "flavor": "debug_moe"}
GEN_ROWS = [{"prompt": "import ", "answer": "os"}, {"prompt": "def ", "answer": "main"},
            {"prompt": "class ", "answer": "A"}]  # fmt: skip


def _gen_task(folder: Path) -> Path:
    return gen_task(folder, GEN_ROWS, max_gen_toks=6)


def run_config(prefix: str, out: Path, tasks: list[str], parallel: dict) -> dict:
    family = MOE if parallel.get("expert_parallel", 1) > 1 else {"model_type": "llama3", "flavor": "debug"}
    return tiny_config(
        prefix, out,
        model={**family, "seq_length": 32, "num_layers": 4},
        train={"max_steps": STEPS, "seed": 7},
        parallel=parallel,
        checkpoint={"save_steps": STEPS, "save_at_end": True, "resume": "none"},
        eval={"at_start": False, "eval_iters": 1, "tasks": tasks, "downstream_steps": STEPS, "limit": LIMIT,
              "batch_size": 8},
    )  # fmt: skip


def worker(spec_file: str) -> None:
    """Under torchrun: every layout of the spec trained (and scored in the loop) on every rank."""
    import torch
    import torch.distributed as dist

    from llmtrain.config import config_from_dict
    from llmtrain.distributed.device import shutdown_distributed
    from llmtrain.eval.run import run_tokenizer
    from llmtrain.train.trainer import Trainer

    torch.set_num_threads(1)
    for cfg in json.loads(Path(spec_file).read_text()):
        trainer = Trainer(config_from_dict(cfg))
        trainer.fit()
        probe = _probe(trainer.model, run_tokenizer(trainer.cfg), _layout_forward(trainer))  # step-2 weights
        if dist.get_rank() == 0:
            (trainer.run_dir / "probe.json").write_text(json.dumps(probe))
        dist.barrier()
    shutdown_distributed(barrier=True)


def _layout_forward(trainer):
    from llmtrain.eval.forward import LayoutForward

    tp = trainer.cfg.parallel.tensor_parallel
    return LayoutForward(trainer.model, tensor_parallel=tp, pipeline=trainer.pipeline)


def _probe(model, tok, forward) -> dict:
    """Per-token log-probs of a fixed odd-length batch, and up to 8 greedily generated tokens for two prompts."""
    import torch

    from llmtrain.eval.lm import LLMTrainLM

    g = torch.Generator().manual_seed(3)
    vocab = int(model.args.vocab_size)
    inputs, targets = (torch.randint(0, vocab, (3, 13), generator=g) for _ in range(2))
    logp, greedy = forward.token_logprobs(inputs, targets)
    lm = LLMTrainLM(model, tok, forward=forward, progress=False)
    texts = [lm._generate(tok.encode(p), 8, [], 0.0, None, None) for p in ("import os\n", "def main(x, y):")]
    return {"logp": logp.tolist(), "greedy": greedy.tolist(), "texts": texts}


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_in_loop_scores_under_dp_tp_pp_ep_equal_one_process(tiny_corpus, tmp_path):
    from llmtrain.eval.run import evaluate, metric_fields
    from llmtrain.train.sample import load_for_generation

    tasks = [*TASKS, str(_gen_task(tmp_path / "tasks"))]
    runs = {name: tmp_path / name for name in LAYOUTS}
    spec = [run_config(tiny_corpus, runs[n], tasks, p) for n, p in LAYOUTS.items()]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           str(tmp_path / "spec.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]

    reference: dict | None = None
    for name, run in runs.items():
        scored = [r for r in _rows(run) if "eval/stdlib_mc/acc" in r]
        assert [r["step"] for r in scored] == [STEPS], name  # one row (rank 0 only), at step 2
        row = scored[0]
        evs = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        assert [e["step"] for e in evs if e["event"] == "downstream_eval"] == [STEPS], name
        model, tok, ckpt = load_for_generation(run / "checkpoints" / f"step_{STEPS:08d}")
        one = metric_fields(
            evaluate(model, tok, tasks, limit=LIMIT, batch_size=8, env_info=False, progress=False)
        )
        assert {k for k in row if k.startswith("eval/") and k != "eval/time_s"} == set(one), name
        for key, value in one.items():
            if key.endswith(("/acc", "/acc_norm", "/exact_match")):
                assert row[key] == value, (name, key, row[key], value)
            else:
                assert row[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (name, key)
        assert 0 < one["eval/stdlib_ppl/bits_per_byte"] < 20 and 0 <= one["eval/stdlib_mc/acc"] <= 1
        from llmtrain.eval.forward import ModelForward

        probe = json.loads((run / "probe.json").read_text())
        mine = _probe(model, tok, ModelForward(model))  # one process: the model called directly, KV-cached
        assert mine["texts"] == probe["texts"] and all(mine["texts"]), (name, mine["texts"], probe["texts"])
        assert mine["greedy"] == probe["greedy"], name
        worst = max(abs(a - b) for ra, rb in zip(mine["logp"], probe["logp"]) for a, b in zip(ra, rb))
        assert worst < 1e-6, (name, worst)
        if name == "ep2":
            continue  # another model (MoE): nothing to compare its scores with but its own checkpoint's
        if reference is None:
            reference = one
        else:  # the layouts trained the same model (to float noise): similar, yet each its own checkpoint
            ref_bpb = reference["eval/stdlib_ppl/bits_per_byte"]
            assert one["eval/stdlib_ppl/bits_per_byte"] == pytest.approx(ref_bpb, rel=1e-3), name


if __name__ == "__main__":
    worker(sys.argv[1])
