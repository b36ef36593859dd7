"""MkDocs hook: the parts of the site written from the code, at every build.

A page line ``<!-- insert: NAME -->`` is replaced by what :data:`GENERATORS` [NAME] writes:
the command line reference (from the ``argparse`` parser the ``jaxpar`` command uses), the
config keys (from the config dataclasses and the attribute docstrings of their fields), the
Python API (mkdocstrings directives for every public name of ``jaxpar``), the feature-pair
table (from the tests' own record of what is tested together) and each benchmark's tables
(``insert: bench NAME``: ``benchmarks/NAME.py``'s ``markdown`` over its saved results), so
none of them can drift from what they describe.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_MARK = re.compile(r"^<!-- insert: (?P<name>[\w-]+)(?: (?P<arg>[\w.-]+))? -->$", re.M)


# --- command line --------------------------------------------------------------------------
def cli_reference(_: str | None = None) -> str:
    """Every ``jaxpar`` command's ``--help``, as the parser prints it."""
    os.environ["COLUMNS"] = "100"
    from jaxpar.cli.parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and a.dest == "command")
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = ["```text", parser.format_help().rstrip(), "```", ""]
    for name, command in sub.choices.items():
        out += [f"## jaxpar {name}", "", (helps.get(name) or "").capitalize() + ".", "",
                "```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(out)


# --- config keys ---------------------------------------------------------------------------
def _attribute_docs(cls: type) -> dict[str, str]:
    """``name -> docstring`` of the fields of ``cls`` and its bases that have one (a string
    right after the field, as the config classes write them)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for field, after in zip(body, body[1:], strict=False):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[field.target.id] = " ".join(after.value.value.split())
    return docs


_SECTION = re.compile(r"^(Attributes|Args):\s*$")
_ENTRY = re.compile(r"^(\w+): (.*)$")
_INLINE = re.compile(r"``(\w+)``: ")


def _docstring_fields(doc: str) -> dict[str, str]:
    """``name -> text`` from a class docstring: its ``Attributes:``/``Args:`` entries
    (``name: text``, continued on deeper-indented lines) and its inline definitions
    (a double-backquoted name, a colon and its text, up to the next one or the
    paragraph's end)."""
    found: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    prose: list[str] = []
    entry: str | None = None
    section = False
    for line in lines:
        if _SECTION.match(line):
            section, entry = True, None
            continue
        if section:
            if not line.strip():
                section, entry = False, None
                prose.append("")
                continue
            head = _ENTRY.match(line.strip()) if line.startswith("  ") and not line.startswith(
                "    ") else None
            if head:
                entry = head.group(1)
                found[entry] = head.group(2)
            elif entry:
                found[entry] += " " + line.strip()
            continue
        prose.append(line)
    for paragraph in "\n".join(prose).split("\n\n"):
        text = " ".join(paragraph.split())
        marks = list(_INLINE.finditer(text))
        if not marks:
            continue
        for mark, after in zip(marks, [*marks[1:], None], strict=True):
            end = after.start() if after else len(text)
            found.setdefault(mark.group(1), text[mark.end():end].strip())
    return found


def field_docs(cls: type) -> dict[str, str]:
    """What the reference says of each field of ``cls``: its attribute docstring, else
    its entry in the class docstring (of ``cls`` or a base) as :func:`_docstring_fields`
    reads it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # not object's
        docs.update(_docstring_fields(klass.__doc__ or ""))
    docs.update(_attribute_docs(cls))
    return docs


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_reference(_: str | None = None) -> str:
    """Every config key by section: default, type and what its docstring says."""
    from jaxpar.config.schema import Config
    from jaxpar.sharding.plan import Plan

    out: list[str] = []
    top: list[dataclasses.Field] = []
    for field in dataclasses.fields(Config):
        default = getattr(Config(), field.name)
        if not dataclasses.is_dataclass(default):
            top.append(field)
            continue
        cls = type(default)
        docs = field_docs(cls)
        if field.name == "plan":  # the knobs are the Plan's; rules and strict the section's
            docs = {**docs, **field_docs(Plan)}
        out += [f"## {field.name}", "", inspect.cleandoc(cls.__doc__ or ""), "",
                "| key | default | type | what it does |", "|---|---|---|---|"]
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        for f in dataclasses.fields(cls):
            kind = hints[f.name] if isinstance(hints[f.name], str) else getattr(
                hints[f.name], "__name__", str(hints[f.name]))
            out.append(f"| `{field.name}.{f.name}` | `{getattr(default, f.name)!r}` | "
                       f"{_cell(str(kind))} | {_cell(docs.get(f.name, ''))} |")
        out.append("")
    docs = field_docs(Config)
    out += ["## top level", "", "| key | default | what it does |", "|---|---|---|"]
    for f in top:
        out.append(f"| `{f.name}` | `{getattr(Config(), f.name)!r}` | "
                   f"{_cell(docs.get(f.name, ''))} |")
    return "\n".join(out) + "\n"


# --- Python API ----------------------------------------------------------------------------
# The modules of the public names, the ones a first script uses first.
_API_ORDER = ("jaxpar.sharding.mesh", "jaxpar.sharding.plan", "jaxpar.sharding.rules",
              "jaxpar.sharding.partitioning", "jaxpar.sharding.annotations",
              "jaxpar.sharding.layouts", "jaxpar.training.trainer", "jaxpar.parallel.staged",
              "jaxpar.models.linen", "jaxpar.config.schema", "jaxpar.config.assembly")


def api_reference(_: str | None = None) -> str:
    """An mkdocstrings directive for every public name of ``jaxpar``, by module."""
    import jaxpar

    by_module: dict[str, list[str]] = {m: [] for m in _API_ORDER}
    for name, module in sorted(jaxpar._EXPORTS.items(), key=lambda kv: (kv[1], kv[0])):
        if module.endswith(f".{name}"):
            continue  # a submodule exported whole (jaxpar.lora, jaxpar.models ...)
        by_module.setdefault(module, []).append(name)
    out = []
    for module, names in by_module.items():
        if not names:
            continue
        out += [f"## `{module}`", ""]
        out += [f"::: {module}.{name}\n" for name in names]
    out += ["## `jaxpar.planner`", "", "::: jaxpar.planner.api.plan", ""]
    return "\n".join(out)


# --- feature pairs -------------------------------------------------------------------------
def feature_pairs(_: str | None = None) -> str:
    """The table of features tested together (``tests/feature_pairs.py``)."""
    from tests.feature_pairs import markdown_table

    return markdown_table()


# --- benchmarks ----------------------------------------------------------------------------
def benchmark(name: str | None) -> str:
    """``benchmarks/NAME.py``'s ``markdown(results)`` over ``benchmarks/results/NAME.json``,
    under the date the results were committed and the command that wrote them."""
    assert name, "insert: bench needs the benchmark's name"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks"
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = ROOT / "benchmarks" / "results" / f"{name}.json"
    date = subprocess.run(["git", "log", "-1", "--format=%cs", "--", str(path)], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip() or "not committed"
    head = (f"*Results of `{module.COMMAND}`, committed {date} "
            f"(`benchmarks/results/{name}.json`).*")
    return head + "\n\n" + module.markdown(json.loads(path.read_text()))


GENERATORS: dict[str, Callable[[str | None], str]] = {
    "cli": cli_reference, "config": config_reference, "api": api_reference,
    "feature-pairs": feature_pairs, "bench": benchmark,
}


_ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc):(?=<code>)")


def on_page_content(html: str, **_: Any) -> str:
    """Docstrings cross-reference in Sphinx's roles (``:func:`name```), which mkdocstrings
    renders as the role's text followed by the code: keep the code."""
    return _ROLE.sub("", html)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """Replace every ``<!-- insert: NAME -->`` line of a page."""
    if str(ROOT) not in sys.path:  # MkDocs restores sys.path after loading a hook
        sys.path.insert(0, str(ROOT))
    return _MARK.sub(lambda m: GENERATORS[m["name"]](m["arg"]), markdown)
