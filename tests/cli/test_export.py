"""``jaxpar export --to-hf`` (jaxpar.cli.export): a LoRA run exported as PEFT adapters and as
a merged model, checked against transformers and peft; where the export may go."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.adapters import lora
from jaxpar.cli import main
from jaxpar.cli.export import check_export_target
from jaxpar.errors import JaxparError
from jaxpar.runs.generate import load_run_model
from tests.cli import test_hf_commands
from tests.cli.test_hf_commands import _hf_logits, _jaxpar_logits
from tests.hf.test_convert import IDS, TOL

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

base = test_hf_commands.base
"""The tiny Hugging Face model of tests/cli/test_hf_commands.py (built again for this module)."""


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory):
    folder, text = base
    out = tmp_path_factory.mktemp("lora") / "run"
    code = main(["train", "--config", "configs/tiny-lora.yaml", "--devices", "8", "--out",
                 str(out), f"init_from=hf:{folder}", f"data.source={text}",
                 f"data.tokenizer={folder}", "mesh.fsdp=4", "mesh.tensor=2", "mesh.data=1",
                 "train.steps=4", "train.seq_len=16", "train.global_batch=8", "train.lr=0.05",
                 "train.eval_every=0", "checkpoint.every=4"])
    assert code == 0
    return out


def test_lora_on_a_hugging_face_model_exports_for_peft(base, lora_run, tmp_path, capsys):
    folder, _ = base
    tuned = _jaxpar_logits(lora_run)
    base_logits = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(folder).eval())
    assert np.abs(tuned - base_logits).max() > 100 * TOL  # the fine-tune changed something
    model, _ = load_run_model(lora_run)
    for _, lp in lora.adapted(model):  # with the adapters zeroed, the base model remains
        lp.lora_b.set_value(jnp.zeros_like(lp.lora_b.get_value()))
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS))), base_logits, atol=TOL,
                               rtol=0)

    adapters = tmp_path / "adapters"
    assert main(["export", "--run", str(lora_run), "--to-hf", str(adapters), "--adapters"]) == 0
    assert (adapters / "tokenizer.json").is_file()
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder) and config["r"] == 8
    # peft (4 s to import) only here, not in every worker's collection
    peft = pytest.importorskip("peft")
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with_peft = peft.PeftModel.from_pretrained(hf_base, adapters).eval()
    np.testing.assert_allclose(_hf_logits(with_peft), tuned, atol=TOL, rtol=0)

    merged = tmp_path / "merged"
    assert main(["export", "--run", str(lora_run), "--to-hf", str(merged), "--merge-lora"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    np.testing.assert_allclose(_hf_logits(back.eval()), tuned, atol=TOL, rtol=0)
    assert "wrote PEFT adapters" in capsys.readouterr().out

    for args, message in (
        ([], "the run trained LoRA adapters: pass --merge-lora"),
        (["--merge-lora", "--adapters"], "--merge-lora and --adapters exclude each other"),
    ):
        assert main(["export", "--run", str(lora_run), "--to-hf", str(tmp_path / "x"),
                     *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()


def test_export_target_checks(tmp_path, monkeypatch):
    with pytest.raises(JaxparError, match="--merge-lora and --adapters exclude each other"):
        check_export_target(tmp_path / "out", merge_lora=True, adapters=True)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(JaxparError, match=r"--to-hf '.*afile' is a file, not a folder"):
        check_export_target(afile, merge_lora=False, adapters=False)
    # A file on the way to the target: named as the culprit.
    with pytest.raises(JaxparError, match=rf"'{afile}' is a file, not a folder"):
        check_export_target(afile / "deeper" / "out", merge_lora=False, adapters=True)
    # A folder that does not exist yet (nor its parent), and one that does: both fine.
    nested = tmp_path / "new" / "hf"
    assert check_export_target(nested, merge_lora=True, adapters=False) == nested
    assert check_export_target(tmp_path, merge_lora=False, adapters=False) == tmp_path
    monkeypatch.setenv("HOME", str(tmp_path))
    assert check_export_target("~/hf", merge_lora=False, adapters=False) == tmp_path / "hf"
