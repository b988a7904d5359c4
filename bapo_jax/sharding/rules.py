"""Logical-axis rules: the one map from the model's logical axis names to mesh axes.

Every parameter declares its logical axes once, in the model (e.g. a query kernel is
("layers", "embed", "q_heads", "head_dim")). Sharded init, restore and export all derive their
`NamedSharding`s from that declaration through `logical_to_spec`; mesh-axis names never appear
in model code.

Default rules (FSDP x tensor parallelism):
  vocab, q_heads, kv_heads, mlp -> tensor     (Megatron column/row splits)
  embed                         -> fsdp       (ZeRO-3: every weight is split along d_model)
  layers, head_dim, norm        -> replicated
  batch                         -> (data, fsdp)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalAxes = tuple[str | None, ...]
MeshAxes = str | tuple[str, ...] | None

DEFAULT_RULES: Mapping[str, MeshAxes] = {
    # parameters
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "lora_rank": None,  # a LoRA adapter's inner dimension r: small, replicated
    # activations
    "batch": ("data", "fsdp"),
    "length": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_vocab": "tensor",
}


def logical_to_spec(
    axes: Sequence[str | None], rules: Mapping[str, MeshAxes] = DEFAULT_RULES
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec; a mesh axis is used at most once per spec."""
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for name in axes:
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        target = rules[name]
        members = (target,) if isinstance(target, str) else tuple(target or ())
        if used.intersection(members):
            # A mesh axis may shard only one dimension of a tensor: later dims stay replicated.
            spec.append(None)
            continue
        used.update(members)
        spec.append(target)
    return PartitionSpec(*spec)


def _is_axes(node) -> bool:
    return isinstance(node, tuple) and all(a is None or isinstance(a, str) for a in node)


def tree_specs(logical_tree, rules: Mapping[str, MeshAxes] = DEFAULT_RULES):
    """Maps a pytree whose leaves are logical-axis tuples to a pytree of PartitionSpecs."""
    return jax.tree.map(lambda axes: logical_to_spec(axes, rules), logical_tree, is_leaf=_is_axes)


def tree_shardings(logical_tree, mesh: Mesh, rules: Mapping[str, MeshAxes] = DEFAULT_RULES):
    """Maps a pytree of logical-axis tuples to NamedShardings on `mesh`."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_spec(axes, rules)),
        logical_tree,
        is_leaf=_is_axes,
    )


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a [B, ...] batch array: B split over data x fsdp, the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1)))


def batch_devices(mesh: Mesh) -> int:
    """How many ways the batch dimension is split (the product of the mesh axes "batch" maps
    to): every batch's row count must be a multiple of it."""
    spec = logical_to_spec(("batch",))[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


def constrain(
    x: jax.Array, axes: Sequence[str | None], rules: Mapping[str, MeshAxes] = DEFAULT_RULES
):
    """`with_sharding_constraint` by logical axes when a mesh is set (`jax.set_mesh`), else x.

    Model code calls this with logical names only (e.g. the residual stream is
    ("batch", "length", "act_embed")): without it XLA may keep activations split like the
    weights (along d_model) and every device computes the MLP of the whole global batch.
    """
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, rules))
