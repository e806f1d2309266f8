"""Replica groups (torchft) with pipeline, context and expert parallel inside each group (ft/grads.py).

Each launch is ``llmtrain launch --nproc-per-node 4 --replicas 2``: 2 groups x 2 ranks, the layout inside a
group as configured. With every group present each step's loss equals a one-process run of the same config
within 1e-5 (the cross-group sum adds every gradient once, the token count covers all groups), and the groups
end with bitwise equal parameters and optimizer state (``run_end``'s ``state_sha256``).

* PP 2 (1f1b, llama3 debug), ``keep``, the kill drill: rank 1 of group 1 (its last stage) SIGKILLed at step 4.
  Group 0 keeps stepping alone, running its schedule once per slot (its own and group 1's); group 1 is
  restarted, heals live (rank k takes rank k's stage of group 0) and rejoins. Every loss still equals the
  one-process run's (the survivor computed the missing slot), the hashes agree, exit 0.
* CP 2 (llama3 debug), ``shrink``, full quorum: the loss sums each rank's sequence chunk, over CP then groups.
* EP 2 (qwen3 debug_moe, 4 experts top-2, aux-free bias), ``keep``, full quorum: FSDP leaves the expert
  weights out (one expert replica per group), so they are summed by the explicit all-reduce; the expert loads
  of the bias update are summed over the groups too (``moe_load_max_over_mean`` equal to one process's).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from test_elastic import write_cfg  # tests/ is on sys.path
from test_replicas import ENV, FT, SLOW, cfg_dict, launch, rows

pytestmark = pytest.mark.slow  # 4 launches of 2 x 2 ranks and 2 one-process runs

STEPS, KILL_AT, SHORT = 40, 4, 4  # the drill: steps short of a group are paced 2 s (test_replicas.SLOW)
MOE = {"model_type": "qwen3", "flavor": "debug_moe", "seq_length": 32}
LAYOUTS = {  # name -> (model, parallel, batch policy, fault, steps)
    "pp2_keep_kill": (None, {"pipeline_parallel": 2, "schedule": "1f1b"}, "keep",
                      {"replica": 1, "rank": 1, "kill_at_step": [KILL_AT], **SLOW},
                      STEPS),
    "cp2_shrink": (None, {"context_parallel": 2}, "shrink", {}, SHORT),
    "ep2_keep": (MOE, {"expert_parallel": 2, "zero_stage": 3}, "keep", {}, SHORT),
}  # fmt: skip


def _cfg(prefix: str, out: Path, model: dict | None, steps: int, **sections) -> dict:
    save = {"save_steps": 2 if steps == STEPS else steps}
    d = cfg_dict(prefix, out, train={"max_steps": steps}, checkpoint=save, **sections)
    if model is not None:
        d["model"] = dict(model)
    return d


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (replica run, its one-process reference); references are shared by equal models and steps."""
    root = tmp_path_factory.mktemp("replica_layouts")
    refs: dict[tuple, Path] = {}
    out: dict[str, tuple[Path, Path]] = {}
    for name, (model, parallel, policy, fault, steps) in LAYOUTS.items():
        key = (str(model), steps)
        if key not in refs:
            ref = root / f"ref{len(refs)}"
            cfg = write_cfg(root / f"ref{len(refs)}.yaml", _cfg(tiny_corpus, ref, model, steps))
            p = subprocess.run([sys.executable, "-m", "llmtrain.cli", "train", str(cfg)], capture_output=True,
                               text=True, timeout=300, env=ENV)  # fmt: skip
            assert p.returncode == 0, (name, p.stderr[-4000:])
            refs[key] = ref
        d = _cfg(tiny_corpus, root / name, model, steps, parallel=parallel,
                 fault_tolerance={**FT, "batch_policy": policy}, fault=fault)  # fmt: skip
        p = launch(write_cfg(root / f"{name}.yaml", d), "--nproc-per-node", "4", "--replicas", "2",
                   "--max-restarts", "2")  # fmt: skip
        assert p.returncode == 0, (name, p.stdout[-3000:], p.stderr[-5000:])
        out[name] = (root / name, refs[key])
    return out


def _losses_equal_one_process(run_dir: Path, ref_dir: Path, steps: int) -> list[dict]:
    metrics = [r for r in rows(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))  # group 0 never went back a step
    ref = {r["step"]: r for r in rows(ref_dir / "metrics.jsonl") if "loss" in r}
    for r in metrics:
        want = ref[r["step"]]
        assert abs(r["loss"] - want["loss"]) < 1e-5, (r["step"], r["loss"], want["loss"])
        assert abs(r["grad_norm"] - want["grad_norm"]) <= 1e-3 * want["grad_norm"], (r["step"], r, want)
    assert metrics[-1]["consumed_tokens"] == ref[steps]["consumed_tokens"]  # every sample once
    return metrics


def _hashes_equal(run_dir: Path, steps: int) -> list[dict]:
    ev = rows(run_dir / "events.jsonl")
    ends = {e["replica"]: e for e in ev if e["event"] == "run_end"}  # the last per group
    assert set(ends) == {0, 1} and ends[0]["step"] == ends[1]["step"] == steps
    assert ends[0]["state_sha256"] == ends[1]["state_sha256"]  # bitwise the same params + optimizer state
    return ev


@pytest.mark.parametrize("name", ["cp2_shrink", "ep2_keep"])
def test_full_quorum_equals_one_process(runs, name):
    run_dir, ref_dir = runs[name]
    metrics = _losses_equal_one_process(run_dir, ref_dir, SHORT)
    assert {r["replicas"] for r in metrics} == {2}
    ev = _hashes_equal(run_dir, SHORT)
    assert not [e for e in ev if e["event"] in ("replica_lost", "samples_skipped", "heal")]
    if name.startswith("ep"):  # the expert loads (aux-free bias update) are the global batch's
        ref = {r["step"]: r for r in rows(ref_dir / "metrics.jsonl") if "loss" in r}
        for r in metrics:
            assert r["moe_load_max_over_mean"] == pytest.approx(ref[r["step"]]["moe_load_max_over_mean"])


def test_pipeline_keep_kill_heals_and_equals_one_process(runs):
    run_dir, ref_dir = runs["pp2_keep_kill"]
    metrics = _losses_equal_one_process(run_dir, ref_dir, STEPS)
    assert {r["replicas"] for r in metrics} == {1, 2}  # steps of the survivor alone, and of both groups
    ev = _hashes_equal(run_dir, STEPS)
    assert [e["lost"] for e in ev if e["event"] == "replica_lost"] == [1]
    assert [e["joined"] for e in ev if e["event"] == "replica_joined"] == [1]
    heals = [e for e in ev if e["event"] == "heal"]
    assert [e["replica"] for e in heals] == [1] and heals[0]["bytes"] > 0
    assert all(e["step"] == KILL_AT for e in ev if e["event"] == "step_retried")
    assert not [e for e in ev if e["event"] == "samples_skipped"]


THREE_STEPS, THREE_KILL = 24, 3


def test_keep_over_three_groups_uneven_cover_equals_one_process(tiny_corpus, tmp_path):
    """3 groups x 2 ranks, ZeRO-3 (FSDP reduces every micro-batch), ``keep``; group 2's rank 0 SIGKILLed at step 3.
    The two survivors then cover three slots (group 0 slots 0 and 2, group 1 slot 1: ft/data.py), so they
    backpropagate different numbers of micro-batches; the cross-group sum must still pair up (it runs once after
    the backward here, ``ft.layout.fsdp_hook_sums``), and every loss equals one process's over the same global
    batch of 12 (a step of two groups among them), every hash agrees at the end, and group 2 heals and rejoins."""
    batch = {"batch_size": 12, "max_steps": THREE_STEPS}
    ref = tmp_path / "ref"
    cfg = write_cfg(
        tmp_path / "ref.yaml", cfg_dict(tiny_corpus, ref, train=batch, checkpoint={"save_steps": 4})
    )
    p = subprocess.run([sys.executable, "-m", "llmtrain.cli", "train", str(cfg)], capture_output=True, text=True,
                       timeout=300, env=ENV)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    run = tmp_path / "three"
    d = cfg_dict(tiny_corpus, run, train=batch, checkpoint={"save_steps": 4}, parallel={"zero_stage": 3},
                 fault_tolerance={**FT, "batch_policy": "keep"},
                 fault={"replica": 2, "rank": 0, "kill_at_step": [THREE_KILL], **SLOW})  # fmt: skip
    p = launch(write_cfg(tmp_path / "three.yaml", d), "--nproc-per-node", "6", "--replicas", "3",
               "--max-restarts", "2")  # fmt: skip
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
    metrics = _losses_equal_one_process(run, ref, THREE_STEPS)
    assert {r["replicas"] for r in metrics} == {2, 3}
    ev = rows(run / "events.jsonl")
    ends = {e["replica"]: e for e in ev if e["event"] == "run_end"}
    assert set(ends) == {0, 1, 2} and {e["step"] for e in ends.values()} == {THREE_STEPS}
    assert len({e["state_sha256"] for e in ends.values()}) == 1
    # group 2 heals from its restart; which group the quorum after the kill misses depends on timing (a survivor
    # still waiting out the failed collective can miss it, and then heals too): seen [0] lost, heals [2, 0]
    assert [e for e in ev if e["event"] == "replica_lost"] and 2 in [
        e["replica"] for e in ev if e["event"] == "heal"
    ]
