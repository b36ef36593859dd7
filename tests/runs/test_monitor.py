"""jaxpar.runs.monitor: TensorBoard scalars, tags, MFU, memory and the profiler window."""

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxpar.config.schema import ModelConfig
from jaxpar.config.validate import check_profile_steps
from jaxpar.errors import JaxparError
from jaxpar.models.transformer import TransformerConfig
from jaxpar.planner.catalog import BUILTIN
from jaxpar.runs.monitor import (
    ProfileWindow,
    TensorBoardLog,
    chip_for_kind,
    memory_in_use,
    mfu,
    model_flops_per_step,
    model_flops_per_token,
    peak_flops_per_device,
    tensorboard_tags,
)


def test_scalars_read_back_by_tensorboard(tmp_path):
    with TensorBoardLog(tmp_path / "tb") as log:
        for step in range(1, 6):
            log.scalars(step, {"train/loss": 1.0 / step, "perf/tokens_per_s": 1000 * step,
                               "train/skip_none": None, "train/text": "x", "train/flag": True})
        log.scalars(6, {"train/loss": math.nan, "perf/tokens_per_s": math.inf})
        log.scalars(7, {"train/loss": -math.inf})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["perf/tokens_per_s", "train/loss"]
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3, 0.25, 0.2], rel=1e-6)
    tps = acc.Scalars("perf/tokens_per_s")
    assert [(e.step, e.value) for e in tps] == [(s, 1000.0 * s) for s in range(1, 6)]
    log.close()  # closing twice is harmless
    with pytest.raises(JaxparError, match="closed"):
        log.scalars(8, {"train/loss": 1.0})


def test_tensorboard_tags():
    row = {"step": 7, "loss": 2.5, "eval_loss": 2.75, "lr": 1e-3, "grad_norm": 0.5,
           "tokens_per_s": 1e4, "step_time_s": 0.1, "mfu": 0.4, "memory_bytes": 1 << 30,
           "loss_scale": 32768.0, "checkpoint_block_s": 0.01, "aux_loss": 0.125,
           "note": "hello", "missing": None, "bad": math.nan}
    assert tensorboard_tags(row) == {
        "train/loss": 2.5, "eval/loss": 2.75, "train/lr": 1e-3, "train/grad_norm": 0.5,
        "perf/tokens_per_s": 1e4, "perf/step_time_s": 0.1, "perf/mfu": 0.4,
        "memory/bytes_in_use": float(1 << 30), "train/loss_scale": 32768.0,
        "perf/checkpoint_block_s": 0.01, "train/aux_loss": 0.125}


def test_peak_flops_lookup():
    assert peak_flops_per_device() is None  # the test devices are CPUs
    assert peak_flops_per_device(jax.devices()[3]) is None

    def fake(kind):
        return SimpleNamespace(platform="tpu" if kind.startswith("TPU") else "gpu",
                               device_kind=kind)

    assert peak_flops_per_device(fake("TPU v5p")) == BUILTIN["tpu-v5p"].peak_flops
    expected = {"TPU v4": "tpu-v4", "TPU v5 lite": "tpu-v5e", "TPU v5": "tpu-v5p",
                "TPU v6 lite": "tpu-v6e", "NVIDIA H100 80GB HBM3": "h100",
                "NVIDIA H200": "h200", "NVIDIA A100-SXM4-80GB": "a100-80gb",
                "NVIDIA A100-PCIE-40GB": "a100-80gb"}
    for kind, key in expected.items():
        assert chip_for_kind(kind) == key, kind
        assert peak_flops_per_device(fake(kind)) == BUILTIN[key].peak_flops
    for kind in ("TPU v4 lite", "NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA GH200 480GB",
                 "Tesla V100-SXM2-16GB", ""):
        assert peak_flops_per_device(fake(kind)) is None, kind
    # A catalog entry named after the device kind (e.g. from a YAML catalog) is used.
    pcie = SimpleNamespace(name="nvidia h100 pcie", peak_flops=756e12)
    assert peak_flops_per_device(fake("NVIDIA H100 PCIe"),
                                 {**BUILTIN, "nvidia h100 pcie": pcie}) == 756e12


def test_mfu_arithmetic():
    assert mfu(4e15, 2.0, 8, 1e15) == pytest.approx(0.25)
    assert mfu(4e15, 2.0, 8, None) is None
    assert mfu(4e15, 0.0, 8, 1e15) is None
    assert mfu(4e15, -1.0, 8, 1e15) is None


def test_model_flops_match_palm_formula():
    cfg = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=256)
    seq, batch = 32, 4
    d, L, V, f, hd = 64, 2, 256, 256, 16
    # N: parameters in matmuls: per layer wq, wo (d x d), wk, wv (d x 2 kv heads x 16),
    # gate, up, down (d x f); plus the output head d x V. Not the embedding table (a
    # lookup) nor the RMSNorm scales.
    n_matmul = L * (2 * d * d + 2 * d * 2 * hd + 3 * d * f) + d * V
    assert n_matmul == 139_264
    # PaLM appendix B: 6N + 12 * L * H * Q * T per token, H * Q = d_model here.
    per_token = 6 * n_matmul + 12 * L * d * seq
    assert per_token == 884_736
    assert model_flops_per_token(cfg, seq) == pytest.approx(per_token)
    assert model_flops_per_step(cfg, batch, seq) == pytest.approx(per_token * batch * seq)
    # A run config's model section works alike; a tied embedding is the head (same N).
    assert model_flops_per_step(ModelConfig(**vars(cfg)), batch, seq) == per_token * batch * seq
    tied = TransformerConfig(**{**vars(cfg), "tie_embeddings": True})
    assert model_flops_per_token(tied, seq) == pytest.approx(per_token)
    # A user's model: unknown.
    user = ModelConfig(factory="pkg.mod:make")
    assert model_flops_per_step(user, batch, seq) is None
    with pytest.raises(JaxparError, match="factory"):
        model_flops_per_token(user, seq)


def test_memory_in_use(monkeypatch):
    assert memory_in_use() is None  # CPU devices report no statistics

    class Dev:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats

    devs = [Dev({"bytes_in_use": 100, "peak_bytes_in_use": 7}), Dev(None),
            Dev(RuntimeError("UNIMPLEMENTED")), Dev({"bytes_in_use": 23})]
    monkeypatch.setattr(jax, "local_devices", lambda: devs)
    assert memory_in_use() == 123


def test_profile_window_writes_trace(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((32, 32))
    f(x).block_until_ready()
    window = ProfileWindow([2, 3], tmp_path / "prof")
    tracing = []
    for step in range(4):
        window.before_step(step)
        tracing.append(window.active)
        x = f(x)
        window.after_step(step, x)
    window.close()
    assert tracing == [False, True, True, False]
    assert not window.active
    assert list((tmp_path / "prof").rglob("*.xplane.pb"))


def test_profile_window_close_and_off(tmp_path):
    off = ProfileWindow(None, tmp_path / "off")
    off.before_step(0)
    off.after_step(0, 1.0)
    assert not off.active and not (tmp_path / "off").exists()
    # A run that ends inside the window: close() stops the trace, so a new one can start.
    early = ProfileWindow((2, 10), tmp_path / "early")
    for step in range(3):
        early.before_step(step)
        early.after_step(step, {"loss": 1.0})
    assert early.active
    early.close()
    early.close()
    assert not early.active
    assert list((tmp_path / "early").rglob("*.xplane.pb"))


@pytest.mark.parametrize("bad", [[3, 2], [0, 1], [1], "x", [1, 2, 3], [1.0, 2], [True, 2]])
def test_check_profile_steps_rejects(bad):
    with pytest.raises(JaxparError, match=r"train\.profile_steps=.*1 <= a <= b"):
        check_profile_steps(bad)
    with pytest.raises(JaxparError):
        ProfileWindow(bad, "unused")


@pytest.mark.parametrize("good", [None, [], (), [1, 1], [2, 5], (3, 4)])
def test_check_profile_steps_accepts(good):
    check_profile_steps(good)


def test_a_factory_run_logs_mfu_from_its_traced_flops(tmp_path, capsys):
    # A user's LlamaLike trained 2 steps on 8 CPU devices against a calibrated peak: its
    # MFU is the traced step's matmul FLOPs over (step time x devices x peak), and those
    # FLOPs are 6 N + 12 L d s a token by the test's own count. The run computes in
    # float32: its peak is the catalog's f32_flops, not the 16-bit peak_flops.
    import numpy as np

    import jaxpar
    from jaxpar.runs.loop import train
    from tests.user_models import VOCAB

    d, heads, kv, ff, layers, seq, batch = 32, 4, 2, 64, 2, 32, 8
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, VOCAB, 40_000).astype(np.int32))
    catalog = tmp_path / "cpu.yaml"
    catalog.write_text("cpu8: {peak_flops: 2.0e9, f32_flops: 1.0e9, hbm_bytes: 3.0e9, "
                       "hbm_bw: 1.0e9, ici_bw: 1.0e9, dcn_bw: 1.0e9, domain: 8}\n")
    config = jaxpar.load_config(None, [
        "model.factory=tests.user_models:llama_like", f"model.vocab_size={VOCAB}",
        f"model.kwargs={{d: {d}, heads: {heads}, kv_heads: {kv}, ff: {ff}, layers: {layers}}}",
        "mesh.data=8", f"train.global_batch={batch}", f"train.seq_len={seq}",
        "train.steps=2", "train.warmup_steps=1", f"train.catalog={catalog}",
        "train.trackers=[jsonl]", f"data.source={tokens}"])
    _, history = train(config, tmp_path / "run", progress=False)
    hd = d // heads
    n = layers * (2 * d * heads * hd + 2 * d * kv * hd + 3 * d * ff) + d * VOCAB
    flops = batch * seq * (6 * n + 12 * layers * d * seq)
    for row in history:
        assert row["mfu"] == pytest.approx(flops / (row["step_time_s"] * 8 * 1e9), rel=1e-3)
    said = capsys.readouterr()
    assert "model FLOPs counted in the traced step" in said.out + said.err
