"""Models jaxpar did not write (tests/user_models.py: plain Flax, no jaxpar calls inside),
sharded, trained, LoRA-adapted and inspected through the public API and the CLI.

Every sharded run is held to the same model on one device: DP, FSDP, TP and FSDP x TP
losses over 5 steps within 1e-5 relative (dropout on for the attention model, with the
same seeds), and the FSDP step's compiled HLO must hold no all-to-all.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.adapters import lora
from jaxpar.analysis.hlo import count_collectives, memory_stats
from jaxpar.parallel.loss import cross_entropy
from jaxpar.sharding.layouts import pinned
from jaxpar.sharding.partitioning import ReplicationWarning
from jaxpar.sharding.paths import path_str
from tests import user_models as um

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
LAYOUTS = {  # name: (mesh axes, rules preset); plain data parallelism is fsdp's batch split
    # without the weight split, covered by every data-parallel test of the suite
    "fsdp": ({"fsdp": 8}, "fsdp"),
    "tp": ({"tensor": 8}, "tp"),
    "fsdp_tp": ({"fsdp": 4, "tensor": 2}, "fsdp_tp"),
}
BSE = ("batch", "seq", "embed")
MODELS = {
    # name: (factory, plan knobs, explicit mesh)
    "mha": (lambda: um.MhaLM(rngs=nnx.Rngs(0, dropout=1)),
            {"layouts": [(um.MhaBlock, BSE), (r"embed/embedding$", ("vocab", "embed"))]},
            False),
    "llama": (lambda: um.LlamaLike(rngs=nnx.Rngs(0)),
              {"annotations": um.LLAMA_ANNOTATIONS,
               "layouts": [(um.LlamaDecoderLayer, BSE),
                           (r"embed_tokens/embedding$", ("vocab", "embed"))]},
              False),
    "explicit": (lambda: um.ExplicitLM(rngs=nnx.Rngs(0)), {}, True),
}


def tokens(seed: int = 0, rows: int = 8, seq: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, um.VOCAB, (rows, seq + 1)).astype(np.int32)


def make_trainer(model: str, layout: str | None, *, lr: float = 1e-2, **knobs
                 ) -> jaxpar.Trainer:
    factory, plan_knobs, explicit = MODELS[model]
    axes, rules = LAYOUTS[layout] if layout else ({"data": 1}, "dp")
    devices = None if layout else jax.devices()[:1]
    mesh = jaxpar.make_mesh(axes, devices=devices, explicit=explicit)
    plan = jaxpar.Plan.from_preset(mesh, rules, **{**plan_knobs, **knobs})
    return jaxpar.Trainer(jaxpar.init_sharded(factory, plan), optax.adam(lr), plan)


def train_losses(trainer: jaxpar.Trainer) -> list[float]:
    return [trainer.step(tokens(i))["loss"] for i in range(STEPS)]


@functools.cache
def single_device_losses(model: str) -> tuple[float, ...]:
    return tuple(train_losses(make_trainer(model, None)))


def specs(trainer: jaxpar.Trainer) -> dict[str, P]:
    return {path_str(p): v.get_value().sharding.spec
            for p, v in nnx.to_flat_state(trainer.state["params"])}


# --- every layout equals one device ------------------------------------------------------

EXPECTED_SPECS = {  # (model, layout): {path: spec}, as the rules say (blocks scanned: a
    # leading "layers" dimension, never split)
    ("mha", "fsdp_tp"): {"blocks/attn/query/kernel": P(None, "fsdp", "tensor", None),
                         "blocks/attn/out/kernel": P(None, "tensor", None, None),
                         "blocks/up/kernel": P(None, "fsdp", "tensor"),
                         "embed/embedding": P("tensor", "fsdp")},
    ("mha", "fsdp"): {"blocks/attn/key/kernel": P(None, "fsdp", None, None)},
    ("llama", "tp"): {"layers/self_attn/q_proj/kernel": P(None, None, "tensor", None),
                      # 2 KV heads on 8-way tensor parallelism: replicated, as Megatron does.
                      "layers/self_attn/k_proj/kernel": P(None, None, None, None),
                      "layers/mlp/down_proj/kernel": P(None, "tensor", None)},
    ("llama", "fsdp_tp"): {"layers/self_attn/v_proj/kernel": P(None, "fsdp", "tensor", None),
                           "lm_head/kernel": P("fsdp", "tensor")},
    ("explicit", "fsdp_tp"): {"w_in": P("fsdp", "tensor"), "w_out": P("tensor", "fsdp")},
    ("explicit", "fsdp"): {"w_in": P("fsdp", None), "head": P("fsdp", None)},
}


@pytest.mark.parametrize("model,layout", [  # TP on the attention model: its fsdp_tp run
    (m, lay) for m in MODELS for lay in LAYOUTS if (m, lay) != ("mha", "tp")])
def test_sharded_training_equals_one_device(devices, model, layout):
    trainer = make_trainer(model, layout)
    losses = train_losses(trainer)
    np.testing.assert_allclose(losses, single_device_losses(model), rtol=1e-5)
    assert losses[-1] < losses[0]
    got = specs(trainer)
    for path, spec in EXPECTED_SPECS.get((model, layout), {}).items():
        assert got[path] == spec, (path, got[path])
    if layout == "fsdp":
        hlo = trainer.lower(tokens()).compile().as_text()
        counts = count_collectives(hlo)
        assert counts["all-to-all"] == 0, counts
        assert counts["all-gather"] > 0  # weights are gathered just in time


def test_dropout_draws_new_masks_each_step(devices):
    # The diagnostic from the issue: lr=0 on one batch must not give one loss three times.
    trainer = make_trainer("mha", "fsdp_tp", lr=0.0)
    batch = tokens(0)
    losses = [trainer.step(batch)["loss"] for _ in range(3)]
    assert len(set(losses)) == 3, losses
    # Evaluation turns dropout off: the same loss every time, below none of the above.
    assert trainer.eval_loss(batch) == trainer.eval_loss(batch)
    counts = [v.get_value() for p, v in nnx.to_flat_state(trainer.state["frozen"])
              if isinstance(v, nnx.RngCount)]
    assert counts and all((np.asarray(c) >= 3).all() for c in counts)  # per layer


def test_no_array_the_caller_holds_is_donated(devices):
    # The model given to a Trainer, a snapshot taken from it, and a Trainer superseded by
    # one built from that snapshot all stay usable (the model holds dropout RNG keys,
    # whose donation once crashed the process).
    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    plan = jaxpar.Plan.from_preset(mesh, "dp")
    model = jaxpar.init_sharded(MODELS["mha"][0], plan)
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    first = jaxpar.Trainer(model, optax.adam(1e-2), plan)
    first.step(tokens(0))
    model.eval()
    assert np.isfinite(np.asarray(model(tokens(0)[:, :-1]))).all()
    for (_, old), (_, now) in zip(nnx.to_flat_state(before),
                                  nnx.to_flat_state(nnx.state(model, nnx.Param)), strict=True):
        np.testing.assert_array_equal(old.get_value(), np.asarray(now.get_value()))
    snapshot = first.model
    second = jaxpar.Trainer(snapshot, optax.adam(1e-2), plan)
    second.step(tokens(1))
    losses = [first.step(tokens(1))["loss"], first.eval_loss(tokens(2))]
    assert np.isfinite(losses).all()
    snapshot.eval()
    assert np.isfinite(np.asarray(snapshot(tokens(0)[:, :-1]))).all()


def test_a_model_holding_rng_streams_checkpoints_and_resumes_exactly(devices, tmp_path):
    """``nnx.Rngs`` inside the model (dropout) hold typed PRNG keys: saved and restored."""
    from jaxpar.checkpoint.checkpointer import Checkpointer

    first = make_trainer("mha", "fsdp")
    first.step(tokens(0))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(first, force=True)
        second = make_trainer("mha", "fsdp")
        ckpt.restore(second)
    assert second.step_count == 1
    assert first.step(tokens(1))["loss"] == second.step(tokens(1))["loss"]


# --- activation layouts: no all-to-all, temporaries as with hand-placed constraints ------


class HandConstrainedLlama(um.LlamaLike):
    """The same model with jaxpar.constrain calls placed by hand (the reference)."""

    def __call__(self, tokens):
        table = jaxpar.constrain(self.embed_tokens.embedding[...], ("vocab", "embed"))
        x = jaxpar.constrain(table[tokens], BSE)
        for layer in self.layers:
            x = jaxpar.constrain(layer(x), BSE)
        return self.lm_head(self.norm(x))


def _fsdp_step(factory, **knobs) -> tuple[dict, int]:
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 8}), "fsdp",
                                   annotations=um.LLAMA_ANNOTATIONS, **knobs)
    trainer = jaxpar.Trainer(jaxpar.init_sharded(factory, plan), optax.adam(1e-2), plan)
    compiled = trainer.lower(tokens()).compile()
    return count_collectives(compiled.as_text()), memory_stats(compiled)["temp_bytes"]


def test_layouts_remove_all_to_alls_and_match_hand_constraints(devices):
    llama = lambda: um.LlamaLike(rngs=nnx.Rngs(0))
    plain, plain_temp = _fsdp_step(llama, layouts=())  # opted out of the default
    pinned, pinned_temp = _fsdp_step(llama, layouts=MODELS["llama"][1]["layouts"])
    auto, auto_temp = _fsdp_step(llama)  # the default: repeated blocks, embedding table
    hand, hand_temp = _fsdp_step(lambda: HandConstrainedLlama(rngs=nnx.Rngs(0)), layouts=())
    assert plain["all-to-all"] > 0  # what GSPMD does with no guidance
    assert pinned["all-to-all"] == 0 and auto["all-to-all"] == 0 and hand["all-to-all"] == 0
    for temp in (pinned_temp, auto_temp):
        assert temp <= 1.1 * hand_temp, (temp, hand_temp)
        assert temp < plain_temp


@pytest.mark.parametrize("model", ["mha"])  # "llama": see the test above
def test_repeated_blocks_are_pinned_by_default(devices, model):
    # No layout lines: the blocks of the nnx.List and the embedding table are pinned, and
    # the FSDP step holds no all-to-all; layouts=() (opting out) brings them back.
    factory, knobs, _ = MODELS[model]
    knobs = {k: v for k, v in knobs.items() if k != "layouts"}
    counts = {}
    for layouts in ("auto", ()):
        plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 8}), "fsdp", layouts=layouts,
                                       **knobs)
        trainer = jaxpar.Trainer(jaxpar.init_sharded(factory, plan), optax.adam(1e-2), plan)
        counts[layouts] = count_collectives(trainer.lower(tokens()).compile().as_text())
        if layouts == "auto":
            pins = {path: names for path, names, _ in pinned(trainer.model)}
            blocks = "blocks" if model == "mha" else "layers"
            assert pins[blocks] == ("<block output>",), pins  # each scanned layer's output
    assert counts["auto"]["all-to-all"] == 0, counts
    assert counts[()]["all-to-all"] > 0, counts


# --- annotations and the replication warning ----------------------------------------------


def test_unannotated_model_warns_once_and_annotations_fix_it(devices):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 8}), "fsdp")
    with pytest.warns(ReplicationWarning, match=r"jaxpar.annotate") as caught:
        model = jaxpar.init_sharded(lambda: um.LlamaLike(rngs=nnx.Rngs(0)), plan)
    assert "mlp/up_proj/kernel (2, 64, 128)" in str(caught[0].message)  # 2 layers scanned
    report = jaxpar.replication_report(plan, nnx.state(model))
    assert report["replicated_share"] > 0.99
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicationWarning)
        jaxpar.annotate(model, um.LLAMA_ANNOTATIONS)
        assert jaxpar.replication_report(plan, nnx.state(model))["replicated_share"] < 0.05
        # The reference model never warns.
        jaxpar.init_sharded(lambda: jaxpar.models.Transformer(
            jaxpar.models.TransformerConfig(), rngs=nnx.Rngs(0)), plan)


# --- LoRA on a foreign model ---------------------------------------------------------------


@pytest.mark.parametrize("model,target,count", [
    # one adapter a projection of the scanned stack, stacked over its layers
    ("mha", r"attn/(query|key|value|out)$|/(up|down)$", 6),
    ("llama", r"(q|k|v|o|gate|up|down)_proj$", 7),
])
def test_lora_on_attention_and_mlp_trains_adapters_only(devices, model, target, count):
    factory, knobs, _ = MODELS[model]
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp",
                                   **knobs)
    net = jaxpar.init_sharded(factory, plan)
    with plan.activate():
        lora.apply(net, target, rank=2, plan=plan)
    assert len(lora.adapted(net)) == count
    before = jax.tree.map(np.asarray, nnx.state(net, nnx.Param))
    trainer = jaxpar.Trainer(net, optax.adam(1e-2), plan, trainable=nnx.LoRAParam)
    losses = [trainer.step(tokens(i))["loss"] for i in range(3)]
    assert losses[-1] < losses[0]
    after = nnx.state(trainer.model, nnx.Param)
    for (path, old), (_, new) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after),
                                     strict=True):
        changed = not np.array_equal(old.get_value(), np.asarray(new.get_value()))
        assert changed == isinstance(new, nnx.LoRAParam) or "lora_a" in str(path), path


def test_lora_on_an_explicit_sharding_model_equals_one_device(devices):
    # LoRA's two einsums follow the out_sharding the model passes to the base projection.
    runs = []
    for axes, devs in (({"data": 1}, jax.devices()[:1]), ({"fsdp": 4, "tensor": 2}, None)):
        plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes, devices=devs, explicit=True),
                                       "fsdp_tp")
        net = jaxpar.init_sharded(lambda: um.ExplicitLinearLM(rngs=nnx.Rngs(0)), plan)
        lora.apply(net, r"^(up|down)$", rank=2, plan=plan)
        trainer = jaxpar.Trainer(net, optax.adam(1e-2), plan, trainable=nnx.LoRAParam)
        runs.append([trainer.step(tokens(i))["loss"] for i in range(3)])
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)
    assert runs[1][-1] < runs[1][0]
    a = trainer.state["params"]["up"]["lora_a"].get_value()
    assert a.sharding.spec == P("fsdp", None)  # the kernel's input split, rank whole


class OwnAxisNameLM(um.ExplicitLinearLM):
    """Shards with its own mesh-axis name ("tp") inside the forward pass."""

    def __call__(self, tokens):
        x = jax.sharding.reshard(self.embed[...], P(None, None)).at[tokens].get(
            out_sharding=P(("data", "fsdp"), None, None))
        h = self.up(x, out_sharding=P(("data", "fsdp"), None, "tp"))
        return jnp.einsum("bsf,fv->bsv", h, jnp.ones((h.shape[-1], um.VOCAB)))


@pytest.mark.parametrize("model,explicit,match", [
    (OwnAxisNameLM, True, r"mesh axis 'tp' inside its own code .* write 'tensor' there"),
    (um.ExplicitLinearLM, False, r"written for explicit sharding .* but the mesh is Auto: "
                                 r"build it with jaxpar.make_mesh\(..., explicit=True\)"),
])
def test_sharding_written_for_another_mesh_is_explained(devices, model, explicit, match):
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2}, explicit=explicit)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    trainer = jaxpar.Trainer(jaxpar.init_sharded(lambda: model(rngs=nnx.Rngs(0)), plan),
                             optax.adam(1e-2), plan)
    with pytest.raises(jaxpar.JaxparError, match=match):
        trainer.step(tokens())


# --- batches, losses and the default loss's checks ----------------------------------------


def test_pytree_batch_with_user_loss_equals_one_device(devices):
    def batch(i):
        t = tokens(i)
        mask = np.ones(t[:, 1:].shape, np.float32)
        mask[:, :4] = 0  # e.g. a prompt the loss ignores
        return {"inputs": t[:, :-1], "targets": t[:, 1:], "mask": mask}

    runs = []
    for axes, devs in (({"data": 1}, jax.devices()[:1]), ({"fsdp": 4, "tensor": 2}, None)):
        plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes, devices=devs), "fsdp_tp",
                                       annotations=um.LLAMA_ANNOTATIONS)
        trainer = jaxpar.Trainer(jaxpar.init_sharded(MODELS["llama"][0], plan),
                                 optax.adam(1e-2), plan, loss_fn=um.next_token_loss)
        runs.append([trainer.step(batch(i))["loss"] for i in range(3)])
        assert trainer.state["step"].sharding.is_fully_replicated
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)


class ShiftsItself(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(um.VOCAB, 8, rngs=rngs)

    def __call__(self, tokens):  # predicts tokens[1:] from tokens[:-1] on its own
        return self.embed(tokens[:, :-1]) @ self.embed.embedding[...].T


class NeedsMask(ShiftsItself):
    def __call__(self, tokens, mask):
        return self.embed(tokens) @ self.embed.embedding[...].T


@pytest.mark.parametrize("model,batch,match", [
    (ShiftsItself, tokens(), r"returns something else needs its own loss"),
    (NeedsMask, tokens(), r"NeedsMask.__call__ cannot be called that way"),
    (ShiftsItself, np.ones((8, 4, 3), np.float32), r"takes token ids .* got a batch of float32"),
])
def test_default_loss_says_what_to_pass_instead(devices, model, batch, match):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 8}), "dp")
    trainer = jaxpar.Trainer(jaxpar.init_sharded(lambda: model(nnx.Rngs(0)), plan),
                             optax.sgd(0.1), plan)
    with pytest.raises(jaxpar.JaxparError, match=match) as err:
        trainer.step(batch)
    assert "loss_fn" in str(err.value)


@pytest.mark.parametrize("model,match", [
    (um.ShiftsRightLM, r"ShiftsRightLM.*leaves the logits at position 8 unchanged: the "
                       r"model shifts its inputs itself"),
    (um.BidirectionalLM, r"BidirectionalLM's logits at positions before 8 change .* sees "
                         r"later tokens"),
])
def test_default_loss_refuses_models_it_would_train_wrongly(devices, model, match):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 8}), "dp")
    trainer = jaxpar.Trainer(jaxpar.init_sharded(lambda: model(rngs=nnx.Rngs(0)), plan),
                             optax.sgd(0.1), plan)
    with pytest.raises(jaxpar.JaxparError, match=match) as err:
        trainer.step(tokens())
    assert "loss_fn" in str(err.value) and trainer.step_count == 0


def test_token_ids_outside_the_vocabulary_are_refused_before_the_step(devices):
    """One id past the vocabulary and one negative, each refused by step and eval_loss of
    one trainer, which neither changes."""
    trainer = make_trainer("llama", "fsdp")
    before = jax.device_get(trainer.state["params"])
    for bad in (um.VOCAB, -3):
        batch = tokens()
        batch[5, 9] = bad
        for run in (trainer.step, trainer.eval_loss):
            with pytest.raises(jaxpar.JaxparError, match=rf"token id {bad} at batch row 5, "
                               rf"position 9 is outside the model's vocabulary "
                               rf"\[0, {um.VOCAB}\)"):
                run(batch)
    assert trainer.step_count == 0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.state["params"]),
                 before)
    assert np.isfinite(trainer.step(tokens())["loss"])  # a good batch still trains


@pytest.mark.parametrize("model", [um.AttentionDropoutLM, um.CallTimeRngsLM])
def test_steps_run_in_train_mode_and_eval_in_eval_mode(devices, model):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2]),
                                   "dp")
    net = jaxpar.init_sharded(lambda: model(rngs=nnx.Rngs(0, dropout=1)), plan)
    net.eval()  # the mode the caller left it in does not matter
    trainer = jaxpar.Trainer(net, optax.sgd(0.0), plan)
    batch = tokens(0)
    losses = {trainer.step(batch)["loss"] for _ in range(3)}
    assert len(losses) == 3, losses  # dropout on, a new mask each step
    expected = cross_entropy(net(jnp.asarray(batch[:, :-1])), batch[:, 1:])
    np.testing.assert_allclose(trainer.eval_loss(batch), float(expected), rtol=1e-5)


# --- the CLI on a user's model factory ----------------------------------------------------


@pytest.fixture(scope="module")
def factory_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("byo") / "llama.yaml"
    config = {
        "model": {"factory": "tests.user_models:llama_like",
                  "kwargs": {"d": 32, "heads": 4, "kv_heads": 2, "ff": 64},
                  "vocab_size": um.VOCAB},
        "mesh": {"data": 1, "fsdp": 4, "tensor": 2},
        "plan": {"rules": "fsdp_tp",
                 "annotations": [[p, list(n)] for p, n in um.LLAMA_ANNOTATIONS],
                 "layouts": [["type:LlamaDecoderLayer", list(BSE)],
                             ["embed_tokens/embedding$", ["vocab", "embed"]]]},
        "train": {"steps": 3, "global_batch": 8, "seq_len": 16, "warmup_steps": 1},
        "data": {"source": str(ROOT / "tests" / "user_models.py"), "max_bytes": 100000},
        "checkpoint": {"every": 0},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``jaxpar ARGS`` run in this process (the test's 8 devices): status, stdout, stderr."""
    from jaxpar import cli

    capsys.readouterr()
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_train_inspect_plan_on_a_user_factory(devices, factory_config, tmp_path, capsys):
    # Token ids of a byte corpus reach 255: model.vocab_size (64) must cover them.
    out = tmp_path / "run"
    status, _, err = _cli(capsys, "train", "--config", str(factory_config), "--devices", "8",
                          "--out", str(out), "model.kwargs.d=32")
    assert status == 2 and "vocab" in err, err
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, um.VOCAB, 20000).astype(np.int32))
    status, stdout, err = _cli(capsys, "train", "--config", str(factory_config), "--devices",
                               "8", "--out", str(out), f"data.source={data}")
    assert status == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["loss"] < rows[0]["loss"]
    # The banner counts the model trained, not the built-in one the config also describes.
    built = um.llama_like(rngs=nnx.Rngs(0), d=32, heads=4, kv_heads=2, ff=64)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(built, nnx.Param)))
    assert f"model tests.user_models:llama_like: {n / 1e6:.3g}M params" in stdout
    assert "M params" not in stdout.splitlines()[0]

    status, stdout, err = _cli(capsys, "inspect", "--config", str(factory_config), "--devices",
                               "8", "--json", f"data.source={data}")
    assert status == 0, err
    report = json.loads(stdout)
    params = {p["path"]: p for p in report["params"]}
    # (the layers scanned: one stack over a leading, unsplit "layers" dimension)
    assert params["layers/mlp/up_proj/kernel"]["spec"] == [None, "fsdp", "tensor"]
    assert report["replication"]["replicated_share"] < 0.05
    assert report["predicted"] is not None, report["notes"]
    assert report["predicted"]["memory"]["argument_bytes"] > 0
    assert not any(c["kind"] == "all-to-all" and c["count"] for c in report["collectives"])

    status, stdout, err = _cli(capsys, "plan", "--model", str(factory_config), "--chips",
                               "h100:8", "--global-batch", "64", "--seq", "512", "--json")
    assert status == 0, err
    plans = json.loads(stdout)
    assert plans and all(p["mesh"]["stage"]["size"] == 1 for p in plans)


# --- fused heads: split per head, or a warning naming the weight ---------------------------


class FusedKV(nnx.Module):
    """K and V projections fused to (embed, kv_heads * head_dim), as many ports write them;
    the head counts live in a config object, Hugging Face style."""

    def __init__(self, *, rngs: nnx.Rngs):
        import types

        self.config = types.SimpleNamespace(num_attention_heads=8, num_key_value_heads=4)
        init = nnx.initializers.lecun_normal()
        self.embed = nnx.Embed(um.VOCAB, 32, rngs=rngs)
        self.kv = nnx.Linear(32, 4 * 8, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("embed", "kv_heads")))
        self.head = nnx.Linear(32, um.VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.kv(x).mean(-1, keepdims=True))


@pytest.mark.parametrize("tensor,warns", [(8, True), (4, False)])
def test_fused_heads_split_inside_a_head_are_named(devices, tensor, warns):
    mesh = jaxpar.make_mesh({"tensor": tensor}, devices=jax.devices()[:tensor])
    plan = jaxpar.Plan.from_preset(mesh, "tp")
    model = jaxpar.init_sharded(lambda: FusedKV(rngs=nnx.Rngs(0)), plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxpar.Trainer(model, optax.sgd(0.1), plan)
    found = [str(w.message) for w in caught if "fuses" in str(w.message)]
    if warns:
        assert len(found) == 1 and found[0].startswith(
            "jaxpar: kv/kernel: its kv_heads dimension fuses 4 heads and is split 8 ways"), found
    else:
        assert not found, found
