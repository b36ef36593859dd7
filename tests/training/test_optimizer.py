"""The optimizer of a run: its learning-rate schedule against the closed form, each
``train.optimizer`` against the optax chain it stands for, which parameters weight decay
touches, and global-norm clipping."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.training.optimizer import OPTIMIZERS, learning_rate, make_optimizer


@dataclasses.dataclass
class Settings:
    """The ``train.*`` fields the optimizer reads."""

    optimizer: str = "adamw"
    lr: float = 0.1
    warmup_steps: int = 1
    steps: int = 1000
    weight_decay: float = 0.1
    grad_clip: float = 1.0


def _closed_form(step: int, lr: float, warmup: int, steps: int) -> float:
    """Linear warmup from 0 to ``lr``, then half a cosine down to ``lr / 10`` at ``steps``."""
    end = lr / 10
    if step < warmup:
        return lr * step / warmup
    t = min(step, steps) - warmup
    return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * t / (steps - warmup)))


@pytest.mark.parametrize("lr, warmup, steps", [(0.2, 4, 20), (3e-4, 10, 11), (1.0, 1, 7)])
def test_learning_rate_is_warmup_then_cosine_to_a_tenth(lr, warmup, steps):
    schedule = learning_rate(Settings(lr=lr, warmup_steps=warmup, steps=steps))
    for step in range(steps + 5):
        assert float(schedule(step)) == pytest.approx(
            _closed_form(step, lr, warmup, steps), rel=1e-5, abs=1e-9), step
    assert float(schedule(warmup)) == pytest.approx(lr)
    assert float(schedule(steps)) == pytest.approx(lr / 10)


def test_learning_rate_edge_cases():
    # No warmup still starts at 0 and peaks at step 1.
    zero = learning_rate(Settings(lr=0.5, warmup_steps=0, steps=10))
    assert float(zero(0)) == 0.0 and float(zero(1)) == pytest.approx(0.5)
    # Warmup as long as the run: the decay gets one step, after the warmup ends.
    short = learning_rate(Settings(lr=0.5, warmup_steps=5, steps=3))
    assert float(short(5)) == pytest.approx(0.5)
    assert float(short(6)) == pytest.approx(0.05) == float(short(100))


class Tiny(nnx.Module):
    """Parameters of every kind the decay mask tells apart."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(5, 4, rngs=rngs)                 # matrix: decays
        self.dense = nnx.Linear(4, 3, rngs=rngs)                # kernel decays, bias not
        self.attn_norm = nnx.RMSNorm(3, rngs=rngs)              # norm scale: no
        self.stacked_norm = nnx.Param(jnp.full((2, 3), 2.0))    # 2-D, but a norm's: no
        self.experts = nnx.Param(jnp.ones((2, 3, 4)))           # 3-D weight: decays
        self.gate = nnx.Param(jnp.ones((3,)))                   # a vector: no


DECAYED = {"embed/embedding", "dense/kernel", "experts"}


def _flat(tree) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        out["/".join(str(n) for n in names if n != "value")] = np.asarray(leaf)
    return out


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_weight_decay_only_touches_matrices(name):
    """With zero gradients the step is the decay alone: ``-lr * wd * p`` on matrices, and
    nothing on biases, norm scales (stacked or not) and vectors."""
    params = nnx.state(Tiny(), nnx.Param)
    opt = make_optimizer(Settings(optimizer=name, lr=0.1, weight_decay=0.5))
    state = opt.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    update = jax.jit(opt.update)
    first, state = update(zeros, state, params)
    assert all(not v.any() for v in _flat(first).values())  # learning rate 0 at step 0
    second, _ = update(zeros, state, params)
    got, p = _flat(second), _flat(params)
    assert set(got) == DECAYED | {"dense/bias", "attn_norm/scale", "stacked_norm", "gate"}
    for key, update in got.items():
        want = -0.1 * 0.5 * p[key] if key in DECAYED else np.zeros_like(p[key])
        np.testing.assert_allclose(update, want, rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("clip, factor", [(1.0, 0.1), (0.0, 1.0), (100.0, 1.0)])
def test_gradients_are_clipped_by_global_norm(clip, factor):
    """SGD with momentum 0.9 on a constant gradient of global norm 10: the second step is
    ``-lr * 1.9 * g``, with ``g`` scaled to norm ``clip`` when that is smaller."""
    grads = {"a": jnp.array([6.0, 0.0]), "b": jnp.array([[0.0], [8.0]])}
    params = jax.tree.map(jnp.zeros_like, grads)
    opt = make_optimizer(Settings(optimizer="sgd", lr=0.5, grad_clip=clip))
    state = opt.init(params)
    _, state = opt.update(grads, state, params)
    updates, _ = opt.update(grads, state, params)
    for key in grads:
        np.testing.assert_allclose(updates[key], -0.5 * 1.9 * factor * grads[key], rtol=1e-6)


def _reference(name: str, s: Settings) -> optax.GradientTransformation:
    """The optax chain ``name`` stands for, with the schedule and mask written out here."""
    def schedule(step):
        end = s.lr / 10
        warm = s.lr * step / s.warmup_steps
        t = jnp.clip(step - s.warmup_steps, 0, s.steps - s.warmup_steps)
        cos = end + (s.lr - end) * 0.5 * (1 + jnp.cos(jnp.pi * t / (s.steps - s.warmup_steps)))
        return jnp.where(step < s.warmup_steps, warm, cos)

    mask = {"embed": True, "dense": {"kernel": True, "bias": False},
            "final_norm": {"scale": False}}
    inner = {
        "adamw": optax.adamw(schedule, weight_decay=s.weight_decay, mask=mask),
        "adam": optax.adam(schedule),
        "sgd": optax.sgd(schedule, momentum=0.9),
        "lion": optax.lion(schedule, weight_decay=s.weight_decay, mask=mask),
        "adafactor": optax.adafactor(schedule),
    }[name]
    return optax.chain(optax.clip_by_global_norm(s.grad_clip), inner)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_matches_its_optax_chain(name):
    s = Settings(optimizer=name, lr=0.05, warmup_steps=2, steps=6, weight_decay=0.3,
                 grad_clip=2.0)
    keys = iter(jax.random.split(jax.random.key(0), 40))
    shapes = {"embed": (5, 4), "dense": {"kernel": (4, 3), "bias": (3,)},
              "final_norm": {"scale": (3,)}}
    params = jax.tree.map(lambda shape: jax.random.normal(next(keys), shape), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
    got_opt, want_opt = make_optimizer(s), _reference(name, s)
    got_state, want_state = got_opt.init(params), want_opt.init(params)
    got_params, want_params = params, params
    got_update, want_update = jax.jit(got_opt.update), jax.jit(want_opt.update)
    for _ in range(5):
        grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
        got, got_state = got_update(grads, got_state, got_params)
        want, want_state = want_update(grads, want_state, want_params)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
        got_params = optax.apply_updates(got_params, got)
        want_params = optax.apply_updates(want_params, want)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), got_params, params)
    assert max(jax.tree.leaves(moved)) > 0  # the steps did something


def test_unknown_optimizer_is_named_with_the_choices():
    with pytest.raises(JaxparError, match=r"unknown train.optimizer 'adamz'; choose from "
                                          r"\['adamw', 'adam', 'sgd', 'lion', 'adafactor'\]"):
        make_optimizer(Settings(optimizer="adamz"))
