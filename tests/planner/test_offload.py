"""The planner prices host offload: what moves to host memory (optimizer state, streamed
layer weights, activations saved by name), what the transfers cost, and that the search
finds an offload plan for a model that fits nowhere without one (Llama-3-70B on one
8-GPU node), with an explanation that says what moved and what it costs."""

import dataclasses

import pytest
import yaml

import jaxpar
from jaxpar.cli import main
from jaxpar.errors import JaxparError
from jaxpar.models import TransformerConfig
from jaxpar.planner import BUILTIN, Candidate, Machine, estimate, plan
from jaxpar.planner.api import to_dict
from jaxpar.planner.cost import check_divisible
from jaxpar.planner.layout import layout
from jaxpar.planner.memory import memory
from jaxpar.planner.model import from_transformer
from jaxpar.planner.offload import STREAMED_LAYERS, UPDATE_SLABS
from jaxpar.planner.roofline import recomputed_parts
from tests.planner.cases import TINY

GIB = 2**30

LLAMA3_70B = TransformerConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                               n_kv_heads=8, d_ff=28672, max_seq_len=4096)
"""Llama-3-70B's shapes (128k vocabulary, grouped-query attention with 8 KV heads)."""
NODE = dict(chips="h100:8", global_batch=8, seq=4096)
"""One DGX H100 node at global batch 8 x seq 4096."""

FOUR_LAYERS = dataclasses.replace(TINY, n_layers=4)
SPEC = from_transformer(FOUR_LAYERS)
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
BATCH, SEQ = 16, 128


def _memory(backend: str = "gpu", **knobs) -> dict[str, float]:
    """The memory model's figures for the 4-layer tiny model on data 2 x fsdp 2 x tensor
    2, ZeRO-1, bf16 compute with f32 master weights and Adam."""
    cand = Candidate.make(MESH, zero_stage=1, **knobs)
    return memory(SPEC, layout(SPEC, cand.sizes, cand.rules, 1), cand, BATCH, SEQ, backend)


def _machine(**chip) -> Machine:
    return Machine(dataclasses.replace(BUILTIN["h100"], **chip), 8)


def _estimate(machine: Machine | None = None, **knobs):
    return estimate(FOUR_LAYERS, Candidate.make(MESH, zero_stage=1, **knobs),
                    chips=machine or _machine(), global_batch=BATCH, seq=SEQ)


# --- the search ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama3_on_a_node():
    """The plans for Llama-3-70B on one H100 node without offload and with it."""
    return plan(LLAMA3_70B, **NODE), plan(LLAMA3_70B, **NODE, offload="auto")


def test_llama3_70b_fits_one_node_only_with_offload(llama3_on_a_node):
    plain, offloaded = llama3_on_a_node
    # Without offload: f32 master weights and Adam's moments alone are 12 bytes a
    # parameter, 106 GB a GPU, more than an 80 GB H100 holds.
    assert plain and not any(p.fits for p in plain)
    assert min(p.memory_per_device_bytes for p in plain) > 0.9 * 80e9
    best = offloaded[0]
    assert best.fits and best.candidate.offloads_state
    assert all(p.fits and p.candidate.offloads for p in offloaded)
    mem = best.memory
    assert mem["total_bytes"] <= 0.9 * 80e9
    assert 0 < mem["host_bytes"] <= 0.9 * BUILTIN["h100"].host_bytes
    # What moved left the device: the state's device share is what stayed.
    state = mem["param_bytes"] + mem["master_bytes"] + mem["opt_bytes"] + mem["batch_bytes"]
    assert mem["argument_bytes"] == pytest.approx(
        state - mem["host_opt_bytes"] - mem["host_param_bytes"])
    # The offload costs time, reported as its own terms of the breakdown.
    assert best.offload_s > 0 and best.offload_s == pytest.approx(
        sum(t for k, t in best.breakdown.items() if k.startswith("offload")))
    assert best.step_time_s > best.offload_s


def test_the_explanation_says_what_moved_what_it_costs_and_why(llama3_on_a_node):
    plain, offloaded = llama3_on_a_node
    best = offloaded[0]
    text = best.reason
    assert f"host offload moves {best.memory['host_bytes'] / GIB:.1f} GiB per device" in text
    # the host memory the runtime will pin (80% of the RAM), not the RAM
    assert f"of {BUILTIN['h100'].host_pool_bytes / GIB:.1f} GiB" in text
    assert f"{best.offload_s:.3f} s a step exposed" in text
    leanest = min(plain, key=lambda p: p.memory_per_device_bytes)
    assert (f"nothing fits without offload (the leanest plan without it, "
            f"{leanest.candidate.describe()}") in text
    assert f"needs {leanest.memory_per_device_bytes / GIB:.1f} GiB" in text
    if best.candidate.host_update:
        assert "updated on the host" in text


def test_offload_is_tried_only_when_asked_or_needed():
    # A model that fits: "auto" gives the very plans "never" does; "always" may pick
    # offload only where it is faster.
    kw = dict(chips="h100:8", global_batch=16, seq=128)
    never, auto = plan(TINY, **kw), plan(TINY, **kw, offload="auto")
    assert [p.candidate for p in auto] == [p.candidate for p in never]
    assert [p.step_time_s for p in auto] == [p.step_time_s for p in never]
    always = plan(TINY, **kw, offload="always")
    assert always[0].step_time_s <= never[0].step_time_s
    with pytest.raises(JaxparError, match="offload 'sometimes'"):
        plan(TINY, **kw, offload="sometimes")


def test_host_memory_limits_what_can_move():
    # Host memory too small for the offloaded state: no offload plan fits.
    machine = _machine(host_bytes=1e9)
    assert not any(p.fits for p in plan(LLAMA3_70B, chips=machine, global_batch=8, seq=4096,
                                        offload="auto"))
    assert not _estimate(_machine(host_bytes=1e3), offload_optimizer=1.0).fits
    assert _estimate(_machine(host_bytes=1e3)).fits  # nothing offloaded, nothing checked


# --- memory ------------------------------------------------------------------------------
def test_optimizer_offload_moves_master_weights_and_moments():
    plain, moved = _memory(), _memory(offload_optimizer=1.0)
    state = plain["master_bytes"] + plain["opt_bytes"]
    assert state > 0 and plain["master_bytes"] > 0  # bf16 compute: f32 master weights
    assert plain["argument_bytes"] - moved["argument_bytes"] == pytest.approx(state)
    assert moved["host_opt_bytes"] == moved["host_bytes"] == pytest.approx(state)
    assert plain["host_bytes"] == plain["offload_transient_bytes"] == 0
    # A streamed update brings the state back a slab at a time: one layer of the stacked
    # tensors (master and two moments, 12 bytes an element, ZeRO-1 shards), the one being
    # updated and the next; the rest of the update's buffers stay off the device.
    cand = Candidate.make(MESH, zero_stage=1)
    lay = layout(SPEC, cand.sizes, cand.rules, 1)
    layer = sum(p.zero for p in lay.placed if p.tensor.names[0] == "layers") * 12 / 4
    assert moved["offload_transient_bytes"] == pytest.approx(UPDATE_SLABS * layer)
    # (The compilers update in place once the backward pass is done: the slabs replace
    # the update's buffers in the step's peak, here the backward pass's working set.)
    assert 0 <= moved["temp_bytes"] - plain["temp_bytes"] <= UPDATE_SLABS * layer
    # Updated on the host, the update's buffers do not enter the device; the slabs pass
    # through it as they do in a streamed update.
    host = _memory(offload_optimizer=1.0, host_update=True)
    assert host["offload_transient_bytes"] == moved["offload_transient_bytes"]
    assert host["temp_bytes"] == moved["temp_bytes"]


def test_a_streamed_update_takes_the_layers_a_slab_asks_for():
    one, two = _memory(offload_optimizer=1.0), _memory(offload_optimizer=1.0, update_chunk=2)
    assert two["offload_transient_bytes"] == pytest.approx(2 * one["offload_transient_bytes"])


def test_a_fraction_moves_the_largest_tensors_first():
    state = _memory()["master_bytes"] + _memory()["opt_bytes"]
    moved = {f: _memory(offload_optimizer=f)["host_opt_bytes"] for f in (0.25, 0.5, 0.75, 1.0)}
    assert list(moved.values()) == sorted(moved.values())
    # Half of the bytes (counted on global shapes, as the Trainer does): the stacked MLP
    # weights (three equal tensors, 70% of the state) first: two of them and a leaf of
    # the third make half.
    mlp = 4 * 64 * 256 * 12 / 8
    assert moved[0.5] == pytest.approx(2 * mlp + mlp / 3)
    assert moved[0.5] == pytest.approx(0.5 * state, rel=0.1)
    assert mlp < moved[0.25] < 2 * mlp  # one MLP weight and a leaf of the next
    assert moved[1.0] == pytest.approx(state)


def test_streamed_weights_leave_the_device_two_layers_at_a_time():
    plain, streamed = _memory(), _memory(offload_params=True)
    # The stacked layers' bf16 working copy, as stored (data 2 x fsdp 2 x tensor 2: the
    # weights split over fsdp and tensor, 4 ways; the norm scales stay on the device).
    layer = (64 * 16 * 8 + 4 * 16 * 64 + 3 * 64 * 256) / 4
    layers = 4 * layer * 2
    assert streamed["host_param_bytes"] == pytest.approx(layers)
    # Their gradients leave the layer loop to host memory as well.
    assert streamed["host_bytes"] == pytest.approx(2 * layers)
    assert plain["argument_bytes"] - streamed["argument_bytes"] == pytest.approx(layers)
    assert streamed["offload_transient_bytes"] == pytest.approx(STREAMED_LAYERS * layers / 4)
    assert streamed["grad_bytes"] == plain["grad_bytes"]  # gradients stay on the device


def test_offloaded_activations_leave_only_the_block_input_on_the_device():
    full, offloaded = _memory(remat="full"), _memory(remat="offload:attention_out,mlp_out")
    assert offloaded["activation_bytes"] == full["activation_bytes"]
    tokens = BATCH // 4 * SEQ  # per device: data x fsdp split the batch
    # Of the two names, only the attention's output is read by the backward pass (no norm
    # follows the MLP here), so only it goes to the host: 4 layers of d_model 64 in bf16.
    assert offloaded["host_activation_bytes"] == pytest.approx(4 * 64 * 2 * tokens)
    assert offloaded["offload_transient_bytes"] == pytest.approx(2 * 64 * 2 * tokens)
    # What the policy recomputes: the outputs it saves spare their projections.
    assert recomputed_parts("offload:attention_out,mlp_out") == recomputed_parts(
        "save_attention_and_mlp_outputs")
    assert recomputed_parts("offload:mlp_hidden") == recomputed_parts("full")


def test_xla_cpu_keeps_offload_in_the_arguments_only():
    # On XLA:CPU host and device memory are one RAM: the compiled step's temporaries do
    # not change with offload, and its memory analysis counts offloaded activations
    # among them.
    plain, moved = _memory("cpu"), _memory("cpu", offload_optimizer=1.0, offload_params=True)
    assert moved["temp_bytes"] == plain["temp_bytes"] and moved["host_bytes"] > 0
    policy = "offload:attention_out,mlp_out"
    on_cpu, on_gpu = _memory("cpu", remat=policy), _memory(remat=policy)
    assert on_cpu["host_activation_bytes"] == 0 < on_gpu["host_activation_bytes"]
    assert on_cpu["activation_bytes"] == (on_gpu["activation_bytes"]
                                          + on_gpu["host_activation_bytes"])


# --- time --------------------------------------------------------------------------------
def test_a_streamed_update_moves_the_state_in_and_out_beside_the_update():
    machine = _machine(host_bw=1e8)  # a slow link: the transfer outlasts the update
    plain, moved = _estimate(machine), _estimate(machine, offload_optimizer=1.0)
    state = moved.memory["host_opt_bytes"]
    update = plain.breakdown["optimizer update"]
    assert moved.breakdown["offload optimizer state in and out (exposed)"] == pytest.approx(
        2 * state / 1e8 - update)
    assert moved.step_time_s - plain.step_time_s == pytest.approx(2 * state / 1e8 - update)


def test_a_host_update_sends_gradients_down_and_weights_up():
    machine = _machine(overlap=0.0)
    plain, host = _estimate(machine), _estimate(machine, offload_optimizer=1.0,
                                                host_update=True)
    bw = machine.chip.host_bw
    params = plain.memory["param_bytes"]  # the new bf16 working copy
    grads = plain.memory["master_bytes"]  # f32 gradients in the optimizer's layout
    assert host.breakdown["offload new weights to the device"] == pytest.approx(params / bw)
    assert host.breakdown["offload gradients to the host (exposed)"] == pytest.approx(
        grads / bw)
    # master, moments and gradient read, master and moments written, the bf16 copy out
    per = 4 + 4 + 8 + 16 + 2
    assert host.breakdown["offload update on the host"] == pytest.approx(
        grads / 4 * per / machine.chip.host_mem_bw)
    assert host.breakdown["optimizer update"] == 0  # nothing left for the device


def test_streamed_weights_cost_what_compute_does_not_hide():
    # Collectives and transfers that block (overlap 0): every byte is exposed, twice a
    # step in the layers (forward, backward) and once more after the update.
    machine = _machine(overlap=0.0)
    est = _estimate(machine, offload_params=True)
    weights = est.memory["host_param_bytes"] / machine.chip.host_bw
    assert est.breakdown["offload weight streaming (exposed)"] == pytest.approx(2 * weights)
    assert est.breakdown["offload new weights to the host"] == pytest.approx(weights)
    # Overlapped with a layer's compute, the transfer of this small model hides.
    hidden = _estimate(offload_params=True)
    assert "offload weight streaming (exposed)" not in hidden.breakdown


def test_impossible_offload_settings_are_refused():
    spec = SPEC
    half_on_host = Candidate.make(MESH, offload_optimizer=0.5, host_update=True)
    assert "host_update needs offload_optimizer=1" in check_divisible(spec, half_on_host, 16)
    staged = Candidate.make({"stage": 2, "data": 4}, offload_params=True)
    assert "pipeline stages" in check_divisible(from_transformer(FOUR_LAYERS, stages=2),
                                                staged, 16)
    assert check_divisible(spec, Candidate.make(MESH, remat="offload:nonsense"), 16)
    assert check_divisible(spec, Candidate.make(MESH, offload_params=True,
                                                remat="offload:mlp_out"), 16) is None


def test_json_summary_and_description_name_the_offload(llama3_on_a_node):
    best = llama3_on_a_node[1][0]
    row = to_dict(best, 8, 4096)
    assert row["offload_optimizer"] == best.candidate.offload_optimizer == 1.0
    assert row["host_bytes"] == int(best.memory["host_bytes"])
    assert row["offload"] == best.candidate.offload_text()
    assert row["offload"].removesuffix("+acts") in best.candidate.describe()  # the state
    assert "offload" not in to_dict(llama3_on_a_node[0][0], 8, 4096)


# --- the CLI ------------------------------------------------------------------------------
def test_jaxpar_plan_prints_the_offload_plan(capsys, tmp_path):
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "configs/llama-70b.yaml", "--chips", "h100:8",
                 "--global-batch", "8", "--seq", "4096", "--write", str(out),
                 "model.vocab_size=128256"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "offload" in lines[1] and "host GiB" in lines[1]
    first = lines[3].split()
    assert first[0] == "1" and "yes" in first and any(c.startswith("opt1") for c in first)
    why = next(line for line in lines if line.startswith("why #1:"))
    assert "host offload moves" in why and "GiB per device to host memory" in why
    assert "nothing fits without offload" in why
    assert "  offload " in text  # the breakdown lists the offload terms
    written = yaml.safe_load(out.read_text())["plan"]
    assert written["offload_optimizer"] == 1.0
    assert "host_update" in written and "offload_params" in written
    config = jaxpar.load_config(str(out))  # a run config jaxpar train accepts
    assert config.plan.offload_optimizer == 1.0


def test_jaxpar_plan_offload_never_finds_nothing_for_70b(capsys):
    assert main(["plan", "--model", "configs/llama-70b.yaml", "--chips", "h100:8",
                 "--global-batch", "8", "--seq", "4096", "--offload", "never",
                 "model.vocab_size=128256"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxpar: error: no plan fits") and "\n" not in err
