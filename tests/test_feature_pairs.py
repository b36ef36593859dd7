"""The feature-pair table (tests/feature_pairs.py) against the code and the tests: every
pair has one entry, each cited test exists, each config refusal is raised by check_config
in one line, each build refusal passes check_config and is raised as the run is assembled
(abstract: shapes only, nothing allocated or compiled), and the docs site shows the table."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from tests.feature_pairs import (
    COMBINATIONS,
    COMPILED,
    FEATURES,
    PAIRS,
    combination_of,
    markdown_table,
)

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"works": {"works", "note"},
        "refused": {"refused", "message", "when", "note", "tested_by"},
        "undecided": {"undecided"}}


def _ids(pairs) -> list[str]:
    return [f"{a}+{b}" for a, b in pairs]


def _with(*keys: str, build: bool | None = None) -> list[tuple[str, str]]:
    return [p for p, e in PAIRS.items() if any(k in e for k in keys)
            and (build is None or e.get("when") == ("build" if build else None))]


def test_every_pair_has_one_entry():
    assert len(FEATURES) == len(set(FEATURES)) == 11
    assert list(PAIRS) == list(itertools.combinations(FEATURES, 2))  # 55, in table order
    for pair, entry in PAIRS.items():
        kinds = [k for k in KEYS if k in entry]
        assert len(kinds) == 1, pair
        assert set(entry) <= KEYS[kinds[0]], pair
        if "refused" in entry:
            assert entry["refused"] and entry["message"], pair
            assert entry.get("when", "build") in ("build", "run"), pair
            assert entry.get("when") != "run" or entry.get("tested_by"), pair
            assert "when" not in entry or entry.get("note"), pair
        if "undecided" in entry:
            assert entry["undecided"].strip(), pair


@pytest.mark.parametrize("pair", _with("works", "tested_by"), ids=_ids(_with("works",
                                                                            "tested_by")))
def test_cited_tests_exist(pair):
    entry = PAIRS[pair]
    for ref in (entry.get("works"), entry.get("tested_by")):
        if ref is None:
            continue
        path, _, name = ref.partition("::")
        assert path.startswith("tests/") and name.startswith("test_"), ref
        text = (ROOT / path).read_text()
        assert re.search(rf"^\s*def {re.escape(name)}\(", text, re.M), ref


@pytest.mark.parametrize("pair", _with("refused", build=False),
                         ids=_ids(_with("refused", build=False)))
def test_config_refusals_are_one_line_from_check_config(pair):
    import jaxpar
    from jaxpar.config.validate import check_config

    entry = PAIRS[pair]
    config = jaxpar.load_config(None, entry["refused"])
    with pytest.raises(jaxpar.JaxparError, match=re.escape(entry["message"])) as err:
        check_config(config, devices=8, processes=1)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("pair", _with("refused", build=True),
                         ids=_ids(_with("refused", build=True)))
def test_build_refusals_pass_check_config_and_come_as_the_run_is_built(devices, pair):
    import jaxpar
    from jaxpar.config.assembly import assemble
    from jaxpar.config.validate import check_config

    entry = PAIRS[pair]
    config = jaxpar.load_config(None, entry["refused"])
    check_config(config, devices=len(devices), processes=1)
    with pytest.raises(jaxpar.JaxparError, match=re.escape(entry["message"])) as err:
        assemble(config, devices, abstract=True)
    assert "\n" not in str(err.value)


SMALL_MODEL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
               "model.d_ff=64", "model.max_seq_len=64", "train.seq_len=32",
               "train.global_batch=16"]


def test_no_pair_is_left_undecided():
    assert [pair for pair, entry in PAIRS.items() if "undecided" in entry] == []


def test_every_compiled_pair_is_in_a_combination():
    for pair, entry in PAIRS.items():
        if entry.get("works") == COMPILED:
            assert combination_of(pair) is not None, pair


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_combinations_compile_together(devices, name):
    """Each set's features on at once: the config passes its checks, no warning says a
    knob does nothing, and the train step compiles for 8 devices (the SPMD partitioner is
    where combinations fail)."""
    import warnings

    import jaxpar
    from jaxpar.analysis.inspection import compile_step
    from jaxpar.config.validate import check_config

    config = jaxpar.load_config(None, [*SMALL_MODEL, *COMBINATIONS[name]])
    check_config(config, devices=len(devices), processes=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxpar.errors.JaxparWarning)
        step = compile_step(config)
    assert step.compiled.as_text()


@pytest.mark.parametrize("model,feature", [("linen", "compression"), ("linen", "context"),
                                           ("explicit", "context"),
                                           ("explicit", "compression"), ("linen", "expert"),
                                           ("explicit", "expert"), ("linen", "explicit"),
                                           ("linen", "1f1b")])
def test_user_models_train_with_the_feature(devices, model, feature):
    """Users' models (tests/user_models.py: a linen Llama, an explicit-sharding model) with
    compressed gradients, a context or expert axis, an explicit mesh or pipeline stages:
    two steps that learn, or one line."""
    import optax

    import jaxpar
    from tests.sharding.test_block_remat import MODELS, tokens

    factory, knobs, explicit = MODELS[model]
    if feature == "1f1b":
        with pytest.raises(jaxpar.JaxparError, match=re.escape(
                PAIRS[("1f1b", "linen")]["message"])):
            split = jaxpar.StageSplit(embed=lambda m, x: x, head=lambda m, h: h,
                                      blocks="layers")
            jaxpar.stage_model(factory(), split, stages=2, schedule="1f1b")
        return
    axes = {"data": 2, "fsdp": 2,
            **{"context": {"context": 2}, "expert": {"expert": 2}}.get(feature,
                                                                       {"tensor": 2})}
    extra = {"compress_gradients": "sign"} if feature == "compression" else {}
    plan = jaxpar.Plan.from_preset(
        jaxpar.make_mesh(axes, explicit=explicit or feature == "explicit"), "fsdp_tp",
        **knobs, **extra)
    if feature == "explicit":
        with pytest.raises(jaxpar.JaxparError, match=re.escape(
                PAIRS[("linen", "explicit")]["message"])) as err:
            jaxpar.Trainer(jaxpar.init_sharded(factory, plan), optax.adam(1e-2), plan)
        assert "\n" not in str(err.value)
        return
    trainer = jaxpar.Trainer(jaxpar.init_sharded(factory, plan), optax.adam(1e-2), plan)
    if (model, feature) == ("explicit", "compression"):
        entry = PAIRS[("compression", "explicit")]
        with pytest.raises(jaxpar.JaxparError, match=re.escape(entry["message"])) as err:
            trainer.step(tokens(0))
        assert "\n" not in str(err.value)
        return
    losses = [trainer.step(tokens(i))["loss"] for i in range(2)]
    assert np.isfinite(losses).all() and losses[1] < losses[0], losses


def test_the_table_has_a_row_and_a_bullet_for_each():
    table = markdown_table()
    rows = [line for line in table.splitlines() if line.startswith("| **")]
    assert [r.split("|")[1].strip(" *") for r in rows] == list(FEATURES)
    assert all(len(r.split("|")) == len(FEATURES) + 3 for r in rows)
    bullets = [line for line in table.splitlines() if line.startswith("- ")]
    assert len(bullets) == len(_with("refused"))


def test_the_docs_site_writes_the_table_from_this_record():
    from docs.hooks.generated import on_page_markdown

    page = (ROOT / "docs" / "guides" / "feature-combinations.md").read_text()
    assert markdown_table() in on_page_markdown(page)
