"""The docs site builds strictly (no broken link, reference or nav entry) and works in a
real browser: one page of each section renders, its navigation leads to another page and
the search finds pages (Playwright driving Debian's Chromium, which ``make test`` installs).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# One page of each section, and the heading it must show.
PAGES = {"": "jaxpar", "get-started/install/": "Install",
         "guides/planner/": "planner", "reference/config/": "Config keys",
         "benchmarks/vs-maxtext/": "MaxText"}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site: ``make test`` builds it (``JAXPAR_DOCS_SITE``), else built here."""
    built = os.environ.get("JAXPAR_DOCS_SITE")
    if built and (ROOT / built / "index.html").is_file():
        return ROOT / built
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict",
                           "-q", "-d", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_generated_references_hold_every_command_and_config_key(site):
    from jaxpar.cli.parser import build_parser
    from jaxpar.config.schema import Config

    cli = (site / "reference" / "cli" / "index.html").read_text()
    for name in ("train", "plan", "inspect", "compile", "calibrate", "launch", "sample",
                 "convert", "export", "tokenize"):
        assert f"jaxpar {name}" in cli
    assert "--max-steps" in cli and "--global-batch" in cli
    keys = (site / "reference" / "config" / "index.html").read_text()
    import dataclasses

    for section in dataclasses.fields(Config):
        default = getattr(Config(), section.name)
        for f in dataclasses.fields(default) if dataclasses.is_dataclass(default) else []:
            assert f"{section.name}.{f.name}" in keys, f"{section.name}.{f.name} missing"
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("Plan", "Trainer", "make_mesh", "stage_model", "init_sharded"):
        assert re.search(rf'id="[\w.]*{name}"', api), name
    assert build_parser().prog == "jaxpar"


def test_every_config_key_says_what_it_does():
    """The config reference's "what it does" column, from the fields' attribute
    docstrings and their classes' docstrings, is filled for every key."""
    from docs.hooks.generated import config_reference

    rows = [line for line in config_reference().splitlines() if line.startswith("| `")]
    empty = [row.split("|")[1].strip() for row in rows if row.rstrip().endswith("|  |")]
    assert len(rows) > 120 and empty == []


@pytest.fixture(scope="module")
def server(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="no Chromium (make test installs it)")
def test_each_section_renders_navigates_and_searches_in_chromium(server):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "Chromium is missing: make test installs Debian's chromium package"
    args = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        for path, heading in PAGES.items():
            page.goto(server + path)
            assert heading.lower() in page.locator("h1").first.inner_text().lower(), path
            tabs = page.locator("nav.md-tabs a.md-tabs__link")
            assert tabs.count() >= 4, path
        # Navigation: the Guides tab leads to a guide page, its sidebar to another.
        page.goto(server)
        page.locator("nav.md-tabs a.md-tabs__link", has_text="Guides").first.click()
        page.wait_for_url(re.compile(r"/guides/"))
        page.locator("nav.md-nav a.md-nav__link", has_text="Pipelines").first.click()
        page.wait_for_url(re.compile(r"/guides/pipelines/"))
        assert "pipeline" in page.locator("h1").first.inner_text().lower()
        # Search: the index loads in the page's worker and finds the pipeline guide.
        # The index loads in a web worker, slowly on a busy machine: a query typed before it
        # is ready finds nothing, so type it again until results come (at most 2 minutes).
        search = page.locator("input.md-search__input")
        results = page.locator(".md-search-result__item")
        deadline = time.monotonic() + 120
        while True:
            search.click()
            search.fill("")
            search.press_sequentially("microbatches", delay=20)
            try:
                results.first.wait_for(timeout=5_000)
                break
            except PlaywrightTimeout:
                assert time.monotonic() < deadline, "the search found nothing in 2 minutes"
        assert results.count() >= 1
        assert any("pipeline" in (results.nth(i).inner_text().lower())
                   for i in range(min(results.count(), 10)))
        browser.close()
        assert not errors, errors
