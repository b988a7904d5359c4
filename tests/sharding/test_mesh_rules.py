"""Mesh configs and the logical-axis rules (generic; the per-parameter table lives with the
sharded train step)."""

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec

from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.sharding import rules


def test_make_mesh_shapes_and_auto_axes():
    for name in ("cpu1", "cpu-fsdp8", "cpu-fsdp4-tp2", "cpu-dp2-fsdp2-tp2"):
        config = mesh_lib.mesh_preset(name)
        devices = jax.devices()[: config.num_devices]
        mesh = mesh_lib.make_mesh(config, devices)
        assert mesh.axis_names == mesh_lib.MESH_AXES
        assert tuple(mesh.shape.values()) == config.shape
        assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_mesh_rejects_wrong_device_count():
    with pytest.raises(ValueError, match=r"fsdp=4 x tensor=2 needs 8 devices, but 4"):
        mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=4, tensor=2), jax.devices()[:4])


def test_mesh_config_validation_names_field():
    with pytest.raises(ValueError, match=r"MeshConfig.tensor must be a positive int, got 0"):
        mesh_lib.MeshConfig(tensor=0)
    with pytest.raises(ValueError, match="unknown mesh preset 'h100'"):
        mesh_lib.mesh_preset("h100")


def test_tensor_axis_must_divide_heads():
    # Qwen2.5-7B: 28 query heads, 4 KV heads.
    mesh_lib.MeshConfig(tensor=4).check_heads(28, 4)
    with pytest.raises(
        ValueError, match=r"tensor=8 does not divide the model's num_attention_heads=28"
    ):
        mesh_lib.MeshConfig(tensor=8).check_heads(28, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2"):
        mesh_lib.MeshConfig(tensor=4).check_heads(12, 2)


def test_logical_to_spec():
    assert rules.logical_to_spec(("layers", "embed", "q_heads", "head_dim")) == PartitionSpec(
        None, "fsdp", "tensor", None
    )
    assert rules.logical_to_spec(("vocab", "embed")) == PartitionSpec("tensor", "fsdp")
    assert rules.logical_to_spec(("batch", None)) == PartitionSpec(("data", "fsdp"), None)
    # A mesh axis shards at most one dimension of a tensor.
    assert rules.logical_to_spec(("q_heads", "mlp")) == PartitionSpec("tensor", None)
    with pytest.raises(ValueError, match="logical axis 'bogus' has no sharding rule"):
        rules.logical_to_spec(("bogus",))


def test_tree_shardings_follow_declared_axes():
    config = mesh_lib.MeshConfig(fsdp=4, tensor=2)
    mesh = mesh_lib.make_mesh(config, jax.devices()[:8])
    tree = {"embedding": ("vocab", "embed"), "norm": ("layers", "norm")}
    shardings = rules.tree_shardings(tree, mesh)
    assert shardings["embedding"].spec == PartitionSpec("tensor", "fsdp")
    assert shardings["norm"].spec == PartitionSpec(None, None)
    assert shardings["embedding"].mesh is mesh


def test_xla_flags_with_cpu_devices_replaces_only_the_device_count():
    from bapo_jax.sharding.mesh import xla_flags_with_cpu_devices

    flags = "--a=1 --xla_force_host_platform_device_count=8 --b"
    assert xla_flags_with_cpu_devices(flags, 4) == (
        "--a=1 --b --xla_force_host_platform_device_count=4"
    )
    assert xla_flags_with_cpu_devices(flags, 1) == "--a=1 --b"
    assert xla_flags_with_cpu_devices("", 2) == "--xla_force_host_platform_device_count=2"
