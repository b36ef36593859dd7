"""Compiling for a TPU that is not here (jaxpar.analysis.targets, compile_step): the TPU
compiler from libtpu, on this CPU host, against the planner; splash attention compiled as
the real Mosaic kernel."""

import dataclasses

import pytest

from jaxpar.analysis import targets
from jaxpar.analysis.hlo import custom_calls
from jaxpar.analysis.inspection import StepDoesNotFit, compile_step, step_report
from jaxpar.config.schema import load_config
from jaxpar.errors import JaxparError

pytest.importorskip("libtpu", reason="the TPU compiler (pip install 'jax[tpu]')")

SMALL = ["model.n_layers=2", "model.d_model=1024", "model.d_ff=2048", "model.n_heads=8",
         "model.n_kv_heads=8", "model.vocab_size=512", "model.max_seq_len=256",
         "train.global_batch=8", "train.seq_len=256", "plan.remat=full",
         "plan.precision=params=float32,compute=bfloat16,output=float32", "mesh.data=1",
         "mesh.fsdp=-1"]


def test_topologies_give_the_slices_devices():
    v5e = targets.tpu_target("tpu-v5e:2x2")
    assert (len(v5e.devices), v5e.device_kind, v5e.chips) == (4, "TPU v5 lite", 4)
    assert v5e.hbm_bytes == 16 * 2**30
    two = targets.tpu_target("tpu-v5p:2x2x1", slices=2)
    assert len(two.devices) == 8 and {d.slice_index for d in two.devices} == {0, 1}
    assert targets.topology_for("tpu-v6e", 256) == "16x16"
    assert targets.topology_for("tpu-v5p", 512) == "8x8x8"
    assert targets.topology_for("tpu-v5p", 4) == "2x2x1"


@pytest.mark.parametrize("text, says", [
    ("tpu-v9:2x2", "must name a TPU slice"),
    ("tpu-v5p:2x2", "a v5p slice has 3 topology dimensions"),
    ("tpu-v5e:3x5", "the TPU compiler refuses topology 'v5e:3x5'"),
])
def test_bad_targets_are_one_line(text, says):
    with pytest.raises(JaxparError, match=says) as err:
        targets.tpu_target(text)
    assert "\n" not in str(err.value)


def test_a_missing_tpu_compiler_names_the_package(monkeypatch):
    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(JaxparError, match=r"pip install 'jax\[tpu\]=="):
        targets.tpu_target("tpu-v5e:2x2")


@pytest.fixture(scope="module")
def v5e_step():
    config = load_config("configs/tiny.yaml", [*SMALL, "model.attention=auto"])
    return compile_step(config, targets.tpu_target("tpu-v5e:2x2"))


def test_the_step_compiles_for_a_tpu_with_splash_as_the_mosaic_kernel(v5e_step):
    """auto attention on a TPU target is splash, compiled (not interpreted): the forward
    kernel and the two backward ones are TPU custom calls."""
    assert v5e_step.compiled.input_shardings[0]  # a real executable for 4 TPU devices
    assert custom_calls(v5e_step.compiled.as_text()).get("tpu_custom_call", 0) >= 3


def test_compiled_memory_against_the_planner(v5e_step):
    """The state (arguments) is the planner's to the byte's rounding; the compiler's whole
    footprint stays within the planner's, and the planner's within twice the compiler's
    (conservative for a 9M-parameter model: the TPU compiler updates the optimizer state
    in place, and fuses most of a small layer's working set); both say it fits. On the v5e
    step only: the v5p compiler is checked against the planner by
    tests/planner/test_memory.py::test_moe_working_set_against_the_tpu_compiler."""
    report = step_report(v5e_step)
    mem, pred = report["memory"], report["predicted"]["memory"]
    # The temporaries are the compiler's program requirement, read from its log: its heap
    # and a little scoped memory and code. XLA's memory_analysis() reports the heap and
    # its gaps once more (jaxpar.analysis.tpu_log).
    program = v5e_step.program
    assert program is not None and mem["temp_bytes"] == program.program_bytes
    assert program.heap_bytes <= program.program_bytes <= program.heap_bytes + (256 << 20)
    assert mem["xla_temp_bytes"] == pytest.approx(
        program.heap_bytes + program.fragmentation_bytes, rel=0.01, abs=8 << 20)
    # Without the log's account, XLA's figure stands, and the report says so.
    unlogged = step_report(dataclasses.replace(v5e_step, program=None))
    assert unlogged["memory"]["temp_bytes"] == mem["xla_temp_bytes"]
    assert any("not found in libtpu's log" in n for n in unlogged["notes"])
    assert mem["fits"] and pred["total_bytes"] < mem["hbm_bytes"]
    assert pred["argument_bytes"] == pytest.approx(mem["argument_bytes"], rel=0.02)
    assert mem["total_bytes"] <= pred["total_bytes"] <= 2 * mem["total_bytes"]
    fsdp = [c for c in report["collectives"] if c["axes"] == ["fsdp"]]
    assert {c["kind"] for c in fsdp} >= {"all-gather"}
    # The bytes a device receives in a step, by kind, within 15% of the compiler's (a
    # layer input of 1 MiB: rings, not collective matmuls; jaxpar.planner.lowering).
    by_kind: dict[str, list[float]] = {}
    for c in report["comparison"]["collectives"]:
        both = by_kind.setdefault(c["kind"], [0.0, 0.0])
        both[0] += c.get("predicted_wire_bytes_per_step") or 0.0
        both[1] += c.get("wire_bytes_per_step") or 0.0
    assert set(by_kind) >= {"all-gather", "reduce-scatter"}
    for kind, (planner, compiler) in by_kind.items():
        assert planner == pytest.approx(compiler, rel=0.15, abs=64 << 10), kind
    assert report["flops"] == pytest.approx(report["comparison"]["predicted_flops"], rel=0.25)


def test_a_step_beyond_hbm_is_refused_with_the_compilers_figures():
    config = load_config("configs/tiny.yaml", [*SMALL, "model.d_model=4096", "model.d_ff=16384",
                                               "model.n_layers=8", "plan.remat=none",
                                               "train.global_batch=64"])
    with pytest.raises(StepDoesNotFit, match="does not fit tpu-v5e:2x2: the TPU compiler "
                                             "needs .* of temporaries a device"):
        compile_step(config, targets.tpu_target("tpu-v5e:2x2"))


LIGHT = ["model.n_layers=1", "model.d_model=256", "model.n_heads=2", "model.n_kv_heads=2",
         "model.d_ff=512", "model.vocab_size=256", "train.global_batch=4", "train.seq_len=256",
         "model.attention=splash"]


@pytest.fixture(scope="module")
def context_steps():
    """The step with the sequence (1024) split over context=2 and heads over tensor=2,
    splash under both context attentions, compiled for a v5e slice; bf16 compute with
    float32 weight gradients (test_weight_gradients_are_reduced_in_the_grad_dtype)."""
    def step(kind):
        config = load_config("configs/tiny.yaml", [
            *LIGHT, "train.seq_len=1024", "model.max_seq_len=1024", "mesh.data=1",
            "mesh.context=2", "mesh.tensor=2", "model.n_heads=4", "model.n_kv_heads=2",
            f"plan.context_attention={kind}", "plan.precision=p=f32,c=bf16,o=f32",
            "plan.grad_dtype=float32"])
        return compile_step(config, targets.tpu_target("tpu-v5e:2x2"))
    return {kind: step(kind) for kind in ("allgather", "ring")}


@pytest.mark.parametrize("kind,kernels", [("allgather", 3), ("ring", 6)])
def test_splash_compiles_for_a_tpu_under_context_parallelism(context_steps, kind, kernels):
    """The Mosaic kernels under a context axis: all-gather, one forward and two backward
    (dq, dkv) per layer; ring, those for each of the two key blocks. No score-sized
    temporary: plain blocks hold (4 rows x 2 heads a device) x 512 local queries x 1024
    keys in f32, 16 MiB a buffer, several of them; the whole step's temporaries are less
    than one."""
    step = context_steps[kind]
    text = step.compiled.as_text()
    assert custom_calls(text).get("tpu_custom_call", 0) == kernels
    assert ("all-gather" if kind == "allgather" else "collective-permute") in text
    temp = step.compiled.memory_analysis().temp_size_in_bytes
    assert 0 < temp < 4 * 2 * 512 * 1024 * 4


def _reduced_layer_gradient_dtypes(text: str) -> set[str]:
    """The dtypes of the all-reduced layer-stack kernels' gradients: rank 4 (layers, embed,
    heads, head_dim) arrays."""
    import re

    return {dtype for line in text.splitlines() if " all-reduce(" in line
            for dtype in re.findall(r"(bf16|f32)\[1,\d+,\d+,\d+\]", line.split(
                " all-reduce(")[0])}


def test_splash_under_tensor_parallelism_and_weight_gradients_in_the_grad_dtype():
    """One program on data=2 x tensor=2 checked for two facts: splash compiles under
    tensor parallelism (heads split over tensor) as the Mosaic kernels, forward and two
    backward; and the TPU compiler's data-parallel all-reduce of the layers' weight
    gradients carries the plan's grad_dtype, here the compute dtype, bf16 (XLA:CPU widens
    every all-reduce to f32, so only the TPU program tells them apart; float32 in
    test_weight_gradients_are_reduced_in_the_grad_dtype)."""
    config = load_config("configs/tiny.yaml", [*LIGHT, "mesh.data=2", "mesh.fsdp=1",
                                               "mesh.tensor=2",
                                               "plan.precision=p=f32,c=bf16",
                                               "plan.grad_dtype=compute"])
    text = compile_step(config, targets.tpu_target("tpu-v5e:2x2")).compiled.as_text()
    assert custom_calls(text).get("tpu_custom_call", 0) >= 3
    assert _reduced_layer_gradient_dtypes(text) == {"bf16"}


def test_weight_gradients_are_reduced_in_the_grad_dtype(context_steps):
    """grad_dtype=float32 under bf16 compute: the ring program's all-reduce of the layers'
    weight gradients over the context axis (which splits the batch's sequence, so each
    device holds a partial gradient) is f32 on the TPU compiler."""
    text = context_steps["ring"].compiled.as_text()
    assert _reduced_layer_gradient_dtypes(text) == {"f32"}
