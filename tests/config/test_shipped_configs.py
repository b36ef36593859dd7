"""The run configs shipped in ``configs/``: each loads and checks, and those that give
a model's size in their header (the last ``46.7B parameters`` of it) hold that many,
as the planner counts them (within 1%: the papers round)."""

import re
from pathlib import Path

import pytest

from jaxpar.config.schema import load_config
from jaxpar.planner.model import from_transformer

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
_PARAMS = re.compile(r"([\d.]+)B parameters")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_shipped_config_loads_with_its_published_size(path):
    config = load_config(str(path), [])
    header = "".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    sizes = _PARAMS.findall(header)
    if sizes:
        counted = from_transformer(config.model).n_params
        assert counted / 1e9 == pytest.approx(float(sizes[-1]), rel=0.01), path.name
