"""``jaxpar convert --from-hf`` (jaxpar.cli.convert): a Hugging Face folder as step 0 of a
run, checked against transformers, then exported again; what counts as such a folder."""

import json

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.cli.convert import check_hf_folder
from jaxpar.errors import JaxparError
from tests.cli import test_hf_commands
from tests.cli.test_hf_commands import _hf_logits, _jaxpar_logits
from tests.hf.test_convert import TOL

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

base = test_hf_commands.base
"""The tiny Hugging Face model of tests/cli/test_hf_commands.py (built again for this module)."""


def test_convert_then_train_from_it(base, tmp_path, capsys):
    folder, text = base
    run = tmp_path / "converted"
    assert main(["convert", "--from-hf", str(folder), "--out", str(run), "--devices", "8"]) == 0
    want = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(folder).eval())
    np.testing.assert_allclose(_jaxpar_logits(run), want, atol=TOL, rtol=0)
    out = tmp_path / "whole"
    assert main(["export", "--run", str(run), "--to-hf", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert np.abs(_hf_logits(back.eval()) - want).max() < 0.5  # bf16 weights only
    capsys.readouterr()
    for argv, message in (
        (["convert", "--from-hf", str(text), "--out", str(tmp_path / "y")],
         "has no config.json (not a Hugging Face model folder)"),
        (["convert", "--from-hf", str(folder), "--out", str(run)], "--resume"),
        (["export", "--run", str(run), "--to-hf", str(tmp_path / "y"), "--adapters"],
         "the run has no LoRA adapters; drop --adapters"),
        (["train", "--config", "configs/tiny.yaml", "init_from=hf:" + str(text)],
         "is not a Hugging Face model folder (no config.json)"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
    assert not (tmp_path / "y").exists()


def test_a_hugging_face_folder_is_one_with_config_json(tmp_path, monkeypatch):
    with pytest.raises(JaxparError, match=r"^--from-hf '.*nowhere' is not a folder$"):
        check_hf_folder(tmp_path / "nowhere")
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(JaxparError, match="is not a folder"):
        check_hf_folder(tmp_path / "weights.safetensors")
    with pytest.raises(JaxparError, match=r"^init_from '.*' has no config.json \(not a "
                                          r"Hugging Face model folder\)$"):
        check_hf_folder(tmp_path, what="init_from")
    (tmp_path / "config.json").write_text("{}")
    assert check_hf_folder(str(tmp_path)) == tmp_path
    monkeypatch.setenv("HOME", str(tmp_path))
    assert check_hf_folder("~") == tmp_path  # ~ is expanded
