"""A peer replica dies in the middle of an all-reduce: does the survivor live? (tests/test_replicas.py)

Two replica groups of one process each, torchft's Manager + DDP (its comm hook) on gloo, an embedded lighthouse.
Replica 1 SIGKILLs itself after the forward of step KILL_AT, so replica 0 is inside the all-reduce of that step's
backward when its peer's sockets close. Prints one JSON line: each replica's exit code and the survivor's
committed steps and participants per step. torchft 0.2.0's hook asserts there (the survivor exits 1); the pinned
build skips the step and goes on alone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.multiprocessing as mp

STEPS, KILL_AT = 6, 2


def replica(rid: int, lighthouse: str, queue, barrier) -> None:
    torch.set_num_threads(1)
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = timedelta(seconds=10)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=t), min_replica_size=1, use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), opt.load_state_dict(sd["o"])),
        state_dict=lambda: {"m": model.state_dict(), "o": opt.state_dict()},
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
        replica_id=f"drill{rid}", timeout=t, quorum_timeout=timedelta(seconds=30), connect_timeout=t,
    )  # fmt: skip
    barrier.wait()  # both managers heartbeat before the first quorum: it holds both replicas
    ddp, optim = DistributedDataParallel(manager, model), OptimizerWrapper(manager, opt)
    participants = []
    while manager.current_step() < STEPS:
        optim.zero_grad()
        loss = ddp(torch.randn(4, 8)).sum()
        if rid == 1 and manager.current_step() == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        optim.step()
        participants.append(manager.num_participants())
    queue.put({"replica": rid, "steps": manager.current_step(), "participants": participants})
    manager.shutdown(wait=False)


def main() -> int:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=1000
    )
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=replica, args=(r, lighthouse.address(), queue, barrier)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    results = [queue.get(timeout=1) for _ in range(queue.qsize())] if not queue.empty() else []
    print(json.dumps({"exitcodes": [p.exitcode for p in procs], "results": results}), flush=True)
    lighthouse.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
