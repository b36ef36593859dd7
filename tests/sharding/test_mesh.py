import jax
import pytest
from jax.sharding import AxisType

from jaxpar import JaxparError, make_mesh
from jaxpar.sharding.mesh import MESH_AXES, describe


def test_axes_fixed_order_and_fill(devices):
    mesh = make_mesh({"tensor": 2, "data": -1})
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 4, "stage": 1, "fsdp": 1, "expert": 1, "context": 1,
                                "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert describe(mesh) == "data=4 x tensor=2 (8 devices)"


def test_mismatch_shows_arithmetic(devices):
    with pytest.raises(JaxparError, match=r"mesh data=4 x tensor=4 needs 16 "
                                          r"devices, but 8 are available"):
        make_mesh({"data": 4, "tensor": 4})


def test_fill_that_does_not_divide(devices):
    with pytest.raises(JaxparError, match="not divisible"):
        make_mesh({"data": -1, "tensor": 3})


def test_unknown_axis_and_two_free_axes(devices):
    with pytest.raises(JaxparError, match="unknown mesh axis 'model'"):
        make_mesh({"model": 8})
    with pytest.raises(JaxparError, match="at most one"):
        make_mesh({"data": -1, "fsdp": -1})


def test_subset_of_devices(devices):
    mesh = make_mesh({"data": 1}, devices=devices[:1])
    assert mesh.size == 1


def test_hybrid_mesh_slices_are_outer(devices):
    # 2 slices of 4 devices; data spans the slices (DCN), fsdp stays inside a slice (ICI).
    mesh = make_mesh({"data": 1, "fsdp": 4}, dcn={"data": 2})
    assert dict(mesh.shape)["data"] == 2 and dict(mesh.shape)["fsdp"] == 4
    grid = mesh.devices.reshape(2, 4)
    ids = [[d.id for d in row] for row in grid]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]  # each row (one data index) is one slice


def test_aliases_and_explicit_axes(devices):
    mesh = make_mesh({"fsdp": 4, "tp": 2})
    assert {a: s for a, s in mesh.shape.items() if s > 1} == {"fsdp": 4, "tensor": 2}
    assert dict(make_mesh({"dp": 2, "pp": 2, "mp": 2}).shape) == {
        "data": 2, "stage": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2}
    assert {a: s for a, s in make_mesh({"ep": 4, "cp": 2}).shape.items() if s > 1} == {
        "expert": 4, "context": 2}
    with pytest.raises(JaxparError, match="'tensor' is given twice"):
        make_mesh({"tp": 2, "tensor": 4})
    explicit = make_mesh({"data": 8}, explicit=True)
    assert all(t == AxisType.Explicit for t in explicit.axis_types)
