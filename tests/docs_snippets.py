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
  test is a loop, and ``make train`` is the test suite's own training run);
* a ```` ```text ```` block right after one of them is what it prints: its non-empty
  lines must appear, in order, among the lines printed (spaces collapsed; numbers within
  :data:`TOLERANCE` of the quoted ones; ``...`` inside a line skips any text), so a
  stale figure fails.

A comment before a block changes that: ``<!-- exits 2 -->`` (the commands must end with
that status: a documented refusal) and ``<!-- not run: why -->`` (shown only; the reason
is required and the tests list these). Command: ``python tests/docs_snippets.py PAGE``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINKED = ("configs", "examples", "benchmarks", "notebooks", "tests", "Makefile",
          "pyproject.toml", "jaxpar")
TOLERANCE = 0.05  # relative, for every number of a quoted output
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


def run_page(path: Path, work: Path) -> list[str]:
    """Run a page's blocks in ``work``; returns what was shown only (``not run``).
    Raises AssertionError naming the page line of the first block that fails."""
    for name in LINKED:
        if not (work / name).exists():
            (work / name).symlink_to(ROOT / name)
    os.chdir(work)
    sys.path.insert(0, str(work))
    env = dict(os.environ)
    shown_only: list[str] = []
    namespace: dict = {"__name__": "__main__"}
    for block in page_blocks(path):
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
                run = re.sub(r"^make (?!-n)", "make -n ", command)
                done = subprocess.run(["bash", "-c", run], cwd=work, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      timeout=600)
                printed += done.stdout
                sys.stdout.write(f"$ {command}\n{done.stdout}")
                assert done.returncode == want, (
                    f"{where}: `{command}` exited {done.returncode} (expected {want}):\n"
                    f"{done.stdout[-4000:]}")
        if block.output is not None:
            check_output(block.output, printed, where)
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
    with tempfile.TemporaryDirectory(prefix="jaxpar-docs-") as work:
        for line in run_page(Path(argv[0]).resolve(), Path(work)):
            print(f"SHOWN ONLY {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
