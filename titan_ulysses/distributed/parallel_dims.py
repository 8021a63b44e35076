"""Parallelism degrees and the one DeviceMesh that carries them.

Mesh dimensions, outermost to innermost (innermost wants the fastest links)::

    dp_replicate  x  dp_shard  x  sp  x  tp

Flattened meshes derived from them:

* ``dp``           (dp_replicate, dp_shard)     -- data loading: ranks of one sp x tp group load the same sample
* ``dp_shard_sp``  (dp_shard, sp)               -- FSDP2 shards parameters over this (HSDP adds dp_replicate)
* ``loss``         (dp_replicate, dp_shard, sp) -- token counts and losses are summed over this

Every dimension is always present in the mesh (size 1 when unused), so code can
ask for ``mesh["sp"]`` without checking whether SP is on.

Adding a dimension (say a ring-attention ``cp`` beside ``sp``) is three edits here
and one ``apply_*`` function elsewhere:

1. add a degree field below, with a docstring;
2. insert its name in ``MESH_DIMS`` at its place in the order;
3. add it to the flattened groups of ``FLATTENED`` that must span it (FSDP and
   loss reductions usually do);
then write ``apply_cp(model, mesh["cp"])`` and call it from ``parallelize_llama``.
No process group is created until :meth:`ParallelDims.build_mesh`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "sp", "tp")

FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_sp": ("dp_shard", "sp"),
    "loss": ("dp_replicate", "dp_shard", "sp"),
}

# Config names of each mesh dimension's degree, used in error messages.
SETTING_NAMES = {
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "sp": "ulysses_degree",
    "tp": "tensor_parallel_degree",
}


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    """Replicas of the whole model (HSDP's replicate dimension); gradients all-reduced."""
    dp_shard: int = -1
    """FSDP shard degree; -1 takes whatever the other degrees leave of the world size."""
    sp: int = 1
    """Ulysses sequence-parallel degree: each sequence is split over this many ranks."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and MLP columns are split over this many ranks."""
    world_size: int = 1
    """Number of processes in the job."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size {self.world_size} must be >= 1")
        for dim in ("dp_replicate", "sp", "tp"):
            if getattr(self, dim) < 1:
                raise ValueError(f"{SETTING_NAMES[dim]} {getattr(self, dim)} must be >= 1")
        others = self.dp_replicate * self.sp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by "
                    f"{SETTING_NAMES['dp_replicate']} x {SETTING_NAMES['sp']} x {SETTING_NAMES['tp']} = "
                    f"{self.dp_replicate} x {self.sp} x {self.tp} = {others}; "
                    f"choose degrees whose product divides {self.world_size}"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ValueError(
                f"{SETTING_NAMES['dp_shard']} {self.dp_shard} must be >= 1, or -1 to use the remaining ranks"
            )
        product = math.prod(self.degrees.values())
        if product != self.world_size:
            terms = " x ".join(f"{SETTING_NAMES[d]} {n}" for d, n in self.degrees.items())
            raise ValueError(
                f"{terms} = {product}, but the world size is {self.world_size}; "
                f"the degrees must multiply to the number of processes "
                f"(set {SETTING_NAMES['dp_shard']} = -1 to fill the rest automatically)"
            )

    @property
    def degrees(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in MESH_DIMS}

    def size(self, flat_name: str) -> int:
        """Size of a mesh dimension or of a flattened mesh, without building anything."""
        if flat_name in FLATTENED:
            return math.prod(getattr(self, d) for d in FLATTENED[flat_name])
        return getattr(self, flat_name)

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP is needed whenever parameters are shared by more than one data or sequence rank:
        sp ranks see different tokens, so their gradients must be reduced even when dp is 1."""
        return self.size("loss") > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the DeviceMesh and its flattened views; requires an initialised process group.

        Returns the root mesh; every named mesh (a dimension, a flattened group, or ``fsdp``)
        is then available from :meth:`get_mesh`.
        """
        root = init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=MESH_DIMS)
        meshes = {dim: root[dim] for dim in MESH_DIMS}
        for flat_name, dims in FLATTENED.items():
            meshes[flat_name] = root[dims]._flatten(flat_name)
        if self.dp_replicate > 1:
            # HSDP: replicate over dp_replicate, shard over dp_shard x sp (2-D, replicate outermost)
            meshes["fsdp"] = meshes["loss"]._unflatten(
                0, (self.dp_replicate, self.size("dp_shard_sp")), ("hsdp_replicate", "hsdp_shard")
            )
        else:
            meshes["fsdp"] = meshes["dp_shard_sp"]
        self._meshes = meshes
        return root

    def get_mesh(self, name: str) -> DeviceMesh:
        """A mesh dimension (``sp``), a flattened mesh (``dp``, ``dp_shard_sp``, ``loss``) or ``fsdp``."""
        meshes = getattr(self, "_meshes", None)
        if meshes is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must be called before get_mesh")
        if name not in meshes:
            raise KeyError(f"no mesh named {name!r}; known: {sorted(meshes)}")
        return meshes[name]
