"""Every snippet of the README and the docs site runs as printed, and prints what it quotes
(see :mod:`tests.docs_snippets`): one fresh process per page, as a reader starts one
(``python tests/docs_snippets.py PAGE``, forked by a server that imported jaxpar once:
:func:`tests.docs_snippets.serve_pages`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from tests.docs_snippets import ROOT, check_output, commands, line_matches, page_blocks, pages


@pytest.fixture(scope="module")
def run_page(tmp_path_factory):
    """``run_page(page)``: (exit status, stdout, stderr) of ``python tests/docs_snippets.py
    PAGE``, run by one ``--serve`` process for this module."""
    folder = tmp_path_factory.mktemp("pages")
    mine, theirs = socket.socketpair()
    with (folder / "server.log").open("w") as log:
        server = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "docs_snippets.py"), "--serve",
             str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdout=log,
            stderr=subprocess.STDOUT)
    theirs.close()
    conn = Connection(mine.detach())

    def run(page: Path, timeout: float = 900) -> tuple[int, str, str]:
        out, err = folder / f"{page.stem}.out", folder / f"{page.stem}.err"
        out.write_text("")
        err.write_text("")
        try:
            conn.send((str(page), str(out), str(err), dict(os.environ)))
            pid = conn.recv()
        except (EOFError, OSError):
            raise AssertionError("the page server stopped:\n"
                                 + (folder / "server.log").read_text()[-4000:]) from None
        if not conn.poll(timeout):
            os.kill(pid, signal.SIGKILL)
            conn.recv()  # its status: the next page's is the next answer
            raise subprocess.TimeoutExpired(f"docs_snippets.py {page}", timeout)
        return conn.recv(), out.read_text(), err.read_text()

    yield run
    conn.close()
    server.wait(timeout=60)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_runs_as_printed(page, run_page):
    status, stdout, stderr = run_page(page)
    assert status == 0, (stdout[-3000:] + stderr[-6000:])


def test_quoted_numbers_are_compared_within_tolerance():
    assert line_matches("step 10: loss 2.31", "step 10:   loss 2.3120")
    assert not line_matches("loss 2.31 at step 10", "loss 2.61 at step 10")
    assert line_matches("bubble 27.3% ... 4 in flight", "bubble 27.3% of 22 ticks, 4 in flight")
    assert not line_matches("stage=2 tensor=4", "stage=2 fsdp=2 tensor=2")
    with pytest.raises(AssertionError, match="not printed"):
        check_output("a 1\nb 2", "b 2\na 1", "here")


def test_blocks_commands_and_outputs_are_read_from_the_markdown(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("x\n\n```python\nprint(1)\n```\n\n```text\n1\n```\n\n<!-- exits 2 -->\n"
                    "```bash\n# a comment\njaxpar plan \\\n  --seq 8\n```\n")
    py, sh = page_blocks(page)
    assert (py.lang, py.output, sh.note) == ("python", "1\n", "exits 2")
    assert commands(sh.body) == ["jaxpar plan    --seq 8"]


def test_what_is_shown_without_running_is_listed_with_its_reason():
    """A block the tests do not run needs a reason, and there are few: each one here."""
    shown = [(str(p.relative_to(ROOT)), b.note.removeprefix("not run:").strip())
             for p in pages() for b in page_blocks(p) if b.note.startswith("not run:")]
    assert all(reason for _, reason in shown), shown
    assert sorted(page for page, _ in shown) == [
        "docs/benchmarks/tpu-compile.md",  # a 22B-wide step compiled for 64 TPU v4 chips
        "docs/benchmarks/vs-maxtext.md",  # installs MaxText from PyPI, then minutes
        "docs/get-started/first-run.md",  # make train's 200 steps (run below cut to 4)
        "docs/get-started/install.md",  # a second install (make test does it)
        "docs/guides/data.md",  # a real bucket: a Cloud project and credentials
        "docs/guides/lora.md",  # a 300-step base then fine-tune pair
        "docs/guides/memory.md",  # the 8B step compiled for a TPU, minutes each
        "docs/guides/multihost.md",  # hosts by hand: tests/runs/test_pod_rehearsal.py
        "docs/guides/multihost.md",  # gcloud: a Cloud project and a TPU pod
        "docs/guides/slices.md",  # launch --replicas: tests/cli/test_replicas.py runs it
        "docs/guides/slices.md",  # and its refusal to reuse a folder (the same file)
        "docs/guides/watching.md",  # calibrate: planner.md runs it, and test_calibrate.py
        "docs/guides/watching.md",  # MFU from a catalog: tests/runs/test_monitor.py
        "docs/guides/watching.md",  # an offline W&B run: tests/runs/test_trackers.py
    ]
