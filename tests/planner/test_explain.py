"""The planner's explanations: the reason a plan beats the next one."""

import dataclasses

import pytest

from jaxpar.planner import parse_chips
from jaxpar.planner.explain import reason, tokens_per_s
from jaxpar.planner.model import from_transformer
from jaxpar.planner.search import search
from tests.planner.cases import TINY


def test_reasons_compare_the_winner_with_the_runner_up():
    result = search(lambda s: from_transformer(TINY, stages=s), parse_chips("h100:8"), 16,
                    128)
    first, second = result.plans[:2]
    assert reason(first, None) == "the only plan that fits"
    text = reason(first, second)
    assert f"than {second.candidate.describe()} (zero {second.candidate.zero_stage}" in text
    assert reason(dataclasses.replace(first, fits=False), second) == (
        "nothing fits; this plan needs the least memory")
    assert tokens_per_s(first, 16, 128) == pytest.approx(16 * 128 / first.step_time_s)
