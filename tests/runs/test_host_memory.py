"""The pinned host pool sized from the plan before the backend starts, and plans the host
cannot hold refused in one line naming both figures."""

import math
import os
from types import SimpleNamespace

import numpy as np
import pytest

import jaxpar
from jaxpar.cli import main
from jaxpar.errors import JaxparError
from jaxpar.parallel import offload
from jaxpar.planner.catalog import HOST_POOL_SHARE
from jaxpar.runs import host_memory
from jaxpar.runs.host_memory import GPU_POOL_ENV, host_bytes_per_process, size_host_pool

GIB = 2**30
LLAMA_8B = ["train.global_batch=1", "train.seq_len=4096", "plan.remat=full"]


def config(*overrides):
    return jaxpar.load_config("configs/llama-8b.yaml", [*LLAMA_8B, *overrides])


def test_the_pool_is_the_plans_host_bytes_with_a_margin():
    cfg = config("plan.offload_optimizer=1")
    need = host_bytes_per_process(cfg, 1)
    # Llama 3.1 8B: f32 master weights and Adam's two moments, 12 bytes a parameter.
    assert need == pytest.approx(8.03e9 * 12, rel=0.01)
    env = {}
    got = size_host_pool(cfg, 1, environ=env, ram=512 * GIB)
    assert got == math.ceil(need * host_memory.MARGIN / GIB) + host_memory.SLACK_GIB
    assert env == {GPU_POOL_ENV: str(got)} and got > 64  # XLA's default would not do
    # Two GPUs in the process, each with its own share of the state (ZeRO over fsdp).
    two = host_bytes_per_process(cfg, 2)
    assert two == pytest.approx(need, rel=0.01)


def test_a_host_too_small_is_refused_naming_both_figures():
    with pytest.raises(JaxparError) as err:
        size_host_pool(config("plan.offload_optimizer=1"), 1, environ={}, ram=64 * GIB)
    text = str(err.value)
    assert "\n" not in text and "89.7 GiB in host memory per process" in text
    assert f"{HOST_POOL_SHARE * 64:.1f} GiB this host can pin" in text and "64.0 GiB" in text


def test_a_pool_set_by_hand_is_kept_when_it_suffices_and_refused_when_not():
    cfg = config("plan.offload_optimizer=1")
    env = {GPU_POOL_ENV: "200"}
    assert size_host_pool(cfg, 1, environ=env, ram=512 * GIB) == 200
    assert env == {GPU_POOL_ENV: "200"}
    with pytest.raises(JaxparError, match=f"{GPU_POOL_ENV}=64 pins 64 GiB .* less than"):
        size_host_pool(cfg, 1, environ={GPU_POOL_ENV: "64"}, ram=512 * GIB)
    with pytest.raises(JaxparError, match="not a whole number"):
        size_host_pool(cfg, 1, environ={GPU_POOL_ENV: "lots"}, ram=512 * GIB)


def test_nothing_is_set_without_offload():
    env = {}
    assert size_host_pool(config(), 1, environ=env, ram=GIB) is None and env == {}


def test_gpus_are_counted_without_starting_a_runtime():
    assert host_memory.local_gpu_count({"CUDA_VISIBLE_DEVICES": "0,3"}) == 2
    assert host_memory.local_gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    assert host_memory.local_gpu_count({}) == len(
        [p for p in os.listdir("/dev") if p.startswith("nvidia") and p[6:].isdigit()])


def test_the_planner_counts_what_the_runtime_pins_not_the_ram():
    h100 = jaxpar.planner.BUILTIN["h100"]
    assert h100.host_pool_bytes == pytest.approx(HOST_POOL_SHARE * h100.host_bytes)
    best = jaxpar.plan(jaxpar.models.TransformerConfig(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        d_ff=14336, max_seq_len=4096), chips="h100:1", global_batch=1, seq=4096,
        offload="auto")[0]
    assert best.host_capacity_bytes == h100.host_pool_bytes


def test_a_trainer_on_gpus_refuses_state_beyond_the_runtimes_pool():
    gpu = SimpleNamespace(platform="gpu", process_index=0)
    mesh = SimpleNamespace(devices=np.array([gpu, gpu]))
    offload.check_gpu_pool(mesh, 30 * GIB, environ={GPU_POOL_ENV: "64"})  # 60 GiB: fits
    with pytest.raises(JaxparError, match="needs 80.0 GiB of pinned host memory .* 64 GiB"):
        offload.check_gpu_pool(mesh, 40 * GIB, environ={})
    cpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="cpu")]))
    offload.check_gpu_pool(cpu, 1000 * GIB, environ={})  # no pool to overflow


def test_jaxpar_train_refuses_a_pool_too_small_before_starting(monkeypatch, capsys):
    monkeypatch.setenv(GPU_POOL_ENV, "0")
    code = main(["train", "--config", "configs/tiny.yaml", "--devices", "8",
                 "plan.offload_optimizer=1", "train.steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and f"{GPU_POOL_ENV}=0 pins 0 GiB" in err


def test_gpu_runs_take_the_planners_share_of_device_memory():
    """JAX preallocates three quarters of a GPU's memory by default; the planner plans for
    the catalog's HBM (80 GB of an H100's 79.1 GiB): jaxpar's runs ask for 95%, unless
    the user chose a fraction, no preallocation or another allocator."""
    from jaxpar.planner.catalog import BUILTIN

    env: dict[str, str] = {}
    assert host_memory.size_device_pool(env) == "0.95" and env == {
        host_memory.MEM_FRACTION_ENV: "0.95"}
    h100_reports = 84_929_347_584  # bytes an H100 80GB HBM3 reports
    assert BUILTIN["h100"].hbm_bytes <= 0.95 * h100_reports
    for chosen in ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"},
                   {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
                   {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}):
        env = dict(chosen)
        assert host_memory.size_device_pool(env) is None and env == chosen
