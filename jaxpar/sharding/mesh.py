"""Device meshes with jaxpar's named axes.

A jaxpar mesh always has the axes ``data``, ``stage``, ``fsdp``, ``expert``, ``context``
and ``tensor`` in that order: outermost is the most tolerant of slow links (plain data
parallelism only all-reduces gradients once a step, pipeline stages send one activation
per microbatch), innermost the least (tensor parallelism all-reduces inside every layer;
context parallelism passes keys and values in every attention layer; expert parallelism
exchanges tokens all-to-all in every MoE layer). Axes the user does not name have size 1,
so rules can always refer to all of them.

Meshes use ``AxisType.Auto`` so that GSPMD propagates shardings from the constraints
jaxpar places, rather than requiring explicit sharding of every op.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxpar.errors import JaxparError

MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "expert", "context", "tensor")
"""Mesh axis names, outermost (most communication-tolerant) first."""

AXIS_ALIASES: dict[str, str] = {"dp": "data", "tp": "tensor", "mp": "tensor", "pp": "stage",
                                 "ep": "expert", "cp": "context"}
"""Other names people give the same axes; accepted wherever a mesh axis is named."""


def canonical_axis(name: str) -> str:
    """``"tp"`` -> ``"tensor"`` (see :data:`AXIS_ALIASES`); other names are returned as given."""
    return AXIS_ALIASES.get(name, name)


def _canonical_sizes(axes: Mapping[str, int], what: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, size in axes.items():
        axis = canonical_axis(name)
        if axis not in MESH_AXES:
            raise JaxparError(
                f"unknown mesh axis {name!r} in {what}; jaxpar meshes have axes {MESH_AXES} "
                f"(aliases: {', '.join(f'{a}={c}' for a, c in AXIS_ALIASES.items())})")
        if axis in out:
            raise JaxparError(f"mesh axis {axis!r} is given twice in {what} ({dict(axes)})")
        out[axis] = size
    return out


def resolve_sizes(axes: Mapping[str, int], n_devices: int, what: str) -> list[int]:
    """Sizes of :data:`MESH_AXES` in order, with a ``-1`` filled from ``n_devices``.

    Raises:
      JaxparError: for an unknown axis, a size below 1 (other than one -1), or devices the
        fixed axes do not divide.
    """
    axes = _canonical_sizes(axes, what)
    sizes = [int(axes.get(name, 1)) for name in MESH_AXES]
    free = [i for i, s in enumerate(sizes) if s == -1]
    if any(s == 0 or s < -1 for s in sizes):
        raise JaxparError(f"mesh axis sizes must be positive (or one -1), got {dict(axes)}")
    if len(free) > 1:
        names = [MESH_AXES[i] for i in free]
        raise JaxparError(f"at most one mesh axis may be -1 in {what}, got {names}")
    fixed = math.prod(s for s in sizes if s != -1)
    if free:
        if n_devices % fixed:
            raise JaxparError(
                f"cannot fill mesh axis {MESH_AXES[free[0]]!r} in {what}: {n_devices} devices "
                f"are not divisible by the other axes' product {_arith(sizes)} = {fixed}"
            )
        sizes[free[0]] = n_devices // fixed
    return sizes


def _arith(sizes: Sequence[int]) -> str:
    """``data=4 x tensor=4``: the axes a user set (size-1 axes left out, unless all are)."""
    named = [f"{n}={s}" for n, s in zip(MESH_AXES, sizes, strict=True) if s not in (-1, 1)]
    return " x ".join(named) or "all axes 1"


def mesh_sizes(axes: Mapping[str, int], dcn: Mapping[str, int] | None, n_devices: int
               ) -> tuple[list[int], list[int]]:
    """The (ICI, DCN) sizes of :data:`MESH_AXES` that :func:`make_mesh` builds over
    ``n_devices`` devices, ``-1`` filled in; needs no devices, so configs can be checked
    before JAX starts.

    Raises:
      JaxparError: for an unknown axis, a size below 1 (other than one -1), devices that
        do not split into the slices, or axis sizes whose product is not ``n_devices``.
    """
    dcn_sizes = resolve_sizes(dcn or {}, 1, "dcn") if dcn else [1] * len(MESH_AXES)
    n_slices = math.prod(dcn_sizes)
    if n_devices % n_slices:
        raise JaxparError(
            f"{n_devices} devices cannot form {n_slices} slices ({_arith(dcn_sizes)})")
    ici_sizes = resolve_sizes(axes, n_devices // n_slices, "axes")
    total = math.prod(ici_sizes) * n_slices
    if total != n_devices:
        shape = _arith([i * d for i, d in zip(ici_sizes, dcn_sizes, strict=True)])
        raise JaxparError(f"mesh {shape} needs {total} devices, but {n_devices} are "
                          "available: set one axis to -1, e.g. mesh.data=-1")
    return ici_sizes, dcn_sizes


def make_mesh(
    axes: Mapping[str, int],
    *,
    dcn: Mapping[str, int] | None = None,
    devices: Sequence[jax.Device] | None = None,
    explicit: bool = False,
) -> Mesh:
    """Build a mesh over ``devices`` (default: all devices) with jaxpar's named axes.

    Args:
      axes: size of each mesh axis within a slice (ICI), e.g. ``{"data": 2, "tensor": 4}``.
        Unnamed axes have size 1; at most one axis may be ``-1``, filled from the device
        count.
      dcn: for multi-slice machines, how many slices each axis spans (data-centre
        network). The final size of an axis is ``axes[a] * dcn[a]``. Built with
        ``mesh_utils.create_hybrid_device_mesh`` when the devices know their slice (TPU
        slices), or as many processes as slices hold them (GPU nodes); otherwise
        (simulated CPU devices) consecutive devices form one slice.
      devices: the devices to use, in order.
      explicit: give the axes ``AxisType.Explicit`` (JAX's sharding-in-types mode) for
        models that call ``jax.sharding.reshard`` or pass ``out_sharding=``; by default
        axes are ``Auto`` and GSPMD propagates shardings from jaxpar's constraints.

    Raises:
      JaxparError: when an axis name is unknown (``dp``, ``tp``/``mp`` and ``pp`` are
        accepted for data, tensor and stage), or the product of the axis sizes does
        not equal the number of devices (the message shows the arithmetic).
    """
    devices = list(jax.devices() if devices is None else devices)
    ici_sizes, dcn_sizes = mesh_sizes(axes, dcn, len(devices))
    if math.prod(dcn_sizes) == 1:
        grid = mesh_utils.create_device_mesh(ici_sizes, devices, allow_split_physical_axes=True)
    elif len({getattr(d, "slice_index", None) for d in devices}) == math.prod(dcn_sizes):
        grid = mesh_utils.create_hybrid_device_mesh(ici_sizes, dcn_sizes, devices)
    elif len({d.process_index for d in devices}) == math.prod(dcn_sizes) > 1:
        # GPU nodes: one process a node, all in slice 0
        grid = mesh_utils.create_hybrid_device_mesh(ici_sizes, dcn_sizes, devices,
                                                    process_is_granule=True)
    else:
        grid = _hybrid_grid_by_order(devices, ici_sizes, dcn_sizes)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(grid, MESH_AXES, axis_types=(kind,) * len(MESH_AXES))


def compile_only(mesh: Mesh) -> bool:
    """Whether ``mesh``'s devices can only be compiled for, not run on: a topology
    description's devices (a TPU slice this host is not part of), which no backend of this
    process has."""
    device = mesh.devices.flat[0]
    try:
        return device not in jax.devices(device.platform)
    except RuntimeError:  # no backend of that platform here
        return True


def is_explicit(mesh: Mesh) -> bool:
    """Whether the mesh's axes are ``Explicit`` (sharding in types) rather than ``Auto``."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _hybrid_grid_by_order(
    devices: Sequence[jax.Device], ici: Sequence[int], dcn: Sequence[int]
) -> np.ndarray:
    """Hybrid mesh for devices with no slice index: each run of consecutive devices is a slice.

    Axis ``a`` of the result has size ``dcn[a] * ici[a]`` with the slice index as the
    major part, so collectives along an axis that spans slices cross the DCN only at
    the slice boundary, as on real multi-slice hardware.
    """
    per_slice = math.prod(ici)
    slices = [np.asarray(devices[i : i + per_slice], dtype=object).reshape(ici)
              for i in range(0, len(devices), per_slice)]
    out = np.empty(tuple(d * i for d, i in zip(dcn, ici, strict=True)), dtype=object)
    for idx, block in zip(np.ndindex(*dcn), slices, strict=True):
        where = tuple(slice(k * i, (k + 1) * i) for k, i in zip(idx, ici, strict=True))
        out[where] = block
    return out


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """The mesh's axis sizes as an ordered dict."""
    return dict(mesh.shape)


def describe(mesh: Mesh) -> str:
    """One line such as ``data=2 x fsdp=2 x tensor=2 (8 devices)``; size-1 axes omitted."""
    parts = [f"{name}={size}" for name, size in mesh.shape.items() if size > 1]
    return f"{' x '.join(parts) or 'single device'} ({mesh.size} devices)"
