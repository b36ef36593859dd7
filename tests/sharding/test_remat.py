"""Remat policies by name: which of a block's intermediates each keeps for the backward
pass (read from JAX's own list of saved residuals), and that none changes the result."""

from __future__ import annotations

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import jaxpar
from jaxpar.sharding.remat import POLICIES, block_wrapper, check


class Block(nnx.Module):
    """An unbatched matmul (w1, w2), a batched one (scores) and the two names the reference
    model tags, each feeding a nonlinearity so that the backward pass needs it."""

    def __init__(self, rngs: nnx.Rngs):
        self.w1 = nnx.Linear(4, 8, use_bias=False, rngs=rngs)
        self.w2 = nnx.Linear(8, 4, use_bias=False, rngs=rngs)

    def __call__(self, x, scale):
        h = checkpoint_name(jnp.sin(self.w1(x)), "mlp_hidden")
        scores = jnp.einsum("bsf,btf->bst", h, h)
        out = checkpoint_name(self.w2(h) * jnp.tanh(scores).sum(-1, keepdims=True), "mlp_out")
        return x + jnp.tanh(out) * scale


X = np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32)


@functools.cache
def block() -> Block:
    return Block(nnx.Rngs(0))


def plain(block, x, *args):
    return block(x, *args)


def loss(run):
    model = block()  # built outside the traced function
    return lambda x: jnp.sum(run(model, x, 0.5) ** 2)


def residuals(run) -> list[str]:
    """What JAX keeps from the forward pass of ``loss(run)`` for its backward pass."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss(run), X)
    return out.getvalue().splitlines()


def saved(lines: list[str], what: str) -> int:
    return sum(what in line for line in lines)


def test_check_accepts_known_names_and_lists_them_otherwise():
    assert check("full") == "full"
    with pytest.raises(jaxpar.JaxparError) as err:
        check("sometimes")
    assert str(err.value).startswith(f"unknown remat policy 'sometimes': choose one of "
                                     f"{sorted(POLICIES)}, or offload:<names>")
    with pytest.raises(jaxpar.JaxparError, match="unknown remat policy 'Full'"):
        block_wrapper("Full")


def test_none_means_no_wrapper():
    assert block_wrapper("none") is None
    # Without remat the block's own intermediates are kept: sin's derivative, for one.
    assert saved(residuals(plain), "output of cos") == 1


def test_full_keeps_only_the_block_input():
    lines = residuals(block_wrapper("full"))
    assert saved(lines, "from the argument x") == 1
    assert saved(lines, "output of dot_general") == 0
    assert saved(lines, "output of cos") == 0 and saved(lines, "named") == 0


def test_dot_policies_keep_matmul_outputs():
    every = residuals(block_wrapper("dots_saveable"))
    unbatched = residuals(block_wrapper("dots_with_no_batch_dims_saveable"))
    # w1 (2, 3, 8) and w2 (2, 3, 4) have no batch dimension; scores (2, 3, 3) has one.
    for lines in (every, unbatched):
        assert saved(lines, "f32[2,3,8] output of dot_general") == 1
        assert saved(lines, "f32[2,3,4] output of dot_general") == 1
    assert saved(every, "f32[2,3,3] output of dot_general") == 1
    assert saved(unbatched, "f32[2,3,3] output of dot_general") == 0


def test_save_attention_and_mlp_outputs_keeps_those_names_only():
    lines = residuals(block_wrapper("save_attention_and_mlp_outputs"))
    assert saved(lines, "named 'mlp_out'") == 1
    assert saved(lines, "named 'mlp_hidden'") == 0
    assert saved(lines, "output of dot_general") == 0


@pytest.mark.parametrize("name", [n for n in POLICIES if n not in ("none", "offload_dots")])
def test_every_policy_gives_the_same_value_and_gradient(name):
    run = block_wrapper(name)
    want, want_grad = jax.value_and_grad(loss(plain))(X)
    got, got_grad = jax.jit(jax.value_and_grad(loss(run)))(X)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    # Gradients reach the block's weights through the wrapper too.
    graphdef, state = nnx.split(block())

    def by_weights(run):
        return lambda s: jnp.sum(run(nnx.merge(graphdef, s), X, 0.5) ** 2)

    want_w = jax.grad(by_weights(plain))(state)
    got_w = jax.grad(by_weights(run))(state)
    for a, b in zip(jax.tree.leaves(got_w), jax.tree.leaves(want_w), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend has no host offload")
def test_offload_dots_keeps_the_same_residuals_in_host_memory():
    """The CPU backend has a host memory space, so offloading compiles here: the dots that
    dots_with_no_batch_dims_saveable keeps on the device, offload_dots keeps on the host."""
    kept = residuals(block_wrapper("dots_with_no_batch_dims_saveable"))
    on_device = [line.split()[0] for line in kept if "output of dot_general" in line]
    moved = residuals(block_wrapper("offload_dots"))
    on_host = [line.split()[0].replace("<host>", "") for line in moved if "<host>" in line]
    assert on_device and sorted(on_host) == sorted(on_device)
    assert saved(moved, "output of dot_general") == 0
