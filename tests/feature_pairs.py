"""Which pairs of jaxpar's features run together: the data behind the docs' feature-pair
table, checked by tests/test_feature_pairs.py.

Each unordered pair of :data:`FEATURES` (key ordered as in ``FEATURES``) has one entry:

- ``{"works": "tests/PATH.py::test_name"}``: that test trains or compiles a run with both
  features on at once (``"note"`` may say which parametrization or variant);
- ``{"refused": [overrides], "message": "substring"}``: ``jaxpar.load_config(None,
  overrides)`` is refused by ``check_config(config, devices=8)`` in one line holding the
  substring; with ``"when": "build"`` the config passes ``check_config`` and the refusal
  comes as the run is built (the Trainer, or DiLoCo around it), said in ``"note"``; with
  ``"when": "run"`` at the first step, checked by the ``"tested_by"`` test;
  ``"tested_by"`` names a test that already checks the refusal, where one does;
- ``{"undecided": "note"}``: no test runs the pair together and nothing refuses it.

How each feature is turned on: ``1f1b`` mesh.stage > 1 with pipeline.schedule=1f1b or
interleaved_1f1b; ``offload`` plan.offload_optimizer, plan.host_update or
plan.offload_params; ``quantize`` plan.quantize=int8 or fp8; ``zero++``
plan.quantize_gather, plan.quantize_reduce or plan.hpz; ``diloco`` diloco.sync_every > 0;
``compression`` plan.compress_gradients; ``lora`` lora.enabled; ``context`` mesh.context
> 1; ``expert`` mesh.expert > 1 with model.n_experts > 0; ``linen`` a Flax linen model
(``jaxpar.from_linen``); ``explicit`` an explicit-sharding mesh (mesh.explicit).
"""

from __future__ import annotations

FEATURES: tuple[str, ...] = ("1f1b", "offload", "quantize", "zero++", "diloco", "compression",
                             "lora", "context", "expert", "linen", "explicit")


def _stages(*mesh: str) -> list[str]:
    """Two pipeline stages (with other mesh axes) under the 1F1B schedule."""
    return ["mesh.stage=2", *mesh, "pipeline.schedule=1f1b"]


_MOE = ["model.n_experts=4", "model.expert_d_ff=32"]
COMBINATIONS: dict[str, list[str]] = {
    # Each set's features compiled together in one step (tests/test_feature_pairs.py::
    # test_combinations_compile_together): every pair inside a set works together.
    "offload, quantize, diloco, lora, expert": [
        "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", *_MOE, "plan.offload_optimizer=1",
        "plan.quantize=int8", "diloco.sync_every=2", "lora.enabled=true"],
    "offload, quantize, compression, lora, expert": [
        "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", *_MOE, "plan.offload_optimizer=1",
        "plan.quantize=int8", "plan.compress_gradients=sign", "lora.enabled=true"],
    "offload, quantize, lora, context, expert": [
        "mesh.fsdp=2", "mesh.context=2", "mesh.expert=2", *_MOE, "plan.offload_optimizer=1",
        "plan.quantize=int8", "lora.enabled=true"],
    "quantize, zero++, lora, context, expert": [
        "mesh.fsdp=2", "mesh.context=2", "mesh.expert=2", *_MOE, "plan.zero_stage=3",
        "plan.quantize_gather=int8", "plan.quantize=int8", "lora.enabled=true"],
    "1f1b, quantize, lora": [
        "mesh.stage=2", "mesh.fsdp=4", "pipeline.schedule=1f1b", "plan.quantize=int8",
        "lora.enabled=true"],
}
"""Sets of features compiled together, on the reference decoder (8 CPU devices)."""
COMPILED = "tests/test_feature_pairs.py::test_combinations_compile_together"
USER_MODELS = "tests/test_feature_pairs.py::test_user_models_train_with_the_feature"


def combination_of(pair: tuple[str, str]) -> str | None:
    """The first set of :data:`COMBINATIONS` holding both features of ``pair``."""
    for name in COMBINATIONS:
        if set(pair) <= set(name.split(", ")):
            return name
    return None


PAIRS: dict[tuple[str, str], dict] = {
    # --- 1f1b --------------------------------------------------------------------------------
    ("1f1b", "offload"): {
        "refused": [*_stages(), "plan.offload_params=true"],
        "message": "streams the layers of one layer loop; it does not combine with pipeline "
                   "stages",
        "note": "plan.offload_optimizer on pipeline stages is neither tested nor refused"},
    ("1f1b", "quantize"): {"works": COMPILED},
    ("1f1b", "zero++"): {
        "refused": [*_stages("mesh.fsdp=4"), "plan.quantize_reduce=int8"],
        "message": "plan.quantize_reduce runs the step manual over the data-parallel axes",
        "when": "build",
        "note": "The Trainer refuses plan.quantize_reduce on any mesh with stage > 1; "
                "plan.quantize_gather and plan.hpz on stages are untested",
        "tested_by": "tests/parallel/test_zeropp.py::test_int8_reductions_refuse_what_they_"
                     "cannot_run"},
    ("1f1b", "diloco"): {
        "refused": [*_stages("mesh.data=2", "mesh.fsdp=2"), "diloco.sync_every=2"],
        "message": "runs the backward pass inside its own shard_map, which diloco.sync_every "
                   "cannot enter",
        "tested_by": "tests/config/test_validate.py::test_layout"},
    ("1f1b", "compression"): {
        "refused": [*_stages("mesh.data=4"), "plan.compress_gradients=sign"],
        "message": "runs the backward pass inside its own shard_map, which "
                   "plan.compress_gradients=sign cannot enter",
        "tested_by": "tests/config/test_validate.py::test_layout"},
    ("1f1b", "lora"): {
        "works": "tests/models/test_pipelined_training.py::test_lora_under_1f1b_equals_lora_"
                 "under_circular",
        "note": "interleaved_1f1b"},
    ("1f1b", "context"): {
        "refused": _stages("mesh.context=2", "mesh.data=2"),
        "message": "mesh.context > 1 with mesh.stage > 1 is not supported yet",
        "tested_by": "tests/config/test_validate.py::test_layout"},
    ("1f1b", "expert"): {
        "refused": [*_stages("mesh.expert=2", "mesh.data=2"), "model.n_experts=4"],
        "message": "model.n_experts > 0 with mesh.stage > 1 is not supported yet",
        "tested_by": "tests/config/test_validate.py::test_layout"},
    ("1f1b", "linen"): {
        "refused": ["jaxpar.stage_model(jaxpar.from_linen(...), ...)"],
        "message": "cannot be divided into pipeline stages yet",
        "when": "run",
        "note": "jaxpar.stage_model refuses a linen model: its blocks are linen modules",
        "tested_by": USER_MODELS},
    ("1f1b", "explicit"): {
        "refused": [*_stages("mesh.fsdp=4"), "mesh.explicit=true"],
        "message": "pipeline stages on an explicit-sharding mesh are not supported",
        "when": "build",
        "note": "The Trainer refuses any model with a pipeline schedule on an explicit mesh",
        "tested_by": "tests/parallel/test_staged.py::test_stages_without_a_split_or_on_an_"
                     "explicit_mesh_are_refused"},
    # --- offload -----------------------------------------------------------------------------
    ("offload", "quantize"): {"works": COMPILED},
    ("offload", "zero++"): {
        "refused": ["mesh.fsdp=8", "plan.zero_stage=3", "plan.quantize_gather=int8",
                    "plan.offload_params=true"],
        "message": "plan.quantize_gather quantizes weights on the device before gathering them",
        "note": "plan.hpz and plan.quantize_reduce are refused with plan.offload_params too; "
                "plan.offload_optimizer with ZeRO++ is untested",
        "tested_by": "tests/parallel/test_zeropp.py::test_int8_gathers_refuse_streamed_weights"},
    ("offload", "diloco"): {"works": COMPILED},
    ("offload", "compression"): {"works": COMPILED},
    ("offload", "lora"): {
        "works": "tests/parallel/test_offload.py::test_lora_streams_the_frozen_base_and_keeps_"
                 "adapters_on_the_device",
        "note": "plan.offload_params"},
    ("offload", "context"): {"works": COMPILED},
    ("offload", "expert"): {"works": COMPILED},
    ("offload", "linen"): {
        "works": "tests/sharding/test_block_remat.py::test_optimizer_offload_on_a_users_model_"
                 "equals_one_device",
        "note": "parametrization linen: plan.offload_optimizer=1 with plan.host_update"},
    ("offload", "explicit"): {
        "works": "tests/sharding/test_block_remat.py::test_optimizer_offload_on_a_users_model_"
                 "equals_one_device",
        "note": "parametrizations explicit: plan.offload_optimizer=1, update on the device "
                "and on the host"},
    # --- quantize ----------------------------------------------------------------------------
    ("quantize", "zero++"): {
        "works": "tests/cli/test_inspection.py::test_quantized_plans_are_named_in_the_header",
        "note": "jaxpar inspect compiles the step with plan.quantize=int8 and "
                "plan.quantize_gather=int8"},
    ("quantize", "diloco"): {"works": COMPILED},
    ("quantize", "compression"): {"works": COMPILED},
    ("quantize", "lora"): {
        "works": "tests/sharding/test_quantization.py::test_lora_keeps_its_update_unquantized_"
                 "and_quantizes_the_base"},
    ("quantize", "context"): {"works": COMPILED},
    ("quantize", "expert"): {"works": COMPILED},
    ("quantize", "linen"): {
        "works": "tests/sharding/test_quantization.py::test_a_linen_model_trains_on_int8_"
                 "matmuls_and_tracks_its_f32_run"},
    ("quantize", "explicit"): {
        "works": "tests/sharding/test_quantization.py::test_an_explicit_sharding_model_trains_"
                 "on_int8_matmuls"},
    # --- zero++ ------------------------------------------------------------------------------
    ("zero++", "diloco"): {
        "refused": ["mesh.data=2", "mesh.fsdp=4", "diloco.sync_every=2",
                    "plan.quantize_reduce=int8"],
        "message": "diloco keeps a whole optimizer state per replica",
        "when": "build",
        "note": "DiLoCo refuses an inner Trainer with plan.quantize_reduce; "
                "plan.quantize_gather under DiLoCo is untested"},
    ("zero++", "compression"): {
        "refused": ["mesh.data=8", "plan.quantize_reduce=int8", "plan.compress_gradients=sign"],
        "message": "it does not combine with plan.compress_gradients",
        "tested_by": "tests/parallel/test_zeropp.py::test_int8_reductions_refuse_what_they_"
                     "cannot_run"},
    ("zero++", "lora"): {"works": COMPILED},
    ("zero++", "context"): {"works": COMPILED},
    ("zero++", "expert"): {"works": COMPILED},
    ("zero++", "linen"): {
        "works": "tests/parallel/test_zeropp.py::test_qwz_and_qgz_on_a_scanned_and_a_linen_"
                 "model",
        "note": "parametrization linen: plan.quantize_gather and plan.quantize_reduce"},
    ("zero++", "explicit"): {
        "refused": ["mesh.fsdp=8", "mesh.explicit=true", "plan.zero_stage=3",
                    "plan.quantize_gather=int8"],
        "message": "does not run on an explicit-sharding mesh yet",
        "when": "build",
        "note": "The Trainer refuses plan.quantize_gather and plan.quantize_reduce on an "
                "explicit mesh",
        "tested_by": "tests/sharding/test_quantization.py::test_an_explicit_mesh_is_told_"
                     "zeropp_does_not_run_there_yet"},
    # --- diloco ------------------------------------------------------------------------------
    ("diloco", "compression"): {
        "refused": ["mesh.data=2", "mesh.fsdp=4", "diloco.sync_every=2",
                    "plan.compress_gradients=sign"],
        "message": "diloco keeps a whole optimizer state per replica",
        "when": "build",
        "note": "DiLoCo refuses an inner Trainer with plan.compress_gradients"},
    ("diloco", "lora"): {"works": COMPILED},
    ("diloco", "context"): {
        "refused": ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "diloco.sync_every=2"],
        "message": "context-parallel attention cannot run inside it"},
    ("diloco", "expert"): {"works": COMPILED},
    ("diloco", "linen"): {
        "works": "tests/training/test_diloco.py::test_diloco_on_a_linen_model_equals_"
                 "synchronous_at_h1"},
    ("diloco", "explicit"): {
        "works": "tests/training/test_diloco.py::test_diloco_on_an_explicit_mesh_reads_its_"
                 "anchor_back"},
    # --- compression -------------------------------------------------------------------------
    ("compression", "lora"): {"works": COMPILED},
    ("compression", "context"): {
        "refused": ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "plan.compress_gradients=sign"],
        "message": "context-parallel attention cannot run inside it"},
    ("compression", "expert"): {"works": COMPILED},
    ("compression", "linen"): {"works": USER_MODELS},
    ("compression", "explicit"): {
        "refused": ["plan.compress_gradients=sign", "mesh.explicit=true"],
        "message": "leave it out of the model's PartitionSpecs",
        "when": "run",
        "note": "The step runs by hand over the data axis, which an explicit model names in "
                "its own shardings: refused in one line at its first step",
        "tested_by": USER_MODELS},
    # --- lora --------------------------------------------------------------------------------
    ("lora", "context"): {"works": COMPILED},
    ("lora", "expert"): {
        "works": "tests/models/test_expert_parallel.py::test_lora_on_experts_trains_per_"
                 "expert_adapters"},
    ("lora", "linen"): {
        "works": "tests/models/test_linen.py::test_linen_lora_on_dense_general_and_einsum_"
                 "equals_one_device"},
    ("lora", "explicit"): {
        "works": "tests/sharding/test_user_models.py::test_lora_on_an_explicit_sharding_model_"
                 "equals_one_device"},
    # --- context -----------------------------------------------------------------------------
    ("context", "expert"): {
        "works": "tests/planner/test_planner.py::test_expert_context_and_sequence_parallel_"
                 "memory_match_xla",
        "note": "parametrization moe_expert2_context2_ring: the step of a mixture of experts "
                "compiled on expert=2 x context=2"},
    ("context", "linen"): {
        "works": USER_MODELS,
        "note": "The sequence split over context by GSPMD (the model's own attention)"},
    ("context", "explicit"): {
        "works": USER_MODELS,
        "note": "The sequence split over context by GSPMD (the model's own attention)"},
    # --- expert ------------------------------------------------------------------------------
    ("expert", "linen"): {
        "works": USER_MODELS,
        "note": "A dense model on a mesh with an expert axis (batch split over it too)"},
    ("expert", "explicit"): {
        "works": USER_MODELS,
        "note": "A dense model on a mesh with an expert axis (batch split over it too)"},
    # --- linen -------------------------------------------------------------------------------
    ("linen", "explicit"): {
        "refused": ["jaxpar.from_linen(...) on jaxpar.make_mesh(..., explicit=True)"],
        "message": "does not run on an explicit-sharding mesh",
        "when": "run",
        "note": "The Trainer refuses it as it is built: linen arrays carry no sharding types",
        "tested_by": USER_MODELS},
}

_CELL = {"works": "yes", "refused": "no", "undecided": "?"}


def verdict(a: str, b: str) -> str:
    """``works``, ``refused`` or ``undecided`` for two different features (either order)."""
    i, j = FEATURES.index(a), FEATURES.index(b)
    entry = PAIRS[(a, b) if i < j else (b, a)]
    return next(k for k in _CELL if k in entry)


def markdown_table() -> str:
    """The docs' table: every feature against every other (symmetric), ``yes`` where a
    test runs the two together, ``no`` where jaxpar refuses them, ``?`` where neither;
    then the refused pairs, the overrides that show it and what the refusal says."""
    lines = ["| | " + " | ".join(FEATURES) + " |",
             "|---|" + ":-:|" * len(FEATURES)]
    for a in FEATURES:
        cells = ["·" if a == b else _CELL[verdict(a, b)] for b in FEATURES]
        lines.append(f"| **{a}** | " + " | ".join(cells) + " |")
    lines += ["", "yes: a test trains or compiles the two together; no: refused in one line "
              "(below); ?: neither tested together nor refused.", "",
              "Refused pairs (overrides, then what the refusal says):", ""]
    for (a, b), entry in PAIRS.items():
        if "refused" in entry:
            when = {"build": ", as the run is built",
                    "run": ", at the first step"}.get(entry.get("when"), "")
            lines.append(f"- {a} + {b}: `{' '.join(entry['refused'])}`{when}: "
                         f"\"{entry['message']}\"")
    return "\n".join(lines) + "\n"
