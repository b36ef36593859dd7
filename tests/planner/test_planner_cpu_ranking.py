"""The cost model against measured CPU steps (no timing here).

``benchmarks/planner_cpu.py --save benchmarks/results/planner_cpu.json`` calibrated 8
simulated CPU devices (``jaxpar calibrate``) and measured the step time of a small
decoder under several layouts. This test re-predicts each layout with the current cost
model on that calibrated chip: a change to the model that moves a prediction more than
25% from what was measured, or that makes the planner's first choice anything but one of
the two fastest measured layouts, fails here.
"""

import json
from pathlib import Path

import pytest

from jaxpar import load_config
from jaxpar.planner.catalog import Machine, chip_from_mapping
from jaxpar.planner.cost import estimate
from jaxpar.planner.prediction import candidate_from_config, spec_from_config

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "planner_cpu.json"
TOLERANCE = 0.25

@pytest.fixture(scope="module")
def results():
    data = json.loads(RESULTS.read_text())
    figures = dict(data["chip"])
    chip = chip_from_mapping(figures.pop("name"), figures)
    n = data["devices"]
    predicted = {}
    for name, row in data["layouts"].items():
        config = load_config("configs/tiny.yaml", [*data["model_overrides"], *row["overrides"]])
        cand = candidate_from_config(config, n)
        spec = spec_from_config(config, cand.sizes["stage"])
        est = estimate(spec, Machine(chip, n, 1), cand, config.train.global_batch,
                       config.train.seq_len, backend="cpu")
        predicted[name] = est.step_time_s
    measured = {name: row["measured_s"] for name, row in data["layouts"].items()}
    return predicted, measured


def test_at_least_eight_layouts(results):
    assert len(results[1]) >= 8


def test_each_prediction_within_tolerance(results):
    predicted, measured = results
    off = {n: round(predicted[n] / measured[n], 2) for n in measured
           if abs(predicted[n] / measured[n] - 1) > TOLERANCE}
    assert not off, f"predicted/measured outside 1 +- {TOLERANCE}: {off}"


def test_first_choice_among_two_fastest_measured(results):
    predicted, measured = results
    first = min(predicted, key=predicted.get)
    fastest = sorted(measured, key=measured.get)[:2]
    assert first in fastest, (first, fastest)
