"""Bad input on the Hugging Face surfaces (``jaxpar convert``, ``jaxpar export``,
``init_from=hf:``, :func:`jaxpar.hf.load`): each mistake exits 2 with one line naming the
file, key or tensor and its value, no traceback, and nothing in the folders changes.

The cases use :mod:`tests.cli.test_bad_input`'s table and checks, on a tiny Llama folder
(hidden size 32, 2 layers) that every case gets a fresh copy of, as ``{tmp}/hf``.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file

from jaxpar import hf
from jaxpar.cli import main
from jaxpar.errors import JaxparError
from jaxpar.storage import safetensors_io
from tests.cli.test_bad_input import (
    ROOT,
    Case,
    Setup,
    _check,
    _params,
    _prepare,
    _snapshot,
    run_main,
)
from tests.hf.test_convert import make_hf_model

SIZES = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
"""A byte-level vocabulary, so runs can train on the built-in corpus."""
UP = "model.layers.1.mlp.up_proj.weight"
HF = "{tmp}/hf"
CONVERT = ["convert", "--from-hf", HF, "--out", "{out}"]
SMALL_RUN = ["train.seq_len=16", "train.global_batch=8", "train.steps=2",
             "data.max_bytes=100000"]
TRAIN = ["train", "--out", "{out}", f"init_from=hf:{HF}", *SMALL_RUN]

def config_edit(change: Callable[[dict], object]) -> Setup:
    """A setup that rewrites ``{tmp}/hf/config.json`` by ``change`` (which edits the dict in
    place, or returns what to write instead)."""

    def setup(tmp: Path) -> dict[str, str]:
        path = tmp / "hf" / "config.json"
        data = json.loads(path.read_text())
        new = change(data)
        path.write_text(json.dumps(data if new is None else new))
        return {}

    return setup


def tensor_edit(change: Callable[[dict[str, np.ndarray]], None]) -> Setup:
    """A setup that rewrites ``{tmp}/hf/model.safetensors`` by ``change``."""

    def setup(tmp: Path) -> dict[str, str]:
        path = tmp / "hf" / "model.safetensors"
        tensors = load_file(path)
        change(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
        return {}

    return setup


def _int8(t: dict[str, np.ndarray]) -> None:
    t[UP] = (t[UP] * 100).astype(np.int8)


def _nan(t: dict[str, np.ndarray]) -> None:
    t[UP][3, 4] = np.nan


def _inf(t: dict[str, np.ndarray]) -> None:
    t["model.embed_tokens.weight"][7] = -np.inf


def _rope(kind: dict) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        d.pop("rope_parameters", None)
        d["rope_scaling"] = kind

    return change


def _without_head_dim(**changes) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        d.pop("head_dim", None)
        d.update(changes)

    return change


def blocker(tmp: Path) -> dict[str, str]:
    (tmp / "blocker").write_text("x")
    return {"file": str(tmp / "blocker")}


CASES = [
    # 1, 2: config.json itself
    Case("config_is_a_list", CONVERT, ("hf/config.json", "JSON list"),
         setup=config_edit(lambda d: [d])),
    Case("heads_zero", CONVERT, ("hf/config.json", "num_attention_heads=0"),
         setup=config_edit(_without_head_dim(num_attention_heads=0))),
    Case("vocab_a_string", CONVERT, ("hf/config.json", "vocab_size='256'"),
         setup=config_edit(lambda d: d.update(vocab_size="256"))),
    Case("layers_negative", CONVERT, ("hf/config.json", "num_hidden_layers=-2"),
         setup=config_edit(lambda d: d.update(num_hidden_layers=-2))),
    Case("kv_heads_do_not_divide", CONVERT,
         ("hf/config.json", "num_attention_heads=4", "num_key_value_heads=3"),
         setup=config_edit(lambda d: d.update(num_key_value_heads=3))),
    Case("hidden_not_divisible", CONVERT,
         ("hf/config.json", "hidden_size=30", "num_attention_heads=4"),
         setup=config_edit(_without_head_dim(hidden_size=30))),
    Case("eps_a_string", CONVERT, ("hf/config.json", "rms_norm_eps='1e-6'"),
         setup=config_edit(lambda d: d.update(rms_norm_eps="1e-6"))),
    Case("tie_a_string", CONVERT, ("hf/config.json", "tie_word_embeddings='false'"),
         setup=config_edit(lambda d: d.update(tie_word_embeddings="false"))),
    Case("quantized_config", CONVERT, ("hf/config.json", "quantization_config", "gptq"),
         setup=config_edit(lambda d: d.update(quantization_config={"quant_method": "gptq"}))),
    Case("config_in_train", TRAIN, ("hf/config.json", "vocab_size='256'"),
         setup=config_edit(lambda d: d.update(vocab_size="256"))),
    # 3: RoPE scaling without its factors
    Case("rope_linear_without_factor", CONVERT, ("hf/config.json", "rope_scaling", "'factor'"),
         setup=config_edit(_rope({"rope_type": "linear"}))),
    Case("rope_llama3_without_low_freq", CONVERT,
         ("hf/config.json", "rope_scaling", "'low_freq_factor'"),
         setup=config_edit(_rope({"rope_type": "llama3", "factor": 8.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16}))),
    Case("rope_factor_a_string", CONVERT, ("hf/config.json", "rope_scaling.factor='2'"),
         setup=config_edit(_rope({"type": "linear", "factor": "2"}))),
    # 4, 5: the tensors
    Case("int8_tensor", CONVERT, (UP, "I8"), setup=tensor_edit(_int8)),
    Case("nan_weight", CONVERT, (UP, "1 NaN or infinite value"), setup=tensor_edit(_nan)),
    Case("inf_weight_in_train", TRAIN, ("model.embed_tokens.weight", "NaN or infinite"),
         setup=tensor_edit(_inf)),
    # 6, 7: export
    Case("export_moe", ["export", "--run", "{moe}", "--to-hf", "{tmp}/exported"],
         ("MixtralForCausalLM cannot express qkv_bias",)),
    Case("export_under_a_file", ["export", "--run", "{run}", "--to-hf", "{file}/exported"],
         ("--to-hf", "blocker", "is a file"), setup=blocker),
    # 8: model overrides against the checkpoint's config
    Case("convert_d_model_conflicts", [*CONVERT, "model.d_model=64"],
         ("model.d_model=64", "hidden_size=32", "hf/config.json")),
    Case("convert_vocab_conflicts", [*CONVERT, "model.vocab_size=300"],
         ("model.vocab_size=300", "vocab_size=256", "hf/config.json")),
    Case("convert_layers_conflict", [*CONVERT, "model.n_layers=4"],
         ("model.n_layers=4", "num_hidden_layers=2")),
    Case("convert_experts_conflict", [*CONVERT, "model.n_experts=4"],
         ("model.n_experts=4", "model.n_experts=0")),
    Case("train_d_model_conflicts", [*TRAIN, "model.d_model=64"],
         ("model.d_model=64", "hidden_size=32", "hf/config.json")),
]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    """The tiny Llama folder (Llama 3.1 RoPE scaling, untied embeddings)."""
    folder = tmp_path_factory.mktemp("hf-bad") / "llama"
    make_hf_model(folder, "llama31", **SIZES)
    return folder


@pytest.fixture(scope="module")
def dense_run(hf_model, tmp_path_factory) -> Path:
    """A run converted from the tiny Llama folder."""
    out = tmp_path_factory.mktemp("hf-bad-run") / "run"
    assert main(["convert", "--from-hf", str(hf_model), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    """A run of a tiny mixture-of-experts decoder (step 0, never trained) with biases on
    q/k/v but no shared experts: no Hugging Face family has that combination."""
    import jax

    from jaxpar.checkpoint.checkpointer import Checkpointer
    from jaxpar.config.assembly import assemble
    from jaxpar.config.schema import load_config

    out = tmp_path_factory.mktemp("hf-bad-moe") / "run"
    config = load_config(None, ["model.d_model=32", "model.n_layers=1", "model.d_ff=64",
                                "model.n_experts=4", "model.qkv_bias=true", "mesh.data=1",
                                "mesh.fsdp=-1"])
    trainer = assemble(config, devices=jax.devices()[:1]).trainer
    with Checkpointer(out / "checkpoints", every=1, keep=1) as checkpointer:
        checkpointer.save(trainer, config=config, force=True)
    return out



@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input_hf(case: Case, tmp_path, capsys, monkeypatch, hf_model, request):
    monkeypatch.chdir(ROOT)
    shutil.copytree(hf_model, tmp_path / "hf")
    argv = list(case.argv)
    for key, fixture in (("{moe}", "moe_run"), ("{run}", "dense_run")):
        if any(key in a for a in argv):  # the runs are made once, for the cases using them
            run = str(request.getfixturevalue(fixture))
            argv = [a.replace(key, run) for a in argv]
    argv = _prepare(dataclasses.replace(case, argv=argv), tmp_path)
    before = _snapshot(tmp_path)
    code, out, err = run_main(argv, capsys)
    _check(case, code, out, err)
    assert _snapshot(tmp_path) == before, "the folder changed"


def test_load_names_the_tensor(hf_model, tmp_path):
    """``jaxpar.hf.load`` itself: integer and non-finite tensors, and a config that
    contradicts the folder's, each a JaxparError naming the culprit."""
    import jax.numpy as jnp

    for change, culprit in ((_int8, f"{UP!r} is stored as I8"),
                            (_nan, f"{UP!r} holds 1 NaN"),
                            (_inf, "'model.embed_tokens.weight' holds 32 NaN or infinite")):
        folder = tmp_path / change.__name__
        shutil.copytree(hf_model, folder)
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(JaxparError) as err:
            hf.load(folder)
        assert culprit in str(err.value) and "\n" not in str(err.value), str(err.value)
    cfg, _ = hf.read_config(hf_model)
    with pytest.raises(JaxparError, match=r"model.d_ff=128 conflicts with "
                                          r"intermediate_size=64 in .*config.json"):
        hf.load(hf_model, config=dataclasses.replace(cfg, d_ff=128))
    model = hf.load(hf_model, config=dataclasses.replace(cfg, loss_chunk=4, max_seq_len=32))
    assert (model.config.loss_chunk, model.config.max_seq_len) == (4, 32)
    assert model(jnp.zeros((1, 8), jnp.int32)).shape == (1, 8, 256)


def test_full_disk_during_export(dense_run, tmp_path, capsys, monkeypatch):
    """A full disk mid-export: one line naming the folder and the free space; the earlier
    export there is left whole (and no half-written sibling remains). safetensors' own
    full-disk error: tests/storage/test_safetensors_io.py."""
    target = tmp_path / "exported"
    assert main(["export", "--run", str(dense_run), "--to-hf", str(target)]) == 0
    before = _snapshot(tmp_path)

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)  # part of a shard, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors_io, "save_file", full_disk)
    code, out, err = run_main(["export", "--run", str(dense_run), "--to-hf", str(target)], capsys)
    _check(Case("full_disk", [], (str(target), "no space left on device", "free there",
                                  "left as it was")), code, out, err)
    assert _snapshot(tmp_path) == before, "the earlier export changed"


def test_compatible_overrides_are_applied(hf_model, tmp_path, capsys):
    """``model.*`` overrides that leave the weights alone are kept (in the checkpoint's
    config and config.yaml); the model's shape stays the checkpoint's."""
    from jaxpar.runs.generate import load_run_model

    run = tmp_path / "run"
    code, _, err = run_main(["convert", "--from-hf", str(hf_model), "--out", str(run),
                         "model.max_seq_len=32", "model.loss_chunk=8", "model.attention=xla",
                         "model.d_model=32"], capsys)
    assert code == 0, err
    saved = yaml.safe_load((run / "config.yaml").read_text())
    _, config = load_run_model(run)
    for model in (saved["model"], dataclasses.asdict(config.model)):
        assert (model["max_seq_len"], model["loss_chunk"], model["attention"]) == (32, 8, "xla")
        assert (model["d_model"], model["n_layers"], model["vocab_size"]) == (32, 2, 256)
    assert saved["train"]["seq_len"] == 32  # the default, bounded by the new max_seq_len


def test_train_applies_compatible_overrides(hf_model, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = run_main(["train", "--out", str(run), f"init_from=hf:{hf_model}", *SMALL_RUN,
                         "train.steps=1", "model.max_seq_len=32", "model.loss_chunk=8",
                         "model.d_model=32"], capsys)
    assert code == 0, err
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert (saved["max_seq_len"], saved["loss_chunk"], saved["d_model"]) == (32, 8, 32)


def _convert_for_resume(hf_model: Path, run: Path, capsys) -> str:
    code, out, err = run_main(["convert", "--from-hf", str(hf_model), "--out", str(run),
                           *SMALL_RUN], capsys)
    assert code == 0, err
    return out


def _trained_steps(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if '"loss"' in line]


def test_convert_next_step_runs_as_printed(hf_model, tmp_path, capsys):
    run = tmp_path / "run"
    out = _convert_for_resume(hf_model, run, capsys)
    printed = out.split("continue with ", 1)[1].split(", or start")[0]
    argv = shlex.split(printed)
    assert argv[:2] == ["jaxpar", "train"], printed
    code, _, err = run_main(argv[1:], capsys)
    assert code == 0, err
    assert _trained_steps(run) == [1, 2]
