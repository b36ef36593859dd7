"""The planner's explanations: the reason a plan beats the next one."""

import dataclasses

import pytest

import jaxpar
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
    assert reason(first, None, fitting=3) == "the slowest of the 3 plans that fit"
    text = reason(first, second)
    assert f"than {second.candidate.describe()} (zero {second.candidate.zero_stage}" in text
    assert reason(dataclasses.replace(first, fits=False), second) == (
        "nothing fits; this plan needs the least memory")
    assert tokens_per_s(first, 16, 128) == pytest.approx(16 * 128 / first.step_time_s)


def test_the_last_plan_shown_is_compared_with_the_next_one():
    """Before, the last of the ``top`` plans had no runner-up and claimed to be the only
    plan that fits."""
    plans = jaxpar.plan("configs/tiny.yaml", chips="h100:8", global_batch=16, seq=128, top=2)
    assert len(plans) == 2
    for est in plans:
        assert est.reason.startswith(("ties with", "faster than")) or " than " in (
            est.reason.split(";")[0]), est.reason
