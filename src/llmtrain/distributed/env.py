"""Which rank am I? The rank variables of every launcher, read in one place (:func:`rank_env`).

``llmtrain train`` runs under torchrun, under ``mpirun`` (Open MPI, MPICH/Intel MPI's PMI), and as ``srun``
tasks, with no wrapper script: :func:`rank_env` reads the first launcher's variables it finds, in this order,
and sets what ``torch.distributed``'s ``env://`` initialisation reads (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT):

1. torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE;
2. Open MPI (mpirun): OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
3. a Slurm job step (srun): SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_LOCALID, and the
   tasks of this node from SLURM_STEP_TASKS_PER_NODE (``2(x3),1``, indexed by SLURM_NODEID), else
   SLURM_NTASKS_PER_NODE;
4. PMI (MPICH, Intel MPI): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS;
5. PMIx alone: PMIX_RANK and PMI_SIZE (which ranks share a host is then unknown).

The same table is in docs/launch.md ("Rank variables").

torchrun comes first because its workers may themselves run inside an ``srun`` task or an ``mpirun`` slot (one
agent per node): the agent's own task variables then describe the agent, not the worker. Slurm's variables are
read only inside a job step (``SLURM_STEP_ID`` set, i.e. under ``srun``): the batch script itself also carries
SLURM_PROCID=0 and the job's SLURM_NTASKS, and a ``llmtrain train`` started there is one process.

MASTER_ADDR / MASTER_PORT (the rank-0 host and a free port, read by ``env://``): a launcher other than torchrun
does not set them. When every rank runs on this host (the local size equals the world size) they default to
127.0.0.1 and 29500 (torchrun's default port); across hosts MASTER_ADDR must be given (``mpirun -x
MASTER_ADDR=HOST``; under Slurm the first host of ``scontrol show hostnames $SLURM_JOB_NODELIST``), else a
ConfigError names it (exit 2) instead of every rank waiting for a rendezvous that never comes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from llmtrain.errors import ConfigError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the job, and which launcher said so."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes on this host (the accelerator index)."""
    local_world_size: int
    """Number of processes on this host."""
    launcher: str
    """torchrun, openmpi, slurm, pmi, pmix, or none (a single process)."""
    local_known: bool = True
    """False when the launcher does not say which ranks share a host (local_* are then guesses)."""


def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    text = env[name]
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"the {launcher} variable {name} is {text!r}; expected an integer (is the launcher's environment "
            "intact?)."
        ) from None


def _opt_int(env: Mapping[str, str], name: str, launcher: str, default: int) -> int:
    return _int(env, name, launcher) if name in env else default


def slurm_tasks_on_node(spec: str, node: int) -> int | None:
    """The task count of node ``node`` in Slurm's compressed list (``SLURM_STEP_TASKS_PER_NODE``: ``2(x3),1``)."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def detect(env: Mapping[str, str]) -> RankEnv:
    """The rank layout that ``env`` describes (see the table above); ``none`` for a plain process."""
    if "RANK" in env or "WORLD_SIZE" in env:
        world = _opt_int(env, "WORLD_SIZE", "torchrun", 1)
        rank = _opt_int(env, "RANK", "torchrun", 0)
        local_known = "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env
        return RankEnv(
            rank=rank,
            world_size=world,
            local_rank=_opt_int(env, "LOCAL_RANK", "torchrun", rank),
            local_world_size=_opt_int(env, "LOCAL_WORLD_SIZE", "torchrun", world),
            launcher="torchrun",
            local_known=local_known,
        )
    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE", "Open MPI")
        return RankEnv(
            rank=_int(env, "OMPI_COMM_WORLD_RANK", "Open MPI"),
            world_size=world,
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
            local_world_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"),
            launcher="openmpi",
        )
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        world = _opt_int(env, size_var, "Slurm", 1)
        node = _opt_int(env, "SLURM_NODEID", "Slurm", 0)
        local_size = None
        for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            if var in env:
                local_size = slurm_tasks_on_node(env[var], node)
                break
        if local_size is None and "SLURM_NTASKS_PER_NODE" in env:
            local_size = _int(env, "SLURM_NTASKS_PER_NODE", "Slurm")
        rank = _int(env, "SLURM_PROCID", "Slurm")
        return RankEnv(
            rank=rank,
            world_size=world,
            local_rank=_opt_int(env, "SLURM_LOCALID", "Slurm", rank),
            local_world_size=local_size if local_size is not None else world,
            launcher="slurm",
            local_known="SLURM_LOCALID" in env and local_size is not None,
        )
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        rank, world = _int(env, "PMI_RANK", "PMI"), _int(env, "PMI_SIZE", "PMI")
        local_known = "MPI_LOCALRANKID" in env and "MPI_LOCALNRANKS" in env
        return RankEnv(
            rank=rank,
            world_size=world,
            local_rank=_opt_int(env, "MPI_LOCALRANKID", "PMI", rank),
            local_world_size=_opt_int(env, "MPI_LOCALNRANKS", "PMI", world),
            launcher="pmi",
            local_known=local_known,
        )
    if "PMIX_RANK" in env:
        if "PMI_SIZE" not in env:
            raise ConfigError(
                "PMIX_RANK is set (a PMIx launcher) but no variable gives the world size: set WORLD_SIZE (and "
                "RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or launch with mpirun (Open MPI), srun or torchrun."
            )
        rank, world = _int(env, "PMIX_RANK", "PMIx"), _int(env, "PMI_SIZE", "PMIx")
        return RankEnv(rank, world, rank, world, launcher="pmix", local_known=False)
    return RankEnv(0, 1, 0, 1, launcher="none")


def rank_env(environ: MutableMapping[str, str] | None = None) -> RankEnv:
    """Detect the launcher (:func:`detect`) and set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and, for a job
    of several processes, MASTER_ADDR / MASTER_PORT in ``environ`` (default ``os.environ``) for ``env://``.

    Variables already set are kept (torchrun's, or MASTER_ADDR given with ``mpirun -x``). ConfigError (exit 2)
    for an impossible layout or a multi-host job without MASTER_ADDR.
    """
    env = os.environ if environ is None else environ
    info = detect(env)
    if info.world_size < 1 or not 0 <= info.rank < info.world_size:
        raise ConfigError(
            f"the {info.launcher} rank variables say rank {info.rank} of world size {info.world_size}; expected "
            "a world size >= 1 and 0 <= rank < world size."
        )
    if not 0 <= info.local_rank < max(info.local_world_size, 1):
        raise ConfigError(
            f"the {info.launcher} rank variables say local rank {info.local_rank} of {info.local_world_size} "
            "processes on this host; expected 0 <= local rank < local size."
        )
    if info.launcher == "none":
        return info
    values = {
        "RANK": str(info.rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.local_world_size),
    }
    if info.world_size > 1:  # env:// needs the rendezvous address too; checked before anything is set
        one_host = info.local_known and info.local_world_size == info.world_size
        if "MASTER_ADDR" not in env and not one_host:
            raise ConfigError(
                f"{info.launcher} started {info.world_size} ranks "
                f"{'across several hosts' if info.local_known else 'possibly on several hosts'} but "
                "MASTER_ADDR is not set: set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port "
                "there for every rank (mpirun -x MASTER_ADDR=HOST -x MASTER_PORT=PORT; under Slurm "
                "MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)). See docs/launch.md."
            )
        port = env.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"MASTER_PORT is {port!r}; expected a TCP port number 1..65535 (a free one on MASTER_ADDR)."
            )
        values["MASTER_ADDR"] = env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR)
        values["MASTER_PORT"] = port
    env.update(values)
    return info
    env["RANK"] = str(info.rank)
    env["WORLD_SIZE"] = str(info.world_size)
    env["LOCAL_RANK"] = str(info.local_rank)
    env["LOCAL_WORLD_SIZE"] = str(info.local_world_size)
    if info.world_size > 1:
        one_host = info.local_known and info.local_world_size == info.world_size
        if "MASTER_ADDR" not in env:
            if not one_host:
                raise ConfigError(
                    f"{info.launcher} started {info.world_size} ranks "
                    f"{'across several hosts' if info.local_known else 'possibly on several hosts'} but "
                    "MASTER_ADDR is not set: set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port "
                    "there for every rank (mpirun -x MASTER_ADDR=HOST -x MASTER_PORT=PORT; under Slurm "
                    "MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)). See docs/launch.md."
                )
            env["MASTER_ADDR"] = DEFAULT_MASTER_ADDR
        env.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
        port = env["MASTER_PORT"]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"MASTER_PORT is {port!r}; expected a TCP port number 1..65535 (a free one on MASTER_ADDR)."
            )
    return info
