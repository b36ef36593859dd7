"""Run a documentation page's snippets as a reader would, and compare what they print.

A page's fenced blocks run in document order, in a fresh work folder (``configs/``,
``examples/``, ``benchmarks/``, ``notebooks/``, ``tests/`` and the ``Makefile`` of the
repository linked into it, so the commands are typed as in a clone) on 8 simulated CPU
devices:

* ```` ```python ```` blocks run in one interpreter, one namespace for the whole page (a
  page reads top to bottom like a notebook: a later block may use what an earlier one
  defined, nothing else is given);
* ```` ```bash ```` blocks run command by command in bash (a ``\\`` continues a line,
  ``#`` lines are comments, ``export`` lines set the environment of what follows); a
  ``make TARGET`` line runs as ``make -n TARGET`` (what it would do: ``make test`` from a
  test is a loop, and ``make train`` is the test suite's own training run). A plain
  ``jaxpar ...`` command (no shell syntax, the page's starting environment) runs as the
  ``jaxpar`` script would, in a process of its own forked from one that has imported
  jaxpar's command modules and nothing else (no JAX backend started): the same program
  without the 2-3 s of imports each command's process would spend (:class:`Forker`);
* a ```` ```text ```` block right after one of them is what it prints: its non-empty
  lines must appear, in order, among the lines printed (spaces collapsed; numbers within
  :data:`TOLERANCE` of the quoted ones; ``...`` inside a line skips any text), so a
  stale figure fails.

A comment before a block changes that: ``<!-- exits 2 -->`` (the commands must end with
that status: a documented refusal) and ``<!-- not run: why -->`` (shown only; the reason
is required and the tests list these). Command: ``python tests/docs_snippets.py PAGE``
(with ``DOCS_SNIPPET_TIMES=1`` it also says on stderr how long each block took).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINKED = ("configs", "examples", "benchmarks", "notebooks", "tests", "Makefile",
          "pyproject.toml", "jaxpar")
TOLERANCE = 0.05  # relative, for every number of a quoted output
TIMES_ENV = "DOCS_SNIPPET_TIMES"
_FENCE = re.compile(r"(?:<!--\s*(?P<note>[^>]*?)\s*-->\s*\n)?```(?P<lang>\w*)[^\n]*\n"
                    r"(?P<body>.*?)^```[ \t]*$", re.S | re.M)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", re.I)


@dataclass
class Block:
    """One fenced block: its language, text, the comment before it and its line."""

    lang: str
    body: str
    note: str
    line: int
    output: str | None = None  # the ```text block quoting what it prints
    end: int = 0  # where the block ends in the page's text


def page_blocks(path: Path) -> list[Block]:
    """The page's runnable blocks in order, each with the output block that follows it."""
    text = path.read_text()
    blocks: list[Block] = []
    for m in _FENCE.finditer(text):
        lang, note = m["lang"], (m["note"] or "")
        block = Block(lang, m["body"], note, text.count("\n", 0, m.start("body")))
        if lang == "text" and blocks and blocks[-1].output is None and (
                text[blocks[-1].end:m.start()].strip() == ""):
            blocks[-1].output = m["body"]
            continue
        if lang in ("python", "bash"):
            block.end = m.end()
            blocks.append(block)
    return blocks


def commands(body: str) -> list[str]:
    """The shell commands of a bash block: continuations joined, comments dropped."""
    out: list[str] = []
    pending = ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def _close(quoted: str, actual: str) -> bool:
    q, a = float(quoted), float(actual)
    return abs(q - a) <= TOLERANCE * max(abs(q), abs(a)) or abs(q - a) < 10 ** -_decimals(
        quoted) * 1.01


def _decimals(number: str) -> int:
    return len(number.split(".")[1].split("e")[0]) if "." in number else 0


def line_matches(quoted: str, actual: str) -> bool:
    """Whether a printed line says what the quoted one says (see the module docstring)."""
    q, a = " ".join(quoted.split()), " ".join(actual.split())
    pattern, numbers = [], []
    for part in re.split(r"(\.\.\.|" + _NUMBER.pattern + ")", q, flags=re.I):
        if part == "...":
            pattern.append(".*?")
        elif part and _NUMBER.fullmatch(part):
            pattern.append("(" + _NUMBER.pattern + ")")
            numbers.append(part)
        else:
            pattern.append(re.escape(part or ""))
    m = re.search("".join(pattern), a, re.I)
    return bool(m) and all(_close(n, g) for n, g in zip(numbers, m.groups(), strict=True))


def check_output(quoted: str, printed: str, where: str) -> None:
    """Every non-empty quoted line, in order, among the printed lines."""
    lines = printed.splitlines()
    at = 0
    for q in quoted.splitlines():
        if not q.strip() or q.strip() == "...":
            continue
        for i in range(at, len(lines)):
            if line_matches(q, lines[i]):
                at = i + 1
                break
        else:
            raise AssertionError(f"{where}: the quoted line\n  {q}\nis not printed (after line "
                                 f"{at}); printed:\n{printed[-4000:]}")


def _exit_status(note: str) -> int:
    m = re.fullmatch(r"exits (\d+)", note)
    return int(m[1]) if m else 0


_SHELL = re.compile(r"[|&;<>()$`\\*?\[\]{}~!#'\n]")
"""Characters that make a command line more than a program and its arguments for bash."""
PRELOADED = ("jaxpar.cli", "jaxpar.cli.train", "jaxpar.runs.loop", "jaxpar.cli.plan",
             "jaxpar.cli.inspection", "jaxpar.cli.sample", "jaxpar.cli.convert",
             "jaxpar.cli.export", "jaxpar.cli.launch", "jaxpar.cli.calibrate",
             "jaxpar.cli.goodput", "jaxpar.cli.tokenize_corpus")
"""What the :class:`Forker` imports before it forks a command: the ``jaxpar`` commands'
modules (each command's own process imports its module and most of the rest)."""


def forkable(command: str) -> list[str] | None:
    """The arguments of a plain ``jaxpar ...`` command line (what bash would pass the
    ``jaxpar`` script), or None when the line uses any shell syntax."""
    if not command.startswith("jaxpar ") or _SHELL.search(command):
        return None
    return shlex.split(command)[1:]


class Forker:
    """Runs ``jaxpar`` commands as the ``jaxpar`` script runs them, each in a process of its
    own, forked from a process that imported :data:`PRELOADED` once (itself forked when
    this object is made, before anything else happens in this process: no JAX backend, no
    temporary folder or other state a fork would carry into a command). A command's process sets
    up what a fresh Python running the script has (``sys.argv``, ``sys.path[0]``, the
    working folder, stdout and stderr on one file, buffered as Python buffers them) and
    ends as an interpreter ends (threads joined, ``atexit`` functions run, streams
    flushed). Only for the environment it started in: imported modules may have read it.
    """

    def __init__(self, env: dict[str, str]):
        from multiprocessing.connection import Pipe

        self.env = dict(env)
        self.script = shutil.which("jaxpar", path=env.get("PATH"))
        self._conn, theirs = Pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the server: imports, then forks one process per command
            self._conn.close()
            try:
                _serve(theirs, self.script)
            finally:
                os._exit(0)
        theirs.close()

    def run(self, args: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
        """``jaxpar ARGS`` in ``cwd``: (exit status as bash reports it, stdout + stderr)."""
        fd, out = tempfile.mkstemp(prefix="jaxpar-docs-command-")
        os.close(fd)
        try:
            self._conn.send((args, str(cwd), out))
            pid = self._conn.recv()
        except (EOFError, OSError) as err:  # the server is gone: its imports failed
            os.unlink(out)
            raise RuntimeError("the jaxpar command server stopped; run the page's "
                               "commands in bash to see why") from err
        try:
            if not self._conn.poll(timeout):
                os.kill(pid, signal.SIGKILL)
                self._conn.recv()  # its status: the next command's is the next answer
                raise subprocess.TimeoutExpired(["jaxpar", *args], timeout)
            status = self._conn.recv()
            return status, Path(out).read_text()  # as subprocess.run(text=True) reads it
        finally:
            os.unlink(out)

    def close(self) -> None:
        self._conn.close()
        os.waitpid(self.pid, 0)


def preload() -> None:
    """Import :data:`PRELOADED` (no JAX backend may start)."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    from jax._src import xla_bridge

    assert not xla_bridge._backends, "importing jaxpar started a JAX backend"


def _serve(conn, script: str) -> None:
    """The :class:`Forker`'s server: import, then fork a command per request."""
    preload()
    while True:
        try:
            args, cwd, out = conn.recv()
        except EOFError:
            return
        pid = os.fork()
        if pid == 0:
            conn.close()
            _command(script, args, cwd, out)  # never returns
        conn.send(pid)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        conn.send(code if code >= 0 else 128 - code)  # bash's status for a signal


def _command(script: str, args: list[str], cwd: str, out: str) -> None:
    """In a forked process: be ``jaxpar ARGS`` started fresh, output to ``out``, then exit."""
    def run() -> object:
        os.chdir(cwd)
        sys.path[0] = os.path.dirname(script)
        from jaxpar.cli import main

        return main()

    as_process(run, [script, *args], out, out)


def as_process(run: Callable[[], object], argv: list[str], out: str, err: str) -> None:
    """In a forked process: be a fresh Python process whose ``sys.argv`` is ``argv``, stdout
    goes to the file ``out`` and stderr to ``err`` (the same file: as one pipe), that runs
    ``run`` as its program; then exit as an interpreter exits (threads joined, ``atexit``
    functions run, streams flushed), with ``run``'s value as ``sys.exit`` takes it."""
    import atexit
    import threading
    import traceback

    code: object = 1
    try:
        fd = os.open(out, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.close(fd)
        fd = os.open(err, os.O_WRONLY | os.O_APPEND) if err != out else os.dup(1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.argv = argv
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        encoding, errors = sys.stdout.encoding, sys.stdout.errors
        # As Python opens them for a process whose stdout and stderr are files.
        streams = []
        for fd in (1, 2):
            raw = io.FileIO(fd, "w", closefd=False)
            streams.append(raw if unbuffered else io.BufferedWriter(raw))
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(
            streams[0], encoding=encoding, errors=errors, write_through=unbuffered)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            streams[1], encoding=encoding, errors="backslashreplace", line_buffering=True,
            write_through=unbuffered)
        code = run()
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:  # how an interpreter ends: threads joined, atexit functions, streams
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit((code or 0) & 0xFF if isinstance(code, int) else 1)


def run_page(path: Path, work: Path, forker: Forker | None = None) -> list[str]:
    """Run a page's blocks in ``work``; returns what was shown only (``not run``).
    Raises AssertionError naming the page line of the first block that fails. With a
    ``forker``, plain ``jaxpar`` commands run through it (see :class:`Forker`)."""
    for name in LINKED:
        if not (work / name).exists():
            (work / name).symlink_to(ROOT / name)
    os.chdir(work)
    sys.path.insert(0, str(work))
    env = dict(os.environ)
    shown_only: list[str] = []
    namespace: dict = {"__name__": "__main__"}
    timed = bool(os.environ.get(TIMES_ENV))
    for block in page_blocks(path):
        started = time.monotonic()
        where = f"{path.relative_to(ROOT)}:{block.line}"
        if block.note.startswith("not run:"):
            reason = block.note.removeprefix("not run:").strip()
            assert reason, f"{where}: 'not run' needs a reason"
            shown_only.append(f"{where}: {reason}")
            continue
        if block.lang == "python":
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                exec(compile(block.body, where, "exec"), namespace)  # noqa: S102
            printed = buffer.getvalue()
            sys.stdout.write(printed)
        else:
            printed = ""
            want = _exit_status(block.note)
            for command in commands(block.body):
                if command.startswith("export "):
                    name, _, value = command.removeprefix("export ").partition("=")
                    env[name] = os.path.expandvars(value.strip("'\""))
                    continue
                args = forkable(command)
                if forker is not None and args is not None and env == forker.env:
                    status, said = forker.run(args, work, timeout=600)
                else:
                    run = re.sub(r"^make (?!-n)", "make -n ", command)
                    done = subprocess.run(["bash", "-c", run], cwd=work, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          timeout=600)
                    status, said = done.returncode, done.stdout
                printed += said
                sys.stdout.write(f"$ {command}\n{said}")
                assert status == want, (
                    f"{where}: `{command}` exited {status} (expected {want}):\n"
                    f"{said[-4000:]}")
        if block.output is not None:
            check_output(block.output, printed, where)
        if timed:
            print(f"{where} ({block.lang}): {time.monotonic() - started:.1f} s", file=sys.stderr)
    return shown_only


def pages() -> list[Path]:
    """The README and every page of the docs site (the generated ones are not files)."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def main(argv: list[str]) -> int:
    """Run one page (a path) in a temporary folder; print what was shown only."""
    os.environ.setdefault("XLA_FLAGS", "")
    if "force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    page = Path(argv[0]).resolve()
    # Forked first, while this process is bare; worth it from two commands on.
    forker = Forker(dict(os.environ)) if sum(
        forkable(c) is not None for b in page_blocks(page) if b.lang == "bash"
        and not b.note.startswith("not run:") for c in commands(b.body)) >= 2 else None
    try:
        with tempfile.TemporaryDirectory(prefix="jaxpar-docs-") as work:
            for line in run_page(page, Path(work), forker):
                print(f"SHOWN ONLY {line}")
    finally:
        if forker is not None:
            forker.close()
    return 0


def serve_pages(conn) -> None:
    """``python tests/docs_snippets.py --serve FD``: import :data:`PRELOADED`, then run each
    page asked for on the connection (file descriptor ``FD``: ``(page, stdout file,
    stderr file, environment)``, answered with the process id, then the exit status) as
    ``python tests/docs_snippets.py PAGE`` would, in a process forked for it (see
    :func:`as_process`): one fresh process per page, without its imports (tests/test_docs.py)."""
    preload()
    while True:
        try:
            page, out, err, env = conn.recv()
        except EOFError:
            return
        pid = os.fork()
        if pid == 0:
            conn.close()
            os.environ.clear()  # the environment it would have started with
            os.environ.update(env)
            as_process(functools.partial(main, [page]), [sys.argv[0], page], out, err)
        conn.send(pid)
        _, status = os.waitpid(pid, 0)
        conn.send(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        from multiprocessing.connection import Connection

        serve_pages(Connection(int(sys.argv[2])))
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
