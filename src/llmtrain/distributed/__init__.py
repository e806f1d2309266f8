"""Distributed layer: parallel degrees and meshes (``parallel_dims``), applied to single-device models from outside.

Nothing here holds global state: a :class:`ParallelDims` is built from the config and passed explicitly.
"""

from llmtrain.distributed.parallel_dims import ParallelDims, default_world_size

__all__ = ["ParallelDims", "default_world_size"]
