# Every target sets itself up: a fresh clone needs only `make train` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: train test docs lint bench clean
# Debian's Chromium, for the docs site's browser check (the tests drive it with Playwright).
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/jaxpar train --config configs/tiny.yaml --devices 8 --out runs/tiny --resume

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium

# jemalloc for the test processes and every jaxpar subprocess they start: XLA's compilers
# spend 5-10% of their time in glibc's malloc (perf); with jemalloc the TPU compiler's step
# compile in tests/analysis/test_targets.py takes 20 s instead of 25, and XLA:CPU's tests
# about 5% less.
JEMALLOC ?= /usr/lib/$(shell uname -m)-linux-gnu/libjemalloc.so.2
$(JEMALLOC):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends libjemalloc2

# The site in site/: strict (a broken link, reference or nav entry fails the build).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q -d site

test: $(STAMP) $(CHROMIUM) $(JEMALLOC) docs
	$(VENV)/bin/ruff check jaxpar tests benchmarks examples notebooks docs/hooks
	LD_PRELOAD=$(JEMALLOC) JAXPAR_DOCS_SITE=site $(PY) -m pytest -q -n 2 --dist worksteal --durations=40

bench: $(STAMP)
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/pipeline.py --no-time
	$(PY) benchmarks/published.py

clean:
	rm -rf $(VENV) runs site .pytest_cache
