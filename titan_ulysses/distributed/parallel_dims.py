"""Parallelism degrees and the one DeviceMesh that carries them.

Mesh dimensions, outermost to innermost (innermost wants the fastest links)::

    dp_replicate  x  dp_shard  x  cp  x  sp  x  tp

``cp`` (context parallelism, all-gather of K/V) sits outside ``sp`` so that Ulysses'
all-to-all stays on the fastest links (inside a node) and cp's all-gather crosses nodes,
as in USP / Megatron's ``a2a+p2p``.

Flattened meshes derived from them, named by what they are for:

* ``dp``          (dp_replicate, dp_shard)             -- data loading: ranks of one cp x sp x tp group load the same sample
* ``seq``         (cp, sp)                             -- the ranks one sequence is split over (cp outer)
* ``fsdp_shard``  (dp_shard, cp, sp)                   -- FSDP2 shards parameters over this (HSDP adds dp_replicate)
* ``loss``        (dp_replicate, dp_shard, cp, sp)     -- token counts and losses are summed over this

(``dp_shard_sp``, the name ``fsdp_shard`` had before ``cp`` existed, still answers.)

Every dimension is always present in the mesh (size 1 when unused), so code can
ask for ``mesh["sp"]`` without checking whether SP is on.

Adding a dimension, as ``cp`` and ``ep`` were added (``docs/extending.md``, "Adding a mesh dimension"):

1. here: a degree field with its docstring and its config name in ``SETTING_NAMES``; its name in
   ``MESH_DIMS`` (ranks of its own) or ``BORROWED`` (ranks of a group, as ``ep``); the groups of
   ``FLATTENED`` that must span it (FSDP and loss reductions usually do, data loading does not when
   its ranks share a sample). Range checks, the world-size check, ``size``, ``build_mesh`` and the HSDP
   mesh follow from the tables;
2. the setting: a field in ``config/job_config.py`` (its range checked with the layout, ``ranges.EXEMPT``)
   passed to ``ParallelDims`` by ``preflight.validate``;
3. ``apply_x(model, mesh["x"])`` in its own file, called on one line of ``models/decoder/parallelize.py``;
4. where the dimension changes more than the model: the batch (``data/sharding.py``, if it splits the
   sequence, as cp does), FSDP's meshes (``fsdp.py``, if parameters shard over it, as ep's experts do),
   and the planner's ``Layout`` and terms (``planning/``), so the estimate and the dry run know it.
No process group is created until :meth:`ParallelDims.build_mesh`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "sp", "tp")

FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "seq": ("cp", "sp"),
    "fsdp_shard": ("dp_shard", "cp", "sp"),
    "loss": ("dp_replicate", "dp_shard", "cp", "sp"),
}

# Borrowed dimensions: no ranks of their own, carved from the innermost ranks of a flattened
# group; the rest of that group gets the second name. ``ep`` (expert parallelism) takes ``ep``
# ranks of dp_shard x cp x sp (as torchtitan's does), so sp=8, ep=8 is one node: experts are
# sharded over ``ep`` and FSDP shards them over ``efsdp`` (``ep_fsdp``: with HSDP's replicas).
BORROWED = {"ep": ("fsdp_shard", "efsdp")}

# Earlier names of flattened groups, kept for callers written before a dimension joined them.
ALIASES = {"dp_shard_sp": "fsdp_shard"}

# Config names of each mesh dimension's degree, used in error messages.
SETTING_NAMES = {
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "cp": "context_parallel_degree",
    "sp": "ulysses_degree",
    "tp": "tensor_parallel_degree",
    "ep": "expert_parallel_degree",
}

# The one degree that may be -1 ("the ranks the others leave").
FILL_DIM = "dp_shard"


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    """Replicas of the whole model (HSDP's replicate dimension); gradients all-reduced."""
    dp_shard: int = -1
    """FSDP shard degree; -1 takes whatever the other degrees leave of the world size."""
    cp: int = 1
    """Context-parallel degree: each sequence is also split over this many ranks (outside sp);
    attention all-gathers K and V over them (``distributed/context_parallel.py``)."""
    sp: int = 1
    """Ulysses sequence-parallel degree: each sequence is split over this many ranks."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and MLP columns are split over this many ranks."""
    ep: int = 1
    """Expert-parallel degree, borrowed from dp_shard x cp x sp (innermost): MoE experts are sharded
    over this many ranks and tokens sent to them (``distributed/expert_parallel.py``)."""
    world_size: int = 1
    """Number of processes in the job."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size {self.world_size} must be >= 1")
        fixed = [d for d in MESH_DIMS if d != FILL_DIM]
        for dim in fixed:
            if getattr(self, dim) < 1:
                raise ValueError(f"{SETTING_NAMES[dim]} {getattr(self, dim)} must be >= 1")
        others = math.prod(getattr(self, d) for d in fixed)
        if getattr(self, FILL_DIM) == -1:
            if self.world_size % others != 0:
                names = " x ".join(SETTING_NAMES[d] for d in fixed)
                values = " x ".join(str(getattr(self, d)) for d in fixed)
                raise ValueError(
                    f"world size {self.world_size} is not divisible by {names} = {values} = {others}; "
                    f"choose degrees whose product divides {self.world_size}"
                )
            setattr(self, FILL_DIM, self.world_size // others)
        if getattr(self, FILL_DIM) < 1:
            raise ValueError(
                f"{SETTING_NAMES[FILL_DIM]} {getattr(self, FILL_DIM)} must be >= 1, or -1 to use the remaining ranks"
            )
        product = math.prod(self.degrees.values())
        if product != self.world_size:
            # the degrees that are set (1 is the default of every one but the fill dimension)
            terms = " x ".join(f"{SETTING_NAMES[d]} {n}" for d, n in self.degrees.items() if n != 1 or d == FILL_DIM)
            raise ValueError(
                f"{terms} = {product}, but the world size is {self.world_size}; "
                f"the degrees must multiply to the number of processes "
                f"(set {SETTING_NAMES[FILL_DIM]} = -1 to fill the rest automatically)"
            )

        for dim, (group, _) in BORROWED.items():
            n, degree = self.size(group), getattr(self, dim)
            if degree < 1 or n % degree:
                names = " x ".join(SETTING_NAMES[d] for d in FLATTENED[group])
                raise ValueError(f"{SETTING_NAMES[dim]} {degree} must divide {names} = {n} (it borrows those ranks); "
                                 f"use one of {[d for d in range(1, n + 1) if n % d == 0]}")

    @property
    def degrees(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in MESH_DIMS}

    def size(self, flat_name: str) -> int:
        """Size of a mesh dimension or of a flattened mesh, without building anything."""
        flat_name = ALIASES.get(flat_name, flat_name)
        for dim, (group, rest) in BORROWED.items():
            if flat_name == rest:
                return self.size(group) // getattr(self, dim)
        if flat_name in FLATTENED:
            return math.prod(getattr(self, d) for d in FLATTENED[flat_name])
        return getattr(self, flat_name)

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

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
            # HSDP: replicate over dp_replicate, shard over fsdp_shard (2-D, replicate outermost)
            meshes["fsdp"] = meshes["loss"]._unflatten(
                0, (self.dp_replicate, self.size("fsdp_shard")), ("hsdp_replicate", "hsdp_shard")
            )
        else:
            meshes["fsdp"] = meshes["fsdp_shard"]
        for dim, (group, rest) in BORROWED.items():
            # the group's ranks as (rest, dim), dim innermost; unflattened from ``loss`` (dp_replicate
            # outside the group) so that the weights' FSDP mesh can be HSDP's 2-D one too
            shape = (self.dp_replicate, self.size(rest), getattr(self, dim))
            split = meshes["loss"]._unflatten(0, shape, (f"{dim}_replicate", rest, dim))
            meshes[rest], meshes[dim] = split[rest], split[dim]
            meshes[f"{dim}_fsdp"] = split[(f"{dim}_replicate", rest)] if self.dp_replicate > 1 else split[rest]
        for old, new in ALIASES.items():
            meshes[old] = meshes[new]
        self._meshes = meshes
        return root

    def get_mesh(self, name: str) -> DeviceMesh:
        """A mesh dimension (``sp``), a flattened mesh (``dp``, ``seq``, ``fsdp_shard``, ``loss``), ``fsdp``, or a
        borrowed one (``ep``, its complement ``efsdp``, ``ep_fsdp`` where FSDP shards the experts)."""
        meshes = getattr(self, "_meshes", None)
        if meshes is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must be called before get_mesh")
        if name not in meshes:
            raise KeyError(f"no mesh named {name!r}; known: {sorted(meshes)}")
        return meshes[name]
