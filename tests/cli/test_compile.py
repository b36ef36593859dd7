"""``jaxpar compile`` (jaxpar.cli.inspection) for a TPU slice that is not here, its saved
executable run by ``jaxpar train --compiled``, and ``jaxpar plan --verify``. (The
persistent compilation cache of ``jaxpar train``, jaxpar.runs.compile_cache: two runs
sharing one in docs/guides/tpu-compile.md, which the docs tests run.)"""

import json
from pathlib import Path

import pytest

from jaxpar import cli
from tests.cli.test_train import SMALL_RUN, jaxpar_cli

pytest.importorskip("libtpu", reason="the TPU compiler (pip install 'jax[tpu]')")

TINY = ["model.n_layers=2", "model.d_model=256", "model.n_heads=2", "model.n_kv_heads=2",
        "model.d_ff=512", "train.global_batch=8", "train.seq_len=128", "mesh.data=1",
        "mesh.fsdp=-1"]


def test_compile_for_a_tpu_prints_memory_against_hbm(capfd, tmp_path):
    hlo = tmp_path / "step.hlo"
    assert cli.main(["compile", "--target", "tpu-v6e:2x2", "--config", "configs/tiny.yaml",
                     "--dump-hlo", str(hlo), *TINY, "model.attention=splash"]) == 0
    out, err = capfd.readouterr()
    # libtpu's start-up errors (no TPU here), when this process starts it, are one line
    assert not any(w in err for w in ("E0000", "TPU_WORKER_HOSTNAMES", "InitGoogle")), err
    assert out.startswith("jaxpar compile: configs/tiny.yaml for tpu-v6e:2x2 (4 TPU v6 lite "
                          "devices, 1 slice; the TPU compiler, run here), mesh fsdp=4")
    assert "  fits: " in out and " of 32.00 GiB per device (" in out
    assert "Pallas/Mosaic kernels compiled for the TPU: 3 tpu_custom_call(s)" in out
    assert 'custom_call_target="tpu_custom_call"' in hlo.read_text()


def test_compile_json_has_the_inspect_keys_and_hbm(capsys):
    args = ["--config", "configs/tiny.yaml", *TINY, "train.global_batch=4"]
    assert cli.main(["compile", "--target", "tpu-v5e:2x2", "--json", *args]) == 0
    tpu = json.loads(capsys.readouterr().out)
    assert cli.main(["inspect", "--json", *args, "mesh.fsdp=4", "mesh.tensor=2"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert set(tpu) == set(cpu) and set(tpu["memory"]) == set(cpu["memory"])
    assert tpu["memory"]["hbm_bytes"] == 16 * 2**30 and tpu["memory"]["fits"] is True
    assert tpu["header"]["platform"] == "tpu" and tpu["header"]["device_kind"] == "TPU v5 lite"
    # auto knobs resolved for the target's chips, as jaxpar train on them would
    from jaxpar.analysis.targets import parse_target
    from jaxpar.config.schema import load_config
    from jaxpar.planner.auto import resolve_auto

    config = load_config("configs/tiny.yaml", args[2:])
    said = resolve_auto(config, 4, parse_target("tpu-v5e:2x2", 1).machine)[1]
    assert tpu["header"]["auto"] == said and "the planner on tpu-v5e" in said[0]


@pytest.mark.parametrize("args, says", [
    (["--target", "tpu-v5q:2x2"], "must name a TPU slice as tpu-GEN:TOPOLOGY"),
    (["--target", "tpu-v5e:2x2", "--devices", "8"], "--devices simulates CPU devices"),
    (["--target", "cpu", "--slices", "2"], "--slices needs a TPU --target"),
    (["--target", "tpu-v5e:2x2", "--dump-hlo", "."], "--dump-hlo '.' is a folder"),
    # a user's file is never replaced unasked (this was the config itself, overwritten)
    (["--target", "cpu", "--dump-hlo", "configs/tiny.yaml"],
     "--dump-hlo 'configs/tiny.yaml' exists; pass --force to replace it, or name another"),
    (["--target", "cpu", "--dump-hlo", "no/such/x.hlo"],
     "--dump-hlo 'no/such/x.hlo': folder 'no/such' does not exist; create it first"),
    (["--target", "cpu", "--dump-hlo", "gs://b/x.hlo"],
     "--dump-hlo 'gs://b/x.hlo': gs:// storage is not supported"),
    (["--target", "cpu", "--save", "s3://b/aot"], "--save 's3://b/aot': s3:// storage is not "
                                                  "supported"),
    (["--target", "cpu", "--save", "configs"],
     "--save 'configs' exists and is not empty; pass --force to replace it"),
    (["--target", "cpu", "--save", "configs/tiny.yaml"],
     "--save 'configs/tiny.yaml' is a file; name a folder"),
    (["--target", "cpu", "--save", "no/such/aot"], "folder 'no/such' does not exist"),
])
def test_bad_compile_arguments_are_one_line(args, says, capsys):
    assert cli.main(["compile", "--config", "configs/tiny.yaml", *args, *TINY]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not Path("s3:").exists() and not Path("gs:").exists()


def test_a_saved_step_trains_as_the_jitted_one_and_refuses_another_config(tmp_path, capsys):
    """Compiled and saved for this host's 8 devices, the step trains as the jitted one; a
    run of another config, or on 4 devices (a process of its own), is refused in one line.
    (What a second run loads from the compile cache: docs/guides/tpu-compile.md runs it.)"""
    saved = tmp_path / "aot"
    assert cli.main(["compile", "--target", "cpu", "--devices", "8", "--config",
                     "configs/tiny.yaml", "--save", str(saved), *SMALL_RUN]) == 0
    assert {p.name for p in saved.iterdir()} == {"executable.pkl", "manifest.json",
                                                  "config.yaml"}
    runs = {}
    for name, extra in (("jit", []), ("aot", ["--compiled", str(saved)])):
        out = tmp_path / name
        capsys.readouterr()
        assert cli.main(["train", "--config", "configs/tiny.yaml", "--devices", "8",
                         "--out", str(out), *extra, *SMALL_RUN]) == 0
        runs[name] = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").open()]
    out = capsys.readouterr().out
    assert "running the step compiled ahead of time" in out
    # plan.vocab_over_fsdp=auto takes what the step was compiled with
    assert f"plan.vocab_over_fsdp=auto -> false (as compiled in {str(saved)!r})" in out
    assert runs["aot"] == runs["jit"]
    assert cli.main(["train", "--config", "configs/tiny.yaml", "--devices", "8",
                     "--compiled", str(saved), *SMALL_RUN, "train.global_batch=16"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"jaxpar: error: --compiled {str(saved)!r} was compiled for another config: "
        "train.global_batch=16 (compiled with 8)")
    proc = jaxpar_cli("train", "--config", "configs/tiny.yaml", "--devices", "4",
                      "--compiled", str(saved), *SMALL_RUN)
    assert proc.returncode == 2 and "compiled for cpu (8 cpu devices)" in proc.stderr


def test_plan_verify_compiles_the_plans_for_the_tpu(capsys):
    assert cli.main(["plan", "--model", "configs/tiny.yaml", "--chips", "tpu-v5e:4",
                     "--global-batch", "8", "--seq", "128", "--top", "2",
                     "--verify", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)  # the progress lines go to stderr: stdout is the JSON alone
    assert rows[0]["compiler_bytes"] > 0 and "compiler_bytes" not in rows[1]
    assert "verify #1: the TPU compiler needs " in err and "verify #2" not in err
    assert cli.main(["plan", "--model", "configs/tiny.yaml", "--chips", "b200:8",
                     "--global-batch", "8", "--seq", "128", "--verify", "1"]) == 2
    assert "--verify compiles with the TPU or GPU compiler" in capsys.readouterr().err


def test_plan_verify_compiles_the_plans_for_gpus(capsys):
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU compiler")
    assert cli.main(["plan", "--model", "configs/tiny.yaml", "--chips", "h100:8",
                     "--global-batch", "32", "--seq", "256", "--top", "1",
                     "--verify", "1", "--json", "model.attention=xla"]) == 0  # no cuDNN
    out, err = capsys.readouterr()
    assert json.loads(out)[0]["compiler_bytes"] > 0
    assert "verify #1: the GPU compiler needs " in err


@pytest.fixture(scope="module")
def saved_for_tpu(tmp_path_factory):
    """A tiny step compiled for tpu-v5e:2x2 and saved by ``jaxpar compile --save``."""
    saved = tmp_path_factory.mktemp("compiled") / "tpu"
    assert cli.main(["compile", "--target", "tpu-v5e:2x2", "--config", "configs/tiny.yaml",
                     "--save", str(saved), *TINY, *SMALL_RUN[-3:]]) == 0
    return saved


def test_a_step_saved_for_a_tpu_is_refused_on_other_devices(saved_for_tpu):
    """What ``jaxpar train --compiled`` on 4 CPU devices reads the folder with: one line."""
    import jax

    import jaxpar
    from jaxpar.analysis.executables import load_compiled, with_compiled_auto
    from jaxpar.errors import JaxparError

    saved = saved_for_tpu
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["device_kind"] == "TPU v5 lite" and manifest["versions"]["libtpu"] != "-"
    assert not list(saved.parent.glob(".tpu.jaxpar-*"))  # the staging folder was swapped in
    config = jaxpar.load_config("configs/tiny.yaml", [*TINY, *SMALL_RUN[-3:]])
    config, _ = with_compiled_auto(saved, config)  # as the run does: auto knobs as compiled
    with pytest.raises(JaxparError) as got:
        load_compiled(saved, config, jax.devices()[:4])
    assert str(got.value) == (
        f"--compiled {str(saved)!r} was compiled for tpu-v5e:2x2 (4 TPU v5 lite devices); "
        "this run has 4 cpu devices")


def _cut(path):
    path.write_bytes(path.read_bytes()[:100])


@pytest.mark.parametrize("damage, says", [
    (_cut, "executable.pkl is not the executable its manifest.json was written with"),
    (lambda p: p.with_name("manifest.json").write_text("{garbage"),
     "manifest.json is damaged (JSONDecodeError: "),
    (lambda p: p.with_name("config.yaml").unlink(), "config.yaml is missing"),
    (lambda p: p.with_name("config.yaml").write_text("model: [\n"), "config.yaml is "),
])
def test_a_damaged_compiled_folder_is_one_line(saved_for_tpu, tmp_path, damage, says):
    """A folder cut short, garbled, or holding another compile's executable: one line
    naming the folder and the way out, not an UnpicklingError (or a shape error at the
    first step)."""
    import shutil

    import jax

    import jaxpar
    from jaxpar.analysis.executables import load_compiled
    from jaxpar.errors import JaxparError

    folder = tmp_path / "aot"
    shutil.copytree(saved_for_tpu, folder)
    damage(folder / "executable.pkl")
    config = jaxpar.load_config("configs/tiny.yaml", [*TINY, *SMALL_RUN[-3:]])
    with pytest.raises(JaxparError) as got:
        load_compiled(folder, config, jax.devices()[:4])
    line = str(got.value)
    assert line.startswith(f"--compiled {str(folder)!r}: {says}") and "\n" not in line
    assert line.endswith(f"compile it again with jaxpar compile --save {str(folder)!r} "
                         "--force")


def test_a_full_disk_keeps_the_earlier_outputs(monkeypatch, tmp_path, capsys):
    """--dump-hlo and --save on a full disk: one line; the file --force would replace and
    the folder are as they were, no half file or staging folder is left."""
    import errno

    from jaxpar.storage import folders

    def full_disk(file, data):
        file.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(folders, "_write_all", full_disk)
    hlo, saved = tmp_path / "step.hlo", tmp_path / "aot"
    hlo.write_text("earlier\n")
    args = ["compile", "--target", "cpu", "--config", "configs/tiny.yaml", *SMALL_RUN]
    assert cli.main([*args, "--dump-hlo", str(hlo), "--force"]) == 2
    err = capsys.readouterr().err
    assert err == (f"jaxpar: error: --dump-hlo {str(hlo)!r}: could not write: no space left "
                   f"on device ({err.split('device (')[1].split(' free')[0]} free there); "
                   f"{str(hlo)!r} is left as it was\n")
    assert hlo.read_text() == "earlier\n"
    assert cli.main([*args, "--save", str(saved)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxpar: error: --save {str(saved)!r}: could not write: no space "
                          "left on device (") and err.endswith("; nothing was written\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.hlo"]


def test_sigterm_during_the_compile_is_one_line_and_143(monkeypatch, tmp_path, capsys):
    """A scheduler's SIGTERM while XLA compiles: answered at once (the compile runs in a
    worker thread), one line, exit 143, no --dump-hlo written; the handlers are restored."""
    import os
    import signal
    import threading

    from jaxpar.analysis import inspection

    started, release = threading.Event(), threading.Event()

    def slow_compile(config, target):
        started.set()
        release.wait(30)
        raise AssertionError("the compile was not abandoned")

    monkeypatch.setattr(inspection, "compile_step", slow_compile)
    threading.Thread(target=lambda: started.wait(30) and os.kill(os.getpid(), signal.SIGTERM),
                     daemon=True).start()
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.main(["compile", "--target", "cpu", "--config", "configs/tiny.yaml",
                         "--dump-hlo", str(tmp_path / "x.hlo"), *SMALL_RUN]) == 143
    finally:
        release.set()
    assert capsys.readouterr().err == ("jaxpar: stopped by SIGTERM during the compile; "
                                       "nothing was written\n")
    assert signal.getsignal(signal.SIGTERM) is before and not any(tmp_path.iterdir())
