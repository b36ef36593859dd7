"""Host offload: runs with state or activations in host memory equal the run without, and
the compiled step holds that state in host memory (``S(5)`` buffers), not on the device."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

import jaxpar
from jaxpar import cli, hf
from jaxpar.analysis.hlo import memory_stats
from jaxpar.analysis.inspection import compile_step
from jaxpar.checkpoint import Checkpointer
from jaxpar.config.assembly import build_trainer
from jaxpar.parallel import offload
from jaxpar.planner.prediction import predict
from tests.helpers import loader, small_config

MESH = ("mesh.fsdp=4", "mesh.tensor=2")
STEPS = 5
MODES = {
    "optimizer": ("plan.offload_optimizer=1",),
    "optimizer_half": ("plan.offload_optimizer=0.5",),
    "host_update": ("plan.offload_optimizer=1", "plan.host_update=true"),
    "params": ("plan.offload_params=true",),
    "params_and_optimizer": ("plan.offload_params=true", "plan.offload_optimizer=1"),
    "activations": ("plan.remat=offload:attention_out,mlp_out",),
    "offload_dots": ("plan.remat=offload_dots",),
}


def trainer(*overrides):
    return build_trainer(small_config(*MESH, *overrides))


def run(t, steps=STEPS, start=0):
    return [t.step(loader().batch(i))["loss"] for i in range(start, start + steps)]


def weights(t):
    return [np.asarray(x) for x in jax.tree.leaves(t.state[t.master_key])]


def assert_same(got, want, rtol=1e-6):
    for a, b in zip(got, want, strict=True):
        assert np.linalg.norm(a - b) <= rtol * max(np.linalg.norm(b), 1e-30)


@pytest.fixture(scope="module")
def plain():
    t = trainer()
    return run(t), weights(t), memory_stats(t.lower(loader().batch(0)).compile()), t


@pytest.fixture(scope="module")
def offloaded():
    """Each mode's trainer after the run (built once, shared by the tests below)."""
    cache = {}

    def get(mode):
        if mode not in cache:
            t = trainer(*MODES[mode])
            cache[mode] = (run(t), weights(t), t)
        return cache[mode]

    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_offloaded_run_equals_plain_run(plain, offloaded, mode):
    losses, params, _ = offloaded(mode)
    np.testing.assert_allclose(losses, plain[0], rtol=1e-6)
    assert_same(params, plain[1])


def test_optimizer_state_lives_in_host_memory(plain, offloaded):
    """ZeRO-Offload with f32 Adam: the device keeps the 4 bytes of weights per parameter
    (sharded), the host the 8 of the two moments; the compiled step's device arguments
    drop by exactly the moments' bytes and its host arguments hold them."""
    t = offloaded("optimizer")[2]
    moments = offload.host_bytes([x for x in jax.tree.leaves(plain[3].state["opt_state"])
                                  if x.ndim])[0]
    n = sum(x.size for x in jax.tree.leaves(t.state["params"]))
    assert moments == pytest.approx(8 * n / 8, rel=0.05)  # 8 bytes per parameter / 8 devices
    device, host = offload.host_bytes(t.state["opt_state"])
    assert host == moments and device < 64  # only step counts stay
    got = memory_stats(t.lower(loader().batch(0)).compile())
    assert got["host_argument_bytes"] == moments
    assert got["argument_bytes"] == plain[2]["argument_bytes"] - moments


def test_half_offload_moves_the_largest_tensors_first(offloaded):
    t = offloaded("optimizer_half")[2]
    device, host = offload.host_bytes(t.state["opt_state"])
    assert host >= (device + host) / 2 > device - 4
    on_host = [x.size for x in jax.tree.leaves(t.state["opt_state"])
               if x.sharding.memory_kind == offload.HOST]
    on_device = [x.size for x in jax.tree.leaves(t.state["opt_state"])
                 if x.sharding.memory_kind != offload.HOST]
    assert min(on_host) >= max(on_device)


def test_streamed_weights_leave_the_device(plain, offloaded):
    """Parameter streaming: the stacked layers' weights move to host memory (device
    arguments drop by their bytes) and the step's device temporaries do not grow: each
    layer's shard is on the device only while that layer runs."""
    t = offloaded("params")[2]
    layers = offload.host_bytes(t.state["params"]["blocks"])
    norms = sum(offload.host_bytes(t.state["params"]["blocks"][n])[0]
                for n in ("attn_norm", "mlp_norm"))
    assert layers[0] == norms > 0 and layers[1] > 0  # matrices streamed, vectors kept
    assert offload.host_bytes(t.state["params"]["embed"])[1] == 0
    got = memory_stats(t.lower(loader().batch(0)).compile())
    assert got["host_argument_bytes"] == layers[1]
    assert got["argument_bytes"] == plain[2]["argument_bytes"] - layers[1]
    assert got["temp_bytes"] <= plain[2]["temp_bytes"]


def test_streaming_keeps_the_remat_policy():
    """Streaming composes with remat: the step recomputes as much as without streaming
    (a streamed layer must not bring its activations back as saved residuals)."""
    def temp(*extra):  # the Trainer's step compiled from shapes: nothing initialised
        config = small_config(*MESH, "plan.remat=full", "model.n_layers=4", *extra)
        return memory_stats(compile_step(config).compiled)["temp_bytes"]

    assert temp("plan.offload_params=true") <= temp()


def test_mixed_precision_master_weights_offload():
    mixed = "plan.precision=params=float32,compute=bfloat16,output=float32"
    a, b = trainer(mixed), trainer(mixed, "plan.offload_optimizer=1",
                                   "plan.offload_params=true")
    assert offload.host_bytes(b.state["master"])[0] == 0
    np.testing.assert_allclose(run(b, 3), run(a, 3), rtol=1e-6)
    assert_same(weights(b), weights(a))


def test_resume_with_offload_equals_uninterrupted(tmp_path, offloaded):
    overrides = MODES["params_and_optimizer"]
    losses, params, _ = offloaded("params_and_optimizer")
    first = trainer(*overrides)
    run(first, 3)
    with Checkpointer(tmp_path / "ck", async_save=False) as ckpt:
        ckpt.save(first, force=True)
    again = trainer(*overrides)
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.restore(again)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(again.state["opt_state"])
             if x.ndim}
    assert kinds == {offload.HOST}
    assert run(again, 2, start=3) == losses[3:]
    assert_same(weights(again), params, rtol=0)
    # The same checkpoint restores onto a plan without offload, and trains on the same.
    plain_again = trainer()
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.restore(plain_again)
    np.testing.assert_allclose(run(plain_again, 2, start=3), losses[3:], rtol=1e-6)


def test_largest_first_picks_by_bytes():
    shapes = {"a": jax.ShapeDtypeStruct((10,), np.float32),
              "b": jax.ShapeDtypeStruct((100,), np.float32),
              "c": jax.ShapeDtypeStruct((50,), np.float32),
              "n": jax.ShapeDtypeStruct((), np.int32)}
    assert offload.largest_first(shapes, 0.5) == {"a": False, "b": True, "c": False,
                                                   "n": False}
    assert offload.largest_first(shapes, 0.7) == {"a": False, "b": True, "c": True,
                                                   "n": False}
    assert offload.largest_first(shapes, 1.0) == {"a": True, "b": True, "c": True,
                                                   "n": False}
    assert not any(offload.largest_first(shapes, 0.0).values())


@pytest.mark.parametrize("overrides, message", [
    (("plan.offload_optimizer=1.5",), r"plan.offload_optimizer=1.5: must be a fraction"),
    (("plan.host_update=true",), r"plan.host_update .* set plan.offload_optimizer: 1"),
    (("plan.remat=offload:mlp_out,kv",), r"plan.remat='offload:mlp_out,kv'.*offload:<names>"),
])
def test_bad_offload_settings_are_one_line(overrides, message):
    with pytest.raises(jaxpar.JaxparError, match=message):
        build_trainer(small_config(*overrides))


class ScannedMLP(nnx.Module):
    """A user's model: stacked layers run with ``lax.scan``, no jaxpar calls inside."""

    def __init__(self, rngs, *, stream=None):
        init = nnx.initializers.normal(0.2)
        self.embed = nnx.Param(init(rngs.params(), (64, 16)), out_sharding=("vocab", "embed"))
        self.w = nnx.Param(init(rngs.params(), (3, 16, 16)),
                           out_sharding=("layers", "embed", "mlp"))
        self.stream = stream

    def __call__(self, tokens):
        def body(h, w):
            w = self.stream(w) if self.stream else w
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(body, self.embed[...][tokens], self.w[...])
        return h @ self.embed[...].T


def _train_scanned(stream, offload_params):
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2})
    plan = jaxpar.Plan.from_preset(mesh, offload_params=offload_params)
    model = jaxpar.init_sharded(lambda: ScannedMLP(nnx.Rngs(0), stream=stream), plan)
    t = jaxpar.Trainer(model, optax.sgd(0.1), plan)
    tokens = np.arange(8 * 9).reshape(8, 9) % 64
    return [t.step(tokens)["loss"] for _ in range(2)], t


def test_a_model_that_does_not_stream_gets_one_line():
    with pytest.raises(jaxpar.JaxparError, match=r"offload_params keeps .*offload.stream_layer"):
        _train_scanned(None, True)


def test_a_model_streams_with_the_public_hook():
    want, _ = _train_scanned(None, False)
    got, t = _train_scanned(offload.stream_layer, True)
    assert t.state["params"]["w"].sharding.memory_kind == offload.HOST
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_hf_export_of_an_offloaded_run_equals_the_plain_one(tmp_path, plain, offloaded):
    t = offloaded("params_and_optimizer")[2]
    hf.save(plain[3].model, tmp_path / "plain")
    hf.save(t.model, tmp_path / "offloaded")
    want = load_file(tmp_path / "plain" / "model.safetensors")
    got = load_file(tmp_path / "offloaded" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-6, atol=1e-7)


def test_lora_streams_the_frozen_base_and_keeps_adapters_on_the_device():
    lora = ("lora.enabled=true", "lora.rank=4")
    a, b = trainer(*lora), trainer(*lora, "plan.offload_params=true")
    base = [x for x in jax.tree.leaves(b.state["frozen"]["blocks"]) if x.ndim > 2]
    assert base and all(x.sharding.memory_kind == offload.HOST for x in base)
    assert offload.host_bytes(b.state["params"])[1] == 0  # the adapters
    np.testing.assert_allclose(run(b, 3), run(a, 3), rtol=1e-6)
    assert_same(weights(b), weights(a))


def test_cli_trains_and_resumes_with_offload_as_without(tmp_path):
    """``jaxpar train`` with every offload, stopped after 2 steps and resumed to 4, logs
    the losses of a plain 4-step run."""
    tiny = ["--config", "configs/tiny.yaml", "--devices", "8", "model.n_layers=2",
            "model.d_model=32", "model.d_ff=64", "train.seq_len=16", "train.global_batch=8",
            "train.warmup_steps=1", "train.eval_every=0", "checkpoint.every=2",
            "mesh.fsdp=4", "mesh.tensor=2"]
    offloaded = ["plan.offload_optimizer=1", "plan.offload_params=true",
                 "plan.remat=offload:mlp_out"]
    assert cli.main(["train", *tiny, "train.steps=4", "--out", str(tmp_path / "plain")]) == 0
    out = str(tmp_path / "offloaded")
    assert cli.main(["train", *tiny, *offloaded, "train.steps=2", "--out", out]) == 0
    assert cli.main(["train", *tiny, *offloaded, "train.steps=4", "--out", out,
                     "--resume"]) == 0

    def losses(run):
        rows = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, rows) if "loss" in r}

    want, got = losses("plain"), losses("offloaded")
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [want[s] for s in range(1, 5)],
                               rtol=1e-6)


def test_a_plain_checkpoint_restores_into_host_memory(tmp_path, plain):
    with Checkpointer(tmp_path / "ck", async_save=False) as ckpt:
        ckpt.save(plain[3], force=True)
    t = trainer(*MODES["params_and_optimizer"])
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.restore(t)
    assert offload.host_bytes([x for x in jax.tree.leaves(t.state["params"]["blocks"])
                               if x.ndim > 2])[0] == 0
    assert offload.host_bytes([x for x in jax.tree.leaves(t.state["opt_state"])
                               if x.ndim])[0] == 0
    assert_same(weights(t), plain[1], rtol=0)


@pytest.mark.parametrize("mode", ["optimizer", "optimizer_half", "host_update", "params",
                                  "params_and_optimizer"])
def test_planner_memory_for_offloaded_state_matches_the_compiled_step(offloaded, mode):
    """The planner's per-device memory for an offloaded layout, against XLA's figures for
    the compiled step: device bytes (arguments + temporaries) within 10%, host bytes
    exact."""
    config = small_config(*MESH, *MODES[mode])
    predicted = predict(config, 8, backend="cpu")["memory"]
    got = memory_stats(offloaded(mode)[2].lower(loader().batch(0)).compile())
    assert predicted["host_bytes"] == got["host_argument_bytes"] > 0
    device = got["argument_bytes"] + got["temp_bytes"]
    assert predicted["argument_bytes"] + predicted["temp_bytes"] == pytest.approx(device,
                                                                                  rel=0.10)


def test_planner_prices_activation_offload_like_its_on_device_twin_on_cpu():
    """XLA:CPU has one memory, so an activation offload policy compiles to the same
    temporaries as the policy that keeps those names on the device; the planner says the
    same (both are off by that policy's own error on this model, ~17%)."""
    def predicted(remat):
        return predict(small_config(*MESH, f"plan.remat={remat}"), 8, backend="cpu")["memory"]

    assert predicted("offload:attention_out,mlp_out")["temp_bytes"] == predicted(
        "save_attention_and_mlp_outputs")["temp_bytes"]
    assert predicted("offload_dots")["temp_bytes"] == predicted(
        "dots_with_no_batch_dims_saveable")["temp_bytes"]


def test_host_compute_speaks_both_compute_on_conventions():
    """JAX 0.10's compute_on(compute_type) context (results in device memory), and JAX
    0.11's keyword-only compute_on(f, *, compute_type, out_memory_spaces) (0.10's
    compute_on2): the same function reaches both, its results where it asks."""
    calls = []

    def old_style(compute_type):
        calls.append(("old", compute_type))
        return lambda f: f

    def new_style(f=None, *, compute_type, out_memory_spaces, compiler_options=None):
        calls.append(("new", compute_type, out_memory_spaces))
        return f

    fn = lambda x: x  # noqa: E731
    host = jax.memory.Space.Host
    assert offload.host_compute(fn, wrap=old_style) is fn
    assert offload.host_compute(fn, wrap=new_style, out=host) is fn
    moved = offload.host_compute(fn, wrap=old_style, out=host)  # 0.10: moved after
    assert moved is not fn
    assert calls == [("old", "device_host"), ("new", "device_host", host),
                     ("old", "device_host")]


def test_host_compute_runs_on_this_jax():
    """Whichever convention this JAX has, a function computed on the host leaves its
    result where it is asked to."""
    mesh = jaxpar.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    sharding = jax.sharding.NamedSharding(mesh, jax.P())
    x = jax.device_put(jnp.arange(4.0), sharding.with_memory_kind(offload.HOST))
    for space, kind in ((jax.memory.Space.Host, offload.HOST),
                        (jax.memory.Space.Device, "device")):
        double = offload.on_host(lambda v: 2 * v, out=space)
        got = jax.jit(double)(x)
        assert got.sharding.memory_kind == kind
        np.testing.assert_array_equal(np.asarray(got), [0, 2, 4, 6])
