"""Projection geometry: einsum views of projection layers, held to hand-written letters and
to what Flax's own layers compute."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.models.projections import (
    LINEAR_SPEC,
    ProjectionSpec,
    letters,
    linear_general_spec,
    parse_einsum,
    stack_depth,
)


@pytest.mark.parametrize("equation,spec", [
    ("...i,io->...o", ProjectionSpec("...i", "io", "...o", "i", "o", "")),
    ("bhd,hde->bhe", ProjectionSpec("bhd", "hde", "bhe", "d", "e", "h")),
    ("bse, enh -> bsnh", ProjectionSpec("bse", "enh", "bsnh", "e", "nh", "")),
    ("bsnh,nhe->bse", ProjectionSpec("bsnh", "nhe", "bse", "nh", "e", "")),
])
def test_parse_einsum_sorts_kernel_letters(equation, spec):
    assert parse_einsum(equation) == spec
    assert spec.equation == equation.replace(" ", "")


def test_linear_spec_and_letters():
    assert LINEAR_SPEC.equation == "...i,io->...o"
    assert (LINEAR_SPEC.in_letters, LINEAR_SPEC.out_letters) == ("i", "o")
    assert letters("...ab") == "ab" and letters("ab...c") == "abc" and letters("") == ""


@pytest.mark.parametrize("equation,match", [
    ("bi,i...->bo", r"cannot adapt einsum 'bi,i...->bo': expected 'input,kernel->output'"),
    ("bi->bo", r"expected 'input,kernel->output'"),
    ("bi,ijk->bj", r"every kernel letter must appear once and reach the input or the output"),
    ("bi,iio->bo", r"every kernel letter must appear once"),
    ("bi,ij->bij", r"einsum 'bi,ij->bij' has no contracted or no output kernel dimension"),
    ("bij,ij->b", r"has no contracted or no output kernel dimension"),
])
def test_parse_einsum_refuses_what_is_no_projection(equation, match):
    with pytest.raises(jaxpar.JaxparError, match=match):
        parse_einsum(equation)


def test_free_letters_avoid_the_equation():
    assert LINEAR_SPEC.free_letters(3) == "abc"
    assert parse_einsum("abc,cd->abd").free_letters(2) == "ef"
    assert LINEAR_SPEC.free_letters(50).isalpha()  # 52 letters, 2 taken
    with pytest.raises(jaxpar.JaxparError, match=r"einsum '\.\.\.i,io->\.\.\.o' leaves no free "
                                                 r"subscript letters"):
        LINEAR_SPEC.free_letters(51)


def test_linear_general_spec_by_hand():
    # Last axis in, two output features: the kernel is (in, out1, out2).
    assert linear_general_spec((-1,), 2).equation == "...a,abc->...bc"
    # The last two axes in.
    assert linear_general_spec((-2, -1), 1).equation == "...ab,abc->...c"
    # The leading axis in: the rest of the input stays in front of the output features.
    assert linear_general_spec((0,), 1).equation == "a...,ab->...b"
    # A batch axis in front: shared by input, kernel and output.
    spec = linear_general_spec((1,), 1, batch_axis=(0,))
    assert spec.equation == "ab...,abc->a...c" and spec.shared == "a"


@pytest.mark.parametrize("kw,x_shape", [
    ({"in_features": 6, "out_features": (2, 3)}, (2, 3, 6)),
    ({"in_features": (3, 6), "out_features": 5, "axis": (-2, -1)}, (2, 4, 3, 6)),
    ({"in_features": (5, 6), "out_features": 2, "axis": (-1, -3)}, (2, 5, 3, 6)),
    ({"in_features": (2, 3), "out_features": (5, 2), "axis": (0, 2)}, (2, 7, 3, 4)),
    ({"in_features": 3, "out_features": 5, "axis": 1, "batch_axis": {0: 2}}, (2, 3, 4, 7)),
])
def test_linear_general_spec_computes_what_flax_does(kw, x_shape):
    layer = nnx.LinearGeneral(**kw, use_bias=False, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=x_shape), jnp.float32)
    axis = kw.get("axis", -1)
    axis = (axis,) if isinstance(axis, int) else axis
    out = np.atleast_1d(kw["out_features"])
    spec = linear_general_spec(axis, len(out), tuple(kw.get("batch_axis", {})))
    assert len(spec.kernel) == layer.kernel.ndim
    np.testing.assert_allclose(jnp.einsum(spec.equation, x, layer.kernel[...]), layer(x),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis,batch", [((-1, -1), ()), ((0,), (0,)), ((), ())])
def test_linear_general_spec_refuses_repeated_or_batch_axes(axis, batch):
    with pytest.raises(jaxpar.JaxparError, match=re.escape(f"nnx.LinearGeneral(axis={axis}")
                       + ".*axes must be distinct and not batch axes"):
        linear_general_spec(axis, 1, batch)


def test_stack_depth_counts_leading_dimensions():
    assert stack_depth(2, LINEAR_SPEC) == 0
    assert stack_depth(4, LINEAR_SPEC) == 2  # e.g. (repeat, stage, in, out)
    assert stack_depth(4, parse_einsum("bse,enh->bsnh")) == 1
    with pytest.raises(jaxpar.JaxparError, match=r"kernel of rank 1 does not fit einsum "
                                                 r"'\.\.\.i,io->\.\.\.o'"):
        stack_depth(1, LINEAR_SPEC)
