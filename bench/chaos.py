"""Chaos drill: a 2-rank run under a randomised schedule of injected faults, against an uninterrupted run.

Both runs go through ``llmtrain launch --nproc-per-node 2`` (torchrun's elastic agent, CPU, fp32, debug model).
The faulty run gets a ``fault:`` section drawn from ``--seed``: ``--faults`` faults over the kinds of
``--kinds`` (each kind at least once), at distinct steps::

    kill                rank 1 SIGKILLs itself at the start of a step           -> agent restart, resume
    hang                rank 1 sleeps; every rank's watchdog dumps stacks, exits -> agent restart, resume
    crash_in_save       rank 0 dies while committing a checkpoint (partial .tmp) -> agent restart, resume
    corrupt_checkpoint  a committed checkpoint gets a flipped byte               -> checksum fallback on resume
    nan                 rank 1's loss is NaN                                     -> the step is skipped
    spike               every rank's tokens are random for 3 steps               -> rollback, data window skipped

It prints the schedule, then a table: faults injected (the fired-fault records), faults survived (injected
and the job still reached its last step), restarts, rollbacks, skipped steps, checkpoint fallbacks, steps
lost (step executions beyond ``--steps``: work redone after restarts and rollbacks), and whether the final
parameters equal the uninterrupted run's. Equality is bitwise (``torch.equal``) when no spike or NaN was
injected (those change the trajectory by design); otherwise the largest parameter difference and the final
losses are shown. Exit code 1 when the job did not finish, or when a bitwise comparison fails.

    OMP_NUM_THREADS=1 .venv/bin/python bench/chaos.py --steps 120 --faults 10 --seed 0
    .venv/bin/python bench/chaos.py --kinds kill,hang,crash_in_save,corrupt_checkpoint   # bitwise check
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import yaml

from llmtrain.config import config_from_dict
from llmtrain.models import build_model
from llmtrain.resolve import derive
from llmtrain.train.checkpoint import load_model_weights, step_dir

KINDS = ("kill", "hang", "crash_in_save", "corrupt_checkpoint", "nan", "spike")
RESTARTING = ("kill", "hang", "crash_in_save")
SAVE_STEPS = 5
SPIKE_STEPS = 3
FIRST_STEP = 14  # after the stability guard's min_history, so spikes are judged against a baseline


def run_config(prefix: str, out: Path, steps: int, hang_timeout: float, faults: dict | None) -> dict:
    return {
        "model": {"model_type": "llama3", "flavor": "debug", "seq_length": 32},
        "train": {
            "batch_size": 8,
            "micro_batch_size": 2,
            "max_steps": steps,
            "lr": 3e-3,
            "min_lr": 3e-4,
            "warmup_steps": 5,
            "seed": 11,
            "log_steps": 1,
            "eval_steps": 0,
        },
        "data": {"datasets": [{"path": prefix, "weight": 1.0}], "valid_fraction": 0.05},
        "checkpoint": {"save_steps": SAVE_STEPS, "keep_checkpoint_max": 3, "resume": "auto"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "eval": {"at_start": False, "eval_iters": 2},
        "stability": {"rule": "ratio", "ratio": 1.2, "consecutive": 2, "min_history": 10, "window": 20},
        "run": {"device_target": "cpu", "output_dir": str(out), "threads": 1, "hang_timeout_s": hang_timeout},
        "fault": faults or {},
    }


def draw_schedule(steps: int, n: int, kinds: list[str], seed: int) -> list[tuple[str, int]]:
    """``n`` (kind, step) pairs at distinct steps; every kind at least once; saves only at save steps.

    Spikes keep a clear window around them (the guard needs a few clean steps to see one) and checkpoint
    faults avoid the last save, whose checkpoint holds the final parameters being compared.
    """
    rng = random.Random(seed)
    order = list(kinds) + [rng.choice(kinds) for _ in range(max(n - len(kinds), 0))]
    rng.shuffle(order)
    taken: set[int] = set()
    plan: list[tuple[str, int]] = []
    last_save = (steps - 1) // SAVE_STEPS * SAVE_STEPS
    for kind in order:
        if kind in ("crash_in_save", "corrupt_checkpoint"):
            pool = list(range(FIRST_STEP // SAVE_STEPS * SAVE_STEPS + SAVE_STEPS, last_save, SAVE_STEPS))
        else:
            pool = list(range(FIRST_STEP, steps - SPIKE_STEPS - 2))
        margin = SPIKE_STEPS + 3 if kind == "spike" else 0
        free = [s for s in pool if all(abs(s - t) > margin for t in taken) and s not in taken]
        if not free:
            raise SystemExit(f"--steps {steps} is too short for {n} faults; use more steps or fewer faults")
        step = rng.choice(free)
        taken.update(range(step - margin, step + margin + 1) if margin else [step])
        plan.append((kind, step))
    return sorted(plan, key=lambda p: p[1])


def fault_section(plan: list[tuple[str, int]], seed: int) -> dict:
    section: dict = {"rank": 1, "seed": seed, "spike_steps": SPIKE_STEPS, "nan_target": "loss"}
    for kind, step in plan:
        section.setdefault(f"{kind}_at_step", []).append(step)
    return section


def launch(cfg: dict, path: Path, max_restarts: int) -> tuple[int, str, float]:
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "llmtrain.cli", "launch", str(path), "--nproc-per-node", "2",
           "--max-restarts", str(max_restarts)]  # fmt: skip
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (path.parent / f"{path.stem}.log").write_text(p.stdout + "\n" + p.stderr)
    return p.returncode, p.stdout, time.time() - t0


def final_params(cfg: dict, run_dir: Path, step: int) -> dict[str, torch.Tensor] | None:
    ckpt = step_dir(run_dir / "checkpoints", step)
    if not ckpt.exists():
        return None
    model = build_model(derive(config_from_dict(cfg), world_size=1).model_args, device="meta")
    model.to_empty(device="cpu")
    load_model_weights(ckpt, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def last_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps of each run")
    ap.add_argument("--faults", type=int, default=12, help="faults to inject (at least one of each kind)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds to draw from")
    ap.add_argument("--hang-timeout", type=float, default=8.0, help="run.hang_timeout_s of the runs")
    ap.add_argument("--corpus", default=None, help="prepared dataset prefix (default: stdlib sources)")
    ap.add_argument("--dir", default=None, help="work directory (default: a new temp dir)")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if bad := [k for k in kinds if k not in KINDS]:
        raise SystemExit(f"--kinds: unknown {bad}; choose from {', '.join(KINDS)}")
    work = Path(args.dir or tempfile.mkdtemp(prefix="chaos_", dir="."))
    work.mkdir(parents=True, exist_ok=True)
    prefix = args.corpus
    if prefix is None:
        from llmtrain.data.prep.prepare import prepare

        files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:40]
        prefix = str(work / "corpus" / "stdlib")
        if not Path(prefix + ".manifest.json").exists():
            prepare(files, prefix, train_tokenizer=512, log=None)

    plan = draw_schedule(args.steps, args.faults, kinds, args.seed)
    faults = fault_section(plan, args.seed)
    print(f"chaos: {args.steps} steps, 2 ranks, CPU fp32, seed {args.seed}; work dir {work}")
    print("schedule: " + ", ".join(f"{k}@{s}" for k, s in plan), flush=True)

    ref_cfg = run_config(prefix, work / "ref", args.steps, args.hang_timeout, None)
    rc_ref, _, t_ref = launch(ref_cfg, work / "ref.yaml", 0)
    if rc_ref != 0:
        print(f"the uninterrupted run failed (exit {rc_ref}); see {work / 'ref.log'}")
        return 1
    run_cfg = run_config(prefix, work / "run", args.steps, args.hang_timeout, faults)
    restarts_allowed = sum(k in RESTARTING for k, _ in plan) + 3
    rc, stdout, t_run = launch(run_cfg, work / "run.yaml", restarts_allowed)

    run_dir = work / "run"
    fired = [f for r in (0, 1) for f in read_jsonl_list(run_dir / f"faults_fired_rank{r}.json")]
    injected = {scheduled_fault(f, plan) for f in fired}  # a spike fires once per corrupted step
    ev = read_jsonl(run_dir / "events.jsonl")
    count = {e: sum(1 for x in ev if x["event"] == e) for e in ("resumed", "rollback_done", "skip")}
    fallbacks = sum(1 for x in ev if x["event"] == "checkpoint_fallback")
    executed = len(re.findall(r"^step \d+/\d+ \| loss", stdout, flags=re.M))
    losses, ref_losses = last_losses(run_dir), last_losses(work / "ref")
    finished = rc == 0 and max(losses, default=0) == args.steps
    survived = len(injected) if finished else 0

    want, got = final_params(ref_cfg, work / "ref", args.steps), final_params(run_cfg, run_dir, args.steps)
    bitwise_expected = not any(k in ("spike", "nan") for k, _ in plan)
    if want is None or got is None:
        match, detail = False, "final checkpoint missing"
    else:
        diffs = {n: (want[n] - got[n]).abs().max().item() for n in want}
        match = all(torch.equal(want[n], got[n]) for n in want)
        detail = f"max |diff| {max(diffs.values()):.3e}"
    same_losses = losses == ref_losses
    final = (ref_losses.get(args.steps), losses.get(args.steps))

    rows = [
        ("faults scheduled", str(len(plan))),
        ("faults injected", f"{len(injected)}  ({', '.join(f'{k}@{s}' for k, s in sorted(injected))})"),
        ("faults survived", f"{survived}  (job {'finished' if finished else f'FAILED, exit {rc}'})"),
        ("restarts (resumes)", str(count["resumed"])),
        ("rollbacks / skipped steps", f"{count['rollback_done']} / {count['skip']}"),
        ("checkpoint fallbacks", str(fallbacks)),
        ("steps lost to rollback", f"{max(executed - args.steps, 0)}  ({executed} step executions)"),
        ("final loss ref / run", f"{final[0]} / {final[1]}"),
        ("per-step losses equal", str(same_losses)),
        (
            "final parameters",
            ("bitwise equal" if match else "DIFFER") + f" ({detail}; bitwise "
            + ("expected" if bitwise_expected else "not expected: spike/NaN injected") + ")",
        ),
        ("wall time ref / run", f"{t_ref:.0f} s / {t_run:.0f} s"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    ok = finished and survived == len(injected) and (match and same_losses or not bitwise_expected)
    print("chaos: " + ("SURVIVED" if ok else "FAILED"))
    return 0 if ok else 1


def scheduled_fault(record: str, plan: list[tuple[str, int]]) -> tuple[str, int]:
    """The scheduled (kind, step) a fired-fault record ``kind@step`` belongs to."""
    kind, step = record.split("@")[0], int(record.split("@")[1])
    for k, s in plan:
        if k == kind and s <= step < s + (SPIKE_STEPS if k == "spike" else 1):
            return k, s
    return kind, step


def read_jsonl_list(path: Path) -> list[str]:
    return json.loads(path.read_text()) if path.exists() else []


if __name__ == "__main__":
    sys.exit(main())
