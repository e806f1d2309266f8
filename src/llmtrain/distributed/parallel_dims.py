"""ParallelDims: the parallel degrees of one run and the DeviceMesh built from them.

Modelled on torchtitan's ``distributed/parallel_dims.py``: a small frozen value object that is created from the
config and the world size and passed explicitly to whoever needs it (never a module global). It does the degree
bookkeeping (how the data-parallel size splits into replicate x shard) and builds the mesh; the rules on which
degrees are legal live in :mod:`llmtrain.feasibility` (``from_config`` raises the first of its
``degree_problems``), and ``__post_init__`` only checks the value object's own invariant (its dims multiply to
its world size), for instances built directly.

Degrees::

    world_size = pp x dp_replicate x dp_shard x cp x tp
    dp         = dp_replicate x dp_shard         (the data-parallel size: batches are split over it)

``dp_shard`` is the FSDP (ZeRO) sharding degree and ``dp_replicate`` the replicate degree (DDP, or the outer
dim of HSDP). With ZeRO stage 0 (plain data parallelism) every data-parallel rank holds a full replica, so
:meth:`ParallelDims.from_config` puts the whole data-parallel size on ``dp_replicate``; with stages 1-3 it is
``data_parallel_replicate`` x ``dp_shard``. ``ep`` (expert parallel) does not add a mesh dim: it borrows ranks
from ``dp x cp x tp``; ``distributed/expert_parallel.expert_mesh`` regroups them as a second mesh over the same
ranks, ``(pp, edp, ep, etp)``.

:meth:`ParallelDims.build_mesh` always builds all five dims, in the order ``pp, dp_replicate, dp_shard, cp,
tp`` (size-1 dims included, so ``mesh["tp"]`` works in every layout and code needs no branches), then the
flattened dims ``dp`` (dp_replicate x dp_shard: batch split, data loading), ``dp_shard_cp`` (FSDP when context
parallel shards the sequence) and ``dp_cp`` (loss / gradient-norm reductions). :meth:`ParallelDims.build_meshes`
returns all of them by name, which avoids slicing flattened dims from the root mesh (deprecated in torch 2.11).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmtrain.errors import ConfigError
from llmtrain.feasibility import degree_problems, degrees, raise_fatal

if (
    TYPE_CHECKING
):  # annotations only: importing llmtrain.config here would be circular (resolve.derived uses us)
    from torch.distributed.device_mesh import DeviceMesh

    from llmtrain.config.schema import ParallelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of a run; construct with :meth:`from_config` (or directly: the product is checked)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ParallelDims.{name} must be an integer >= 1, got {value!r}.")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} "
                f"x cp {self.cp} x tp {self.tp} = {product} do not equal the world size {self.world_size}."
            )

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> ParallelDims:
        """Degrees from the parallel section and the number of processes; ConfigError (the first of
        :func:`llmtrain.feasibility.degree_problems`) on a bad combination."""
        raise_fatal(degree_problems(p, world_size))
        d = degrees(p, world_size)
        return cls(
            dp_replicate=d.dp_replicate,
            dp_shard=d.dp_shard,
            tp=d.tp,
            pp=d.pp,
            cp=d.cp,
            ep=d.ep,
            world_size=world_size,
        )

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of distinct batch slices per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def mesh_shape(self) -> dict[str, int]:
        """Mesh dim name -> size, in mesh order (outermost first); all five dims, size-1 ones included."""
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}
        return {**sizes, "cp": self.cp, "tp": self.tp}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world DeviceMesh: dims pp, dp_replicate, dp_shard, cp, tp, with flattened dp, dp_shard_cp, dp_cp.

        Needs an initialised default process group of ``world_size`` ranks (torchrun, or
        ``init_process_group`` in tests). ``device_type`` is "cpu", "cuda" or "npu". Torch >= 2.11 warns when a
        flattened dim is sliced from the root mesh (``mesh["dp"]``); :meth:`build_meshes` hands them out directly.
        """
        return self.build_meshes(device_type)["world"]

    def build_meshes(self, device_type: str) -> dict[str, DeviceMesh]:
        """ "world" plus one 1-D mesh per name: pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, dp_cp."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = self.mesh_shape()
        world = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
        meshes = {"world": world, **{name: world[name] for name in shape}}
        # _flatten is the DeviceMesh API torchtitan uses for combined dims (private in torch, stable in use).
        for name, dims in _FLATTENED.items():
            meshes[name] = world[dims]._flatten(mesh_dim_name=name)
        return meshes


_FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


def default_world_size(p: ParallelConfig) -> int:
    """World size implied by the degrees alone: tp x pp x cp x max(data_parallel, 1) (dp -1 counts as 1)."""
    return p.tensor_parallel * p.pipeline_parallel * p.context_parallel * max(p.data_parallel, 1)
