"""Flax linen models under jaxpar (:func:`jaxpar.from_linen`), written the way linen users
write them (tests/user_models.py, no jaxpar calls inside) or taken from ``transformers``:
FSDP and FSDP x TP equal one device, eval is deterministic, LoRA on ``nn.Dense``,
``nn.DenseGeneral`` and ``nn.Einsum`` trains adapters only, checkpoints restore bit-exactly
and the weights export to ``transformers``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.adapters import lora
from jaxpar.analysis.hlo import count_collectives
from jaxpar.parallel.loss import cross_entropy
from jaxpar.sharding.paths import path_str
from tests import user_models as um
from tests.sharding.test_user_models import LAYOUTS, specs, tokens

# --- Flax linen models ----------------------------------------------------------------------


def _linen_gpt_trainer(layout: str | None, *, lora_target: str | None = None,
                       lr: float = 1e-2) -> jaxpar.Trainer:
    axes, rules = LAYOUTS[layout] if layout else ({"data": 1}, "dp")
    mesh = jaxpar.make_mesh(axes, devices=None if layout else jax.devices()[:1])
    plan = jaxpar.Plan.from_preset(mesh, rules, annotations=um.GPT_ANNOTATIONS)
    example = jnp.zeros((8, 16), jnp.int32)
    net = jaxpar.init_sharded(lambda: jaxpar.from_linen(um.LinenGPT(), example, rngs=0), plan)
    knobs = {}
    if lora_target:
        lora.apply(net, lora_target, rank=2, plan=plan)
        knobs["trainable"] = nnx.LoRAParam
    return jaxpar.Trainer(net, optax.adam(lr), plan, **knobs)


@functools.cache
def _linen_gpt_one_device() -> tuple[float, ...]:
    trainer = _linen_gpt_trainer(None)
    return tuple(trainer.step(tokens(i))["loss"] for i in range(3))


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])  # tensor: within fsdp_tp
def test_linen_decoder_equals_one_device(devices, layout):
    # Tied embeddings and dropout (on in the steps: the Trainer's train mode reaches the
    # linen call's deterministic argument), annotated by path from outside.
    trainer = _linen_gpt_trainer(layout)
    losses = [trainer.step(tokens(i))["loss"] for i in range(3)]
    np.testing.assert_allclose(losses, _linen_gpt_one_device(), rtol=1e-5)
    assert losses[-1] < losses[0]
    if layout == "fsdp":  # no layout lines: the numbered blocks and the table are pinned
        counts = count_collectives(trainer.lower(tokens()).compile().as_text())
        assert counts["all-to-all"] == 0 and counts["all-gather"] > 0, counts
    if layout == "fsdp_tp":
        spec = specs(trainer)["linen/h_0/c_fc/kernel"]
        assert spec == P("fsdp", "tensor"), spec


VIT_BATCHES = [{"images": np.random.default_rng(i).normal(size=(8, 8, 8, 3)).astype(np.float32),
                "labels": np.random.default_rng(i).integers(0, 10, 8).astype(np.int32)}
               for i in range(3)]


def _vit_losses(layout: str | None) -> tuple[list[float], jaxpar.Trainer]:
    axes, rules = LAYOUTS[layout] if layout else ({"data": 1}, "dp")
    mesh = jaxpar.make_mesh(axes, devices=None if layout else jax.devices()[:1])
    plan = jaxpar.Plan.from_preset(mesh, rules, annotations=um.VIT_ANNOTATIONS)
    net = jaxpar.init_sharded(
        lambda: jaxpar.from_linen(um.LinenViT(), jnp.zeros((8, 8, 8, 3)), rngs=0), plan)
    trainer = jaxpar.Trainer(net, optax.adam(1e-2), plan, loss_fn=um.image_loss)
    return [trainer.step(b)["loss"] for b in VIT_BATCHES], trainer


@functools.cache
def _vit_one_device() -> tuple[float, ...]:
    return tuple(_vit_losses(None)[0])


# The layouts themselves are the decoder's above (pure tensor parallelism among them); here
# the claim is a user's loss on a non-text batch, with fsdp's and fsdp_tp's checks.
@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_linen_vision_model_with_a_user_loss_equals_one_device(devices, layout):
    losses, trainer = _vit_losses(layout)
    np.testing.assert_allclose(losses, _vit_one_device(), rtol=1e-5)
    if layout == "fsdp":  # no layout lines: the numbered blocks are pinned
        counts = count_collectives(trainer.lower(VIT_BATCHES[0]).compile().as_text())
        assert counts["all-to-all"] == 0 and counts["all-gather"] > 0, counts
    if layout == "fsdp_tp":
        assert specs(trainer)["linen/mlp_0_in/kernel"] == P("fsdp", "tensor")


EINSUM_TARGET = r"(query|key|value|out|wi|wo)$"


def _linen_einsum_trainer(axes: dict, devices=None, *, target: str | None = EINSUM_TARGET
                          ) -> jaxpar.Trainer:
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes, devices=devices), "fsdp_tp",
                                   annotations=um.EINSUM_ANNOTATIONS)
    example = jnp.zeros((8, 16), jnp.int32)
    net = jaxpar.init_sharded(lambda: jaxpar.from_linen(um.LinenEinsumLM(), example, rngs=0),
                              plan)
    if target is None:
        return jaxpar.Trainer(net, optax.adam(1e-2), plan)
    lora.apply(net, target, rank=2, plan=plan)
    return jaxpar.Trainer(net, optax.adam(1e-2), plan, trainable=nnx.LoRAParam)


def test_linen_lora_on_dense_general_and_einsum_equals_one_device(devices):
    # Adapters on nn.DenseGeneral (kernels (embed, heads, head_dim) and (heads, head_dim,
    # embed)) and nn.Einsum: only they train, sharded as their kernels' own dimensions.
    runs, before = [], None
    for axes, devs in (({"data": 1}, jax.devices()[:1]), ({"fsdp": 4, "tensor": 2}, None)):
        trainer = _linen_einsum_trainer(axes, devs)
        before = {p: np.asarray(v.get_value())
                  for p, v in nnx.to_flat_state(nnx.state(trainer.model, nnx.Param))}
        runs.append([trainer.step(tokens(i))["loss"] for i in range(3)])
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)
    assert runs[1][-1] < runs[1][0]
    assert len(trainer.model.adapters) == 12
    after = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(
        nnx.state(trainer.model, nnx.Param))}
    changed = {path_str(p) for p, v in after.items() if not np.array_equal(before[p], v)}
    assert changed == {path_str(p) for p in after if p[0] == "adapters"}, changed
    got = specs(trainer)
    assert got["adapters/layers_0/query/lora_a"] == P("fsdp", None)
    assert got["adapters/layers_0/query/lora_b"] == P(None, "tensor", None)
    assert got["adapters/layers_1/out/lora_a"] == P("tensor", None, None)
    assert got["adapters/layers_1/out/lora_b"] == P(None, "fsdp")
    assert got["adapters/layers_1/wi/lora_b"] == P(None, "tensor")


@pytest.mark.parametrize("target,match", [
    (r"attn_norm$", r"hold parameters but are not nn.Dense.*layers_0/attn_norm \(RMSNorm\)"),
    (r"^embed$", r"not nn.Dense, nn.DenseGeneral or nn.Einsum: embed \(Embed\)"),
    (r"^layers_0", r"layers_0/mlp_norm \(RMSNorm\)"),  # the block itself is passed over
    (r"q_proj$", r"matches no nn.Dense.*available paths: \['layers_0/key'"),
])
def test_linen_lora_target_on_another_module_is_an_error(devices, target, match):
    net = jaxpar.from_linen(um.LinenEinsumLM(layers=1), jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(jaxpar.JaxparError, match=match):
        lora.apply(net, target, rank=2)
    assert not net.adapters  # nothing added
    lora.apply(net, r"wi$", rank=2)
    with pytest.raises(jaxpar.JaxparError, match=r"already adapted: \['layers_0/wi'\]"):
        lora.apply(net, r"wi$", rank=2)


def test_linen_llama_exports_to_transformers(devices, tmp_path):
    # Trained sharded (adapters on q/v included, trained with the base), exported, and
    # loaded by transformers' PyTorch Llama: its logits are the model's.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp",
                                   annotations=um.LINEN_LLAMA_ANNOTATIONS)
    module = um.LinenLlamaForCausalLM()
    net = jaxpar.init_sharded(
        lambda: jaxpar.from_linen(module, jnp.zeros((8, 16), jnp.int32), rngs=0), plan)
    lora.apply(net, r"self_attn/[qv]_proj$", rank=2, plan=plan)
    trainer = jaxpar.Trainer(net, optax.adam(1e-2), plan)
    losses = [trainer.step(tokens(i))["loss"] for i in range(2)]
    assert losses[1] < losses[0]
    model = trainer.model
    model.eval()
    x = jnp.asarray(tokens(9)[:, :-1])
    with plan.activate():
        want = np.asarray(model(x))
    params = model.linen_params()  # the linen tree, adapters folded in
    assert params["model"]["layers"]["1"]["self_attn"]["q_proj"]["kernel"].shape == (32, 32)
    np.testing.assert_allclose(module.apply({"params": params}, x), want, atol=1e-5)
    model.save_hf(tmp_path / "hf", um.linen_llama_config(module))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    with torch.no_grad():
        got = hf(torch.from_numpy(np.asarray(x, np.int64))).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)
    lora.merge(model, plan=plan)  # folded into the kernels in place: the same function
    assert not model.adapters
    with plan.activate():
        np.testing.assert_allclose(np.asarray(model(x)), want, atol=1e-5)


HF_FLAX = {  # family: (transformers Flax class, config class, sizes, annotations)
    "gpt2": ("FlaxGPT2LMHeadModel", "GPT2Config",
             {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32},
             [(r"wte/embedding$", ("vocab", "embed")), (r"wpe/embedding$", (None, "embed"))]),
    "llama": ("FlaxLlamaForCausalLM", "LlamaConfig",
              {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2,
               "tie_word_embeddings": False}, um.LINEN_LLAMA_ANNOTATIONS),
}


@pytest.mark.parametrize("family", list(HF_FLAX))
def test_transformers_flax_model_trains_and_exports(devices, tmp_path, family):
    # A transformers Flax model's .module (transformers < 5: version 5 dropped Flax),
    # trained sharded, written by transformers' own save_pretrained(params=...) and read
    # back by its Flax class, and written by save_hf and read by its PyTorch class: both
    # give the model's logits.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cls_name, config_name, sizes, annotations = HF_FLAX[family]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models")
    config = getattr(transformers, config_name)(vocab_size=um.VOCAB, **sizes)
    hf_flax = getattr(transformers, cls_name)(config, seed=0)

    def inputs(ids):
        return ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)

    def loss(model, batch):
        return cross_entropy(model(*inputs(batch[:, :-1])).logits, batch[:, 1:])

    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp",
                                   annotations=annotations)
    example = inputs(jnp.zeros((8, 16), jnp.int32))
    net = jaxpar.init_sharded(lambda: jaxpar.from_linen(hf_flax.module, *example, rngs=0),
                              plan)
    initial = net.linen_params()
    trainer = jaxpar.Trainer(net, optax.adam(1e-2), plan, loss_fn=loss)
    assert all(np.isfinite(trainer.step(tokens(i))["loss"]) for i in range(2))
    model = trainer.model
    model.eval()
    x = jnp.asarray(tokens(9)[:, :-1])
    with plan.activate():
        want = np.asarray(model(*inputs(x)).logits)
    trained = model.linen_params()
    assert jax.tree.structure(trained) == jax.tree.structure(initial)
    assert not any(jax.tree.leaves(jax.tree.map(np.array_equal, trained, initial)))
    hf_flax.save_pretrained(tmp_path / "flax", params=model.linen_params())
    model.save_hf(tmp_path / "pt", config)
    flax_back = getattr(transformers, cls_name).from_pretrained(tmp_path / "flax")
    np.testing.assert_allclose(flax_back(np.asarray(x)).logits, want, atol=1e-4)
    pt = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pt").float().eval()
    with torch.no_grad():
        got = pt(torch.from_numpy(np.asarray(x, np.int64))).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)

def test_linen_lora_trains_adapters_only_eval_is_deterministic_and_checkpoints_exactly(
        devices, tmp_path):
    """LinenGPT on fsdp x tensor, adapters on nn.Dense (c_fc, c_proj) and nn.DenseGeneral
    (attention query and value), dropout on: three steps train the adapters only; a
    checkpoint after two restores bit-exactly (the dropout stream's counter included) and
    the third step's loss repeats; eval is deterministic, train mode is not."""
    from jaxpar.checkpoint.checkpointer import Checkpointer, flat_paths

    target = r"(attn/(query|value)|c_(fc|proj))$"
    trainer = _linen_gpt_trainer("fsdp_tp", lora_target=target)
    before = {p: np.asarray(v.get_value())
              for p, v in nnx.to_flat_state(nnx.state(trainer.model, nnx.Param))}
    losses = [trainer.step(tokens(i))["loss"] for i in range(2)]

    def host(x: jax.Array) -> np.ndarray:
        return np.asarray(jax.random.key_data(x) if jnp.issubdtype(
            x.dtype, jax.dtypes.prng_key) else x)

    saved = {k: host(v) for k, v in flat_paths(trainer.state).items()}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(trainer, force=True)
    expected = trainer.step(tokens(2))["loss"]
    losses.append(expected)
    assert losses[-1] < losses[0]
    count = "frozen/rng_counts/dropout"
    assert flat_paths(trainer.state)[count] == saved[count] + 1  # new masks each step
    after = nnx.to_flat_state(nnx.state(trainer.model, nnx.Param))
    changed = {path_str(p) for p, v in after if not np.array_equal(before[p], v.get_value())}
    assert changed and all("adapters/" in p and p.endswith("lora_b") or "lora_a" in p
                           for p in changed), changed
    assert any("h_1/c_proj" in p for p in changed)
    assert any("attn/query" in p for p in changed)

    fresh = _linen_gpt_trainer("fsdp_tp", lora_target=target)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.restore(fresh)["step"] == 2
    got = flat_paths(fresh.state)
    assert set(got) == set(saved) and any("adapters" in k for k in got)
    for key, value in got.items():
        assert np.array_equal(host(value), saved[key]), key
    assert fresh.step(tokens(2))["loss"] == expected

    model = trainer.model
    model.eval()
    batch = tokens(7)
    # the model's own forward and loss, jitted as one program (not dispatched op by op)
    loss = nnx.jit(lambda m, x, y: cross_entropy(m(x), y))
    with trainer.plan.activate():
        want = float(loss(model, jnp.asarray(batch[:, :-1]), batch[:, 1:]))
    np.testing.assert_allclose(trainer.eval_loss(batch), want, rtol=1e-5)
    model.train()
    with trainer.plan.activate():
        noisy = float(loss(model, jnp.asarray(batch[:, :-1]), batch[:, 1:]))
    assert noisy != want  # dropout is on in train mode


def test_pretrained_linen_params_load_into_a_sharded_model(devices):
    """Weights from elsewhere (here: a plain ``LinenGPT().init``, as a pretrained Flax
    model's ``.params`` would be) load into the sharded wrapper: its forward equals linen's
    own ``apply`` on them, and a tree that does not fit is refused, naming the paths."""
    module = um.LinenGPT()
    example = jnp.asarray(tokens()[:, :-1])
    pretrained = module.init(jax.random.key(7), example)["params"]
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2})
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", annotations=um.GPT_ANNOTATIONS)
    net = jaxpar.init_sharded(lambda: jaxpar.from_linen(module, example, rngs=0), plan)
    net.load_linen_params({"params": pretrained})
    flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(net.linen))}
    assert flat["h_0/c_fc/kernel"].get_value().sharding.spec == P("fsdp", "tensor")
    net.eval()
    with plan.activate(mesh_context=True):
        ours = np.asarray(jax.jit(lambda m, x: m(x))(net, example))
    np.testing.assert_allclose(ours, np.asarray(module.apply({"params": pretrained}, example)),
                               rtol=1e-5, atol=1e-5)
    broken = {k: v for k, v in pretrained.items() if k != "wpe"}
    broken["extra"] = np.zeros(3)
    with pytest.raises(jaxpar.JaxparError, match=r"do not fit the model: missing: wpe; not in "
                                                 r"the model: extra"):
        net.load_linen_params(broken)

