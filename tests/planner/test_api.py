"""The planner's API and its command line: ``jaxpar.plan`` is the planner, models given
every accepted way (and refused otherwise), arguments checked, plans as JSON and as a run
config that trains with them (``jaxpar plan --json`` / ``--write``), and the table's
explanation of the winner."""

import json
import math

import pytest
from flax import nnx

import jaxpar
from jaxpar.cli import main
from jaxpar.config.validate import check_config
from jaxpar.models import Transformer
from jaxpar.planner import Candidate, estimate, plan, resolve_model
from jaxpar.planner.api import run_config, to_dict
from tests.planner.cases import MIXTRAL, TINY


def test_top_level_plan_is_the_planner():
    # The 256-chip search itself is test_search.py's test_llama_7b_on_v5p_256_fits_and_is_sane.
    assert jaxpar.plan is plan
    best = jaxpar.plan("configs/llama-7b.yaml", chips="tpu-v5p:16", global_batch=32,
                       seq=4096, top=1)[0]
    assert best.fits and best.candidate.n_devices == 16
    assert jaxpar.Plan.__module__ == "jaxpar.sharding.plan"  # the Plan class is untouched


def test_cli_json_keys(capsys):
    assert main(["plan", "--model", "configs/llama-7b.yaml", "--chips", "h100:16",
                 "--global-batch", "64", "--seq", "2048", "--json", "--top", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert 1 <= len(rows) <= 3
    for key in ("mesh", "zero_stage", "remat", "microbatches", "memory_per_device_bytes",
                "step_time_s", "mfu"):
        assert key in rows[0]
    assert set(rows[0]["mesh"]["data"]) == {"size", "ici", "dcn"}
    assert math.prod(m["size"] for m in rows[0]["mesh"].values()) == 16
    assert rows[0]["mesh"]["tensor"]["dcn"] == 1  # tensor parallelism stays in NVLink


def test_cli_write_loads_as_run_config(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "configs/tiny.yaml", "--chips", "cpu:8", "--global-batch",
                 "32", "--seq", "128", "--write", str(out), "model.n_layers=2"]) == 0
    assert "why #1" in capsys.readouterr().out
    config = jaxpar.load_config(out)
    assert config.model.n_layers == 2 and config.train.global_batch == 32
    sizes = config.mesh.ici()
    assert sizes["data"] * sizes["stage"] * sizes["fsdp"] * sizes["tensor"] == 8
    assert "bfloat16" in config.plan.precision


def test_cli_mixtral_table_shows_expert_axis(capsys):
    assert main(["plan", "--model", MIXTRAL, "--chips", "h100:16", "--global-batch", "256",
                 "--seq", "4096", "--top", "3"]) == 0
    out = capsys.readouterr().out
    header, first = out.splitlines()[1], out.splitlines()[3]
    assert "sp" in header.split() and "expert=" in first
    assert "active" in out.splitlines()[0]
    why = next(line for line in out.splitlines() if line.startswith("why #1:"))
    assert "expert parallelism" in why


def test_cli_write_carries_context_and_sequence_parallel(tmp_path, capsys):
    out = tmp_path / "long.yaml"
    assert main(["plan", "--model", "configs/llama-70b.yaml", "--chips", "tpu-v5p:512",
                 "--global-batch", "32", "--seq", "131072", "--top", "2", "--write",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "context=" in text.splitlines()[3]
    config = jaxpar.load_config(out)
    assert config.mesh.context > 1 and config.mesh.expert == 1
    assert config.plan.context_attention in ("ring", "allgather")
    assert config.plan.sequence_parallel == (config.mesh.tensor > 1)
    assert config.train.seq_len == config.model.max_seq_len == 131072
    check_config(config, devices=512)  # the run config is valid for the machine


def test_cli_explains_the_winner_with_the_breakdown(capsys):
    assert main(["plan", "--model", "configs/llama-7b.yaml", "--chips", "h100:16",
                 "--global-batch", "32", "--seq", "4096", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "where #1's step goes" in out and "compute gate_up" in out


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"global_batch": 0}, "global batch and seq must be positive, got 0, 64"),
    ({"seq": -1}, "global batch and seq must be positive, got 16, -1"),
    ({"context": 0}, "context sizes must be positive integers, got 0"),
    ({"expert": (1, "2")}, r"expert sizes must be positive integers, got \(1, '2'\)"),
    ({"chips": "h100"}, "kind:count"),
])
def test_bad_plan_arguments_are_named(kwargs, message):
    args = {"chips": "cpu:8", "global_batch": 16, "seq": 64, **kwargs}
    with pytest.raises(jaxpar.JaxparError, match=message):
        plan(TINY, **args)


def test_models_are_accepted_as_configs_paths_and_factories():
    from_yaml = resolve_model("configs/tiny.yaml", ["model.n_layers=3"])
    assert from_yaml.config.model.n_layers == 3 and from_yaml.spec_for(1).n_layers == 3
    assert from_yaml.pipeline and from_yaml.spec_for(3).tensors[1].names[:2] == (
        "repeat", "stage")
    assert resolve_model(TINY).spec_for(1).n_params == TINY.param_count()
    config = jaxpar.load_config("configs/tiny.yaml")
    assert resolve_model(config, ["model.d_model=64"]).spec_for(1).d_model == 64
    factory = resolve_model(lambda: Transformer(TINY, rngs=nnx.Rngs(0)))
    assert not factory.pipeline and factory.config is None
    with pytest.raises(jaxpar.JaxparError, match="pipeline stages need the reference"):
        factory.spec_for(2)


def test_bad_models_are_refused():
    with pytest.raises(jaxpar.JaxparError, match="cannot plan for a int"):
        resolve_model(42)
    with pytest.raises(jaxpar.JaxparError, match="model overrides need a YAML path"):
        resolve_model(TINY, ["model.n_layers=3"])


def test_estimate_needs_a_mesh_of_the_machine_size():
    with pytest.raises(jaxpar.JaxparError, match="spans 4 devices, machine has 8"):
        estimate(TINY, Candidate.make({"data": 4}), chips="h100:8", global_batch=16, seq=64)


def test_json_summary_of_a_plan():
    cand = Candidate.make({"data": 4, "fsdp": 2}, zero_stage=1, remat="full")
    est = estimate(TINY, cand, chips="h100:8", global_batch=16, seq=128)
    row = to_dict(est, 16, 128)
    assert row["mesh"]["fsdp"] == {"size": 2, "ici": 2, "dcn": 1}
    assert (row["zero_stage"], row["remat"], row["rules"]) == (1, "full", "fsdp_tp")
    assert row["tokens_per_s"] == pytest.approx(16 * 128 / est.step_time_s)
    assert row["tflops_per_device"] == pytest.approx(est.model_flops / est.step_time_s / 1e12)
    assert row["memory_per_device_bytes"] == int(est.memory["total_bytes"])
    # Knobs with no axis to act on are reported off.
    assert row["sequence_parallel"] is False and row["context_attention"] is None
    json.dumps(row)


def test_run_config_carries_the_plan():
    cand = Candidate.make({"data": 2, "fsdp": 2, "tensor": 2}, zero_stage=1, remat="full",
                          microbatches=2, sequence_parallel=True)
    est = estimate(TINY, cand, chips="tpu-v5p:8", global_batch=16, seq=512)
    config = run_config(est, None, TINY, 16, 512)
    assert (config.mesh.data, config.mesh.fsdp, config.mesh.tensor) == (2, 2, 2)
    assert math.prod(config.mesh.ici().values()) == 8 and config.mesh.dcn() is None
    assert (config.plan.zero_stage, config.plan.remat, config.plan.microbatches) == (
        1, "full", 2)
    assert config.plan.sequence_parallel
    assert config.plan.precision == "params=float32,compute=bfloat16,output=float32"
    assert (config.train.global_batch, config.train.seq_len) == (16, 512)
    assert config.model.max_seq_len == 512 > TINY.max_seq_len  # raised to the sequence
    assert config.model.d_model == TINY.d_model
    check_config(config, devices=8)
