"""ParallelDims: the parallel degrees of one run, validated once, and the DeviceMesh built from them.

Modelled on torchtitan's ``distributed/parallel_dims.py``: a small frozen value object that is created from the
config and the world size, passed explicitly to whoever needs it (never a module global), and that owns the one
place where the degrees are checked against each other.

Degrees::

    world_size = pp x dp_replicate x dp_shard x cp x tp
    dp         = dp_replicate x dp_shard         (the data-parallel size: batches are split over it)

``dp_shard`` is the FSDP (ZeRO) sharding degree and ``dp_replicate`` the replicate degree (DDP, or the outer
dim of HSDP). With ZeRO stage 0 (plain data parallelism) every data-parallel rank holds a full replica, so
:meth:`ParallelDims.from_config` puts the whole data-parallel size on ``dp_replicate``; with stages 1-3 it is
``data_parallel_replicate`` x ``dp_shard``. ``ep`` (expert parallel) does not add a mesh dim: like torchtitan it
borrows ranks from ``dp x cp``, so it must divide that product; its mesh is built by the MoE code.

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

if (
    TYPE_CHECKING
):  # annotations only: importing llmtrain.config here would be circular (config.derived uses us)
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
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(
                f"parallel.expert_parallel {self.ep} must divide data-parallel x context-parallel "
                f"({self.dp} x {self.cp} = {self.dp * self.cp}): expert-parallel ranks are taken from those."
            )

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> ParallelDims:
        """Degrees from the parallel section and the number of processes; ConfigError on a bad combination."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"the world size must be an integer >= 1, got {world_size!r}.")
        for key in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel",
                    "data_parallel_replicate"):  # fmt: skip
            value = getattr(p, key)
            if value < 1:
                raise ConfigError(f"parallel.{key}: expected an integer >= 1, got {value!r}.")
        tp, pp, cp = p.tensor_parallel, p.pipeline_parallel, p.context_parallel
        model_ranks = tp * pp * cp
        if p.data_parallel == -1:
            if world_size % model_ranks:
                raise ConfigError(
                    f"the world size {world_size} is not divisible by tensor_parallel {tp} x pipeline_parallel "
                    f"{pp} x context_parallel {cp} = {model_ranks}, so parallel.data_parallel: -1 cannot be "
                    f"derived. Run on a multiple of {model_ranks} processes or change the degrees."
                )
            dp = world_size // model_ranks
        elif p.data_parallel < 1:
            raise ConfigError(
                f"parallel.data_parallel: expected -1 (derive from the world size) or an integer >= 1, "
                f"got {p.data_parallel!r}."
            )
        else:
            dp = p.data_parallel
            if dp * model_ranks != world_size:
                raise ConfigError(
                    f"the parallel degrees do not multiply to the world size: data_parallel {dp} x "
                    f"tensor_parallel {tp} x pipeline_parallel {pp} x context_parallel {cp} = "
                    f"{dp * model_ranks}, but the world size is {world_size}. Set parallel.data_parallel: -1 "
                    f"to derive it, or launch {dp * model_ranks} processes."
                )
        replicate = p.data_parallel_replicate
        if dp % replicate:
            raise ConfigError(
                f"parallel.data_parallel_replicate {replicate} does not divide the data-parallel size {dp} "
                f"(HSDP needs data_parallel = replicate x shard)."
            )
        if p.effective_zero_stage() == 0:  # plain data parallelism: full replicas, nothing sharded
            replicate, shard = dp, 1
        else:
            shard = dp // replicate
        return cls(
            dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, cp=cp, ep=p.expert_parallel,
            world_size=world_size,
        )  # fmt: skip

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
