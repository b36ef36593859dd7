"""``jaxpar sample`` (jaxpar.cli.sample): its arguments are checked, in order, before the
run is read; each mistake is one line with exit status 2. Sampling from trained runs is
tested in tests/runs/test_generate.py and tests/cli/test_bad_input_cli2.py."""

import pytest

from jaxpar.cli import main


@pytest.mark.parametrize("argv, culprit", [
    (["--run", "{tmp}/nowhere", "--prompt", "ab"], "does not exist"),
    (["--run", "{tmp}", "--prompt", "ab"], "holds no complete checkpoint"),
    (["--run", "{tmp}", "--prompt", ""], "--prompt is empty"),
    (["--run", "{tmp}", "--prompt", "ab", "--max-tokens", "-1"], "--max-tokens -1"),
    (["--run", "{tmp}", "--prompt", "ab", "--temperature", "-0.5"], "--temperature -0.5"),
])
def test_bad_sample_input_is_one_line(argv, culprit, tmp_path, capsys):
    code = main(["sample", *[a.replace("{tmp}", str(tmp_path)) for a in argv]])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("jaxpar: error:") and err.count("\n") == 1, err
    assert culprit in err


@pytest.mark.parametrize("flags, line", [
    (["--temperature", "inf"], "--temperature inf: must be 0 (greedy) or positive"),
    (["--temperature", "nan"], "--temperature nan: must be 0 (greedy) or positive"),
    (["--top-k", "-1"], "--top-k -1: must be 0 (every token) or positive"),
    (["--max-tokens", "-3", "--top-k", "-1"], "--max-tokens -3: must be 0 or more"),
])
def test_flags_are_checked_before_the_run_folder(flags, line, tmp_path, capsys):
    # The run folder does not exist: the flag's error comes first all the same.
    argv = ["sample", "--run", str(tmp_path / "nowhere"), "--prompt", "ab", *flags]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"jaxpar: error: {line}\n"


def test_zero_temperature_and_zero_top_k_pass_the_checks(tmp_path, capsys):
    # Both are the documented "off" values: the first complaint is then the run folder.
    argv = ["sample", "--run", str(tmp_path / "nowhere"), "--prompt", "ab",
            "--temperature", "0", "--top-k", "0", "--max-tokens", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "--temperature" not in err and "--top-k" not in err
