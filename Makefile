# Every target sets itself up: a fresh clone needs only `make train` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: train test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/jaxpar train --config configs/tiny.yaml --devices 8 --out runs/tiny --resume

test: $(STAMP)
	$(VENV)/bin/ruff check jaxpar tests benchmarks examples notebooks
	$(PY) -m pytest -q -n 2 --durations=25

bench: $(STAMP)
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/pipeline.py --no-time
	$(PY) benchmarks/published.py

clean:
	rm -rf $(VENV) runs .pytest_cache
