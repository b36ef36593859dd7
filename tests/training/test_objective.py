"""The default objective: next-token cross-entropy against a numpy reference, and the checks
the Trainer runs for what that loss assumes of a model (token ids, a call with the tokens
alone, logits shaped per input position, causality, ids inside the vocabulary)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxpar.errors import JaxparError
from jaxpar.training.objective import (
    CAUSAL_TOLERANCE,
    CUSTOM_LOSS,
    check_causal,
    check_tokens,
    first_id_outside,
    id_outside_error,
    lm_loss,
    next_token_logits,
    takes_rngs,
)

VOCAB = 7


class TableLM(nnx.Module):
    """Logits of position i are one row of a table, picked by token i: causal by design."""

    def __init__(self, seed: int = 0):
        self.table = nnx.Param(jax.random.normal(jax.random.key(seed), (VOCAB, VOCAB)))

    def __call__(self, tokens):
        return self.table[...][tokens]


class RngsLM(TableLM):
    """Records the ``rngs`` it was called with."""

    seen: list = []

    def __call__(self, tokens, rngs=None):
        RngsLM.seen.append(rngs)
        return super().__call__(tokens)


class OwnLoss(TableLM):
    """A model with its own loss; ``None`` means "use the default"."""

    def __init__(self, own):
        super().__init__()
        self.own = own

    def next_token_loss(self, tokens):
        return self.own


class TwoInputs(nnx.Module):
    def __call__(self, tokens, mask):
        return tokens


class Returns(nnx.Module):
    """Returns whatever it was built with, whatever the input."""

    def __init__(self, make):
        self.make = make

    def __call__(self, tokens):
        return self.make(tokens)


class Fails(nnx.Module):
    def __call__(self, tokens):
        raise TypeError("wants a dict with 'pixels'\nsecond line")


def _reference_loss(table: np.ndarray, tokens: np.ndarray) -> float:
    logits = table[tokens[:, :-1]].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
    return float((log_z - picked).mean())


def test_lm_loss_is_mean_next_token_cross_entropy():
    model = TableLM()
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 6))
    want = _reference_loss(np.asarray(model.table[...]), tokens)
    assert float(lm_loss(model, jnp.asarray(tokens))) == pytest.approx(want, rel=1e-5)
    # Shifting the targets by one changes the loss: the comparison can fail.
    shifted = np.concatenate([tokens[:, :1], tokens[:, :-1]], axis=1)
    assert abs(_reference_loss(np.asarray(model.table[...]), shifted) - want) > 1e-3


def test_lm_loss_prefers_a_models_own_loss_unless_it_returns_none():
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 5)))
    assert lm_loss(OwnLoss(jnp.float32(42.0)), tokens) == 42.0
    fallback = OwnLoss(None)
    want = _reference_loss(np.asarray(fallback.table[...]), np.asarray(tokens))
    assert float(lm_loss(fallback, tokens)) == pytest.approx(want, rel=1e-5)


def test_rngs_are_passed_only_to_a_model_that_takes_them():
    tokens = jnp.zeros((1, 4), jnp.int32)
    rngs = nnx.Rngs(3)
    RngsLM.seen.clear()
    lm_loss(RngsLM(), tokens, rngs)
    lm_loss(RngsLM(), tokens)
    assert RngsLM.seen == [rngs, None]
    # A model without an rngs parameter is called with the tokens alone, rngs or not.
    assert lm_loss(TableLM(), tokens, rngs).shape == ()


def test_takes_rngs():
    assert takes_rngs(lambda x, rngs=None: x)
    assert takes_rngs(RngsLM().__call__)
    assert not takes_rngs(lambda x: x)
    assert not takes_rngs(TableLM().__call__)
    assert not takes_rngs(5)  # no signature at all: treated as no rngs


@pytest.mark.parametrize("batch, shown", [
    (np.zeros((2, 3), np.float32), "float32[2, 3]"),
    (np.zeros((6,), np.int32), "int32[6]"),
    (np.zeros((1, 2, 3), np.int32), "int32[1, 2, 3]"),
    ([[1, 2], [3, 4]], "list"),
    ({"tokens": np.zeros((2, 3), np.int32)}, "dict"),
])
def test_check_tokens_refuses_what_is_not_a_2d_integer_array(batch, shown):
    with pytest.raises(JaxparError, match="takes token ids shaped") as err:
        check_tokens(batch)
    assert f"got a batch of {shown};" in str(err.value)
    assert str(err.value).endswith(CUSTOM_LOSS)


def test_check_tokens_accepts_integer_ids():
    for dtype in (np.int32, np.uint8, np.int64):
        check_tokens(np.zeros((2, 3), dtype))
    check_tokens(jnp.zeros((2, 3), jnp.int32))


def test_next_token_logits_says_why_a_model_does_not_fit():
    inputs = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(JaxparError, match=r"TwoInputs.__call__ cannot be called that way "
                                          r"\(.*mask"):
        next_token_logits(TwoInputs(), inputs)
    with pytest.raises(JaxparError, match=r"called Fails\(tokens of shape \(2, 5\)\) and it "
                                          r"failed: wants a dict with 'pixels'; a model"):
        next_token_logits(Fails(), inputs)
    for make, got in ((lambda t: jnp.zeros((2, 6, 4)), "(2, 6, 4)"),  # shifted itself
                      (lambda t: jnp.zeros((2, 5)), "(2, 5)"),
                      (lambda t: (jnp.zeros((2, 5, 4)),), "tuple")):
        with pytest.raises(JaxparError) as err:
            next_token_logits(Returns(make), inputs)
        msg = str(err.value)
        assert "Returns(tokens of shape (2, 5))" in msg and f"got {got};" in msg, msg
    assert next_token_logits(Returns(lambda t: jnp.ones((2, 5, 3))), inputs).shape == (2, 5, 3)


def test_check_causal_reads_the_probe_against_the_tolerance():
    scale, t = 10.0, 2
    tol = CAUSAL_TOLERANCE * scale
    check_causal("M", np.array([0.0, 0.5 * tol, 1.0, 3.0]), scale, t)  # rounding only
    with pytest.raises(JaxparError, match="M's logits at positions before 2 change when "
                                          "input token 2 changes"):
        check_causal("M", np.array([0.0, 2 * tol, 1.0, 3.0]), scale, t)
    with pytest.raises(JaxparError, match="changing input token 2 leaves the logits at "
                                          "position 2 unchanged: the model shifts"):
        check_causal("M", np.array([0.0, 0.0, 0.5 * tol, 3.0]), scale, t)
    # Scale 0 (all logits zero): any change at all counts.
    check_causal("M", np.array([0.0, 1e-9]), 0.0, 1)


def _first_outside(tokens: np.ndarray, vocab: int) -> tuple[int, int]:
    flat = tokens.reshape(-1)
    bad = np.flatnonzero((flat < 0) | (flat >= vocab))
    return (int(bad[0]), int(flat[bad[0]])) if bad.size else (-1, 0)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_first_id_outside_matches_numpy(devices, axis_type):
    """On a batch sharded over 8 devices, on meshes of either kind."""
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((8,), ("data",), devices=devices, axis_types=(axis_type,))
    check = jax.jit(lambda x: first_id_outside(x, vocab=50))
    for trial in range(6):
        tokens = rng.integers(0, 50, (16, 9)).astype(np.int32)
        for _ in range(trial):  # 0 to 5 bad ids, anywhere, either side of the range
            tokens[rng.integers(16), rng.integers(9)] = rng.choice([-3, 50, 977])
        sharded = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec("data")))
        at, value = (int(x) for x in check(sharded))
        want_at, want_value = _first_outside(tokens, 50)
        assert at == want_at
        if at >= 0:
            assert value == want_value


def test_id_outside_error_names_the_id_and_where_it_is():
    err = id_outside_error(300, 3, 17, 256)
    assert isinstance(err, JaxparError)
    assert str(err).startswith("token id 300 at batch row 3, position 17 is outside the "
                               "model's vocabulary [0, 256)")
