"""DiLoCo across the data axis: against synchronous data parallelism, read from the
compiled programs, resumed from a checkpoint, and refused in one line where it cannot run."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.analysis.hlo import collective_table
from jaxpar.checkpoint.checkpointer import Checkpointer
from jaxpar.config.validate import check_config
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.training.diloco import DiLoCo, fragments_of
from tests.user_models import (
    LINEN_LLAMA_ANNOTATIONS,
    VOCAB,
    ExplicitLinearLM,
    LinenLlamaForCausalLM,
)

CFG = TransformerConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32)
MESH = {"data": 2, "fsdp": 4}  # two replicas (slices), FSDP over four devices in each


def batches(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, CFG.vocab_size, (16, 17)).astype(np.int32) for _ in range(n)]


def inner(optimizer=None, **knobs) -> jaxpar.Trainer:
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH), "fsdp_tp", **knobs)
    model = jaxpar.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), plan)
    return jaxpar.Trainer(model, optimizer or optax.adam(1e-2), plan)


def sgd() -> optax.GradientTransformation:
    return optax.sgd(0.1, momentum=0.9)


@functools.cache
def synchronous() -> tuple[list[float], list[np.ndarray]]:
    step = inner(sgd())
    losses = [float(step.step(b)["loss"]) for b in batches(5)]
    return losses, [np.asarray(x) for x in jax.tree.leaves(step.state["params"])]


def test_every_step_meeting_with_plain_outer_sgd_is_synchronous_data_parallelism(devices):
    """H = 1, outer SGD at learning rate 1 without momentum, inner SGD with momentum: the
    replicas' mean update is the synchronous step's, so losses and weights agree."""
    run = DiLoCo(inner(sgd()), sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                 nesterov=False)
    got = [float(run.step(b)["loss"]) for b in batches(5)]
    want, weights = synchronous()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    anchor = jax.tree.leaves(run.state["anchor"])
    for a, w in zip(anchor, weights, strict=True):
        np.testing.assert_allclose(np.asarray(a), w, rtol=1e-5, atol=1e-6)


def _data_bytes(compiled_text: str, mesh) -> int:
    return sum(r["bytes_per_device"] for r in collective_table(compiled_text, mesh)
               if "data" in r["axes"])


def test_only_meetings_cross_the_data_axis(devices):
    """The inner step sends nothing over data but the metrics' mean (a few bytes); a
    meeting all-reduces the weights (float32) once; each of two streaming fragments
    about half of that; the synchronous step all-reduces gradients every step."""
    batch = batches(1)[0]
    plain = inner()
    params = sum(x.size for x in jax.tree.leaves(plain.state["params"]))
    per_step = _data_bytes(plain.lower(batch).compile().as_text(), plain.plan.mesh)
    run = DiLoCo(inner(), sync_every=4)
    mesh = run.plan.mesh
    assert _data_bytes(run.lower(batch).compile().as_text(), mesh) <= 64
    whole = collective_table(run.lower(batch, fragment=0).compile().as_text(), mesh)
    kinds = {(r["kind"], tuple(r["axes"])) for r in whole if "data" in r["axes"]}
    assert kinds == {("all-reduce", ("data",))}
    meeting = _data_bytes(run.lower(batch, fragment=0).compile().as_text(), mesh)
    # every weight once in float32, divided over the four fsdp devices of a replica
    assert 0.9 * 4 * params / 4 <= meeting <= 1.1 * 4 * params / 4
    # the synchronous step moves gradients of the same order every step (the embedding
    # table's only over data, it being looked up where it lies)
    assert 0.5 * meeting < per_step < 1.1 * meeting
    streaming = DiLoCo(inner(), sync_every=4, fragments=2)
    halves = [_data_bytes(streaming.lower(batch, fragment=f).compile().as_text(), mesh)
              for f in (0, 1)]
    for half in halves:
        assert 0.4 * meeting <= half <= 0.6 * meeting
    assert [streaming.meeting(t) for t in range(1, 9)] == [None, 0, None, 1] * 2


def test_int8_outer_gradients_halve_a_meeting(devices):
    """outer_bits=8: a meeting all-gathers int8 outer gradients (and a float32 scale a
    row of each device's block) over data: two replicas' int8 values are half the float32
    all-reduce's bytes, and this model's 8-wide rows add a scale every 8 values (under 70%
    in all); with
    H = 1 and plain outer SGD the run stays within quantization error of synchronous
    data parallelism."""
    batch = batches(1)[0]
    exact = DiLoCo(inner(), sync_every=4)
    low = DiLoCo(inner(), sync_every=4, outer_bits=8)
    mesh = exact.plan.mesh
    full = _data_bytes(exact.lower(batch, fragment=0).compile().as_text(), mesh)
    text = low.lower(batch, fragment=0).compile().as_text()
    rows = collective_table(text, mesh)
    assert {r["kind"] for r in rows if "data" in r["axes"]} == {"all-gather"}
    assert any(" all-gather(" in line and "s8[" in line for line in text.splitlines())
    assert _data_bytes(text, mesh) < 0.7 * full
    run = DiLoCo(inner(sgd()), sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                 nesterov=False, outer_bits=8)
    got = [float(run.step(b)["loss"]) for b in batches(5)]
    np.testing.assert_allclose(got, synchronous()[0], rtol=2e-3)


def test_fragments_cut_stacked_layers_by_range(devices):
    """Two fragments: every weight element in exactly one, the stacked layers cut by
    layer ranges, the two within a few percent of each other in size."""
    params = inner().state["params"]
    leaves = jax.tree.leaves(params)
    parts = fragments_of(params, 2)
    sizes = [sum(leaves[i].size if rows is None else leaves[i][rows].size
                 for i, rows in part) for part in parts]
    assert sum(sizes) == sum(x.size for x in leaves)
    assert abs(sizes[0] - sizes[1]) < 0.1 * sum(sizes)
    assert any(rows is not None for i, rows in parts[0])


def _save(run: DiLoCo, folder) -> None:
    with Checkpointer(folder) as ckpt:
        ckpt.save(run, force=True)


def _restored(run, folder) -> DiLoCo:
    """A new ``run()`` restored from the checkpoint in ``folder``."""
    resumed = run()
    with Checkpointer(folder) as ckpt:
        ckpt.restore(resumed)
    return resumed


def test_long_syncs_learn_and_stale_updates_resume_exactly(devices, tmp_path):
    """H = 2 with Nesterov outer momentum and a one-meeting delay: the loss falls; a run
    saved after 3 steps (mid-way between meetings, a gradient pending) and restored into
    a new DiLoCo continues exactly as the saved run, which went on without stopping."""
    data = batches(1) * 6

    def run():
        return DiLoCo(inner(), sync_every=2, staleness=1)

    whole, want = run(), []
    for t, b in enumerate(data, start=1):
        want.append(float(whole.step(b)["loss"]))
        if t == 3:
            _save(whole, tmp_path)  # saved mid-run; the run goes on as if it never was
    assert want[-1] < want[0]
    assert float(np.abs(np.asarray(jax.tree.leaves(whole.state["pending"])[0])).max()) > 0
    resumed = _restored(run, tmp_path)
    assert resumed.step_count == 3
    got = [float(resumed.step(b)["loss"]) for b in data[3:]]
    assert got == want[3:]
    assert np.isfinite(resumed.eval_loss(data[0]))


def _replica(devs) -> jaxpar.Trainer:
    """One replica by itself: the inner trainer's FSDP over four devices."""
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4}, devices=devs), "fsdp_tp")
    model = jaxpar.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), plan)
    return jaxpar.Trainer(model, sgd(), plan)


def test_overlapped_meetings_follow_the_rule_and_carry_the_all_reduce(devices, tmp_path):
    """overlap: the meeting after step t runs in step t + 1's program. Against two
    separate replicas (each a trainer on four devices, fed its half of the batch) merged
    by hand in numpy: at step t + 1 the outer SGD step (Nesterov) on the mean of ``anchor -
    replica weights at t``, then each replica = new anchor + what it learnt in step t + 1.
    The step carrying a meeting all-reduces the weights over data, the others nothing;
    a run saved with a meeting in flight resumes exactly; the anchor it reports has the
    meeting in flight applied."""
    lr, mu = 0.7, 0.9
    data = batches(4)

    def run():
        return DiLoCo(inner(sgd()), sync_every=2, outer_lr=lr, outer_momentum=mu,
                      overlap=True)

    whole, got = run(), []
    for t, b in enumerate(data, start=1):
        got.append(float(whole.step(b)["loss"]))
        if t == 2:
            _save(whole, tmp_path)  # its meeting in flight; the run goes on
    # the reference
    reps = [_replica(devices[:4]), _replica(devices[4:])]
    weights = lambda r: [np.asarray(x, np.float64) for x in jax.tree.leaves(r.state["params"])]  # noqa: E731
    anchor = weights(reps[0])
    momentum = [np.zeros_like(a) for a in anchor]
    want, pending = [], None
    for t, b in enumerate(data, start=1):
        before = [weights(r) for r in reps]
        want.append(np.mean([float(r.step(b[8 * i:8 * i + 8])["loss"])
                             for i, r in enumerate(reps)]))
        if pending is not None:  # the meeting after step t - 1, applied with step t
            g = [np.mean([a - w[k] for w in pending], axis=0) for k, a in enumerate(anchor)]
            momentum = [mu * m + gk for m, gk in zip(momentum, g, strict=True)]
            anchor = [a - lr * (gk + mu * m)
                      for a, gk, m in zip(anchor, g, momentum, strict=True)]
            for r, old in zip(reps, before, strict=True):
                new = [a + w - o for a, w, o in zip(anchor, weights(r), old, strict=True)]
                tdef = jax.tree.structure(r.state["params"])
                params = jax.device_put(jax.tree.unflatten(tdef, [x.astype(np.float32)
                                                                 for x in new]),
                                        r.state_shardings["params"])
                r.state = dict(r.state, params=params)
        pending = [weights(r) for r in reps] if t % 2 == 0 else None
    np.testing.assert_allclose(got, want, rtol=2e-5)
    for a, w in zip(jax.tree.leaves(whole.state["anchor"]), anchor, strict=True):
        np.testing.assert_allclose(np.asarray(a), w, rtol=1e-4, atol=1e-6)
    # after step 4 a meeting is in flight: the reported anchor has it applied
    g = [np.mean([a - w[k] for w in pending], axis=0) for k, a in enumerate(anchor)]
    final = [a - lr * (gk + mu * (mu * m + gk))
             for a, gk, m in zip(anchor, g, momentum, strict=True)]
    for a, w in zip(jax.tree.leaves(whole.anchor_state()["params"]), final, strict=True):
        np.testing.assert_allclose(np.asarray(a), w, rtol=1e-4, atol=1e-6)
    # the collectives: a meeting's bytes in the step that carries it, none in the others
    mesh = whole.plan.mesh
    carried = _data_bytes(whole.lower(data[0], fragment=0).compile().as_text(), mesh)
    params = sum(x.size for x in jax.tree.leaves(whole.state["anchor"]))
    assert 0.9 * 4 * params / 4 <= carried <= 1.1 * 4 * params / 4 + 64
    assert _data_bytes(whole.lower(data[0]).compile().as_text(), mesh) <= 64
    # saved after step 2 (its meeting in flight), restored, continued: the same losses
    resumed = _restored(run, tmp_path)
    assert [float(resumed.step(b)["loss"]) for b in data[2:]] == got[2:]


@pytest.mark.parametrize("mesh,knobs,kwargs,message", [
    ({"fsdp": 8}, {}, {}, "give the mesh data >= 2"),
    (MESH, {"zero_stage": 1}, {}, "needs plan.zero_stage=0"),
    (MESH, {}, {"fragments": 3}, "must divide diloco.sync_every=4"),
])
def test_runs_it_cannot_take_get_one_line(devices, mesh, knobs, kwargs, message):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(mesh), "fsdp_tp", **knobs)
    model = jaxpar.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), plan)
    with pytest.raises(jaxpar.JaxparError, match=message):
        DiLoCo(jaxpar.Trainer(model, optax.adam(1e-2), plan), sync_every=4, **kwargs)


@pytest.mark.parametrize("overrides,message", [
    (["diloco.sync_every=4", "diloco.fragments=3"], "diloco.fragments"),
    (["diloco.sync_every=4", "mesh.data=1"], "give the mesh data >= 2"),
    (["diloco.outer_momentum=1.5"], "diloco.outer_momentum"),
    (["diloco.outer_bits=16"], "diloco.outer_bits"),
    (["diloco.sync_every=4", "diloco.overlap=true", "diloco.staleness=1"], "diloco.overlap"),
])
def test_config_refusals_name_the_knob(overrides, message):
    with pytest.raises(jaxpar.JaxparError, match=message):
        check_config(jaxpar.load_config("configs/tiny.yaml", overrides), devices=8)


class FsdpRowsLM(nnx.Module):
    """Written for explicit sharding, its activations split over fsdp only (a model that
    names data in its own shardings is told, in one line, to leave it out)."""

    def __init__(self, d: int = 32, ff: int = 64, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.3)
        self.embed = nnx.Param(init(rngs.params(), (64, d)), out_sharding=P(None, "fsdp"))
        self.up = nnx.Param(init(rngs.params(), (d, ff)), out_sharding=P("fsdp", "tensor"))
        self.head = nnx.Param(init(rngs.params(), (d, 64)), out_sharding=P("fsdp", None))

    def __call__(self, tokens):
        rows = P("fsdp", None, None)
        x = jax.sharding.reshard(self.embed[...], P(None, None)).at[tokens].get(
            out_sharding=rows)
        up = jax.sharding.reshard(self.up[...], P(None, "tensor"))
        h = jax.nn.gelu(jax.numpy.einsum("bsd,df->bsf", x, up))
        x = x + jax.numpy.einsum("bsf,df->bsd", h, up, out_sharding=rows)
        return jax.numpy.einsum("bsd,dv->bsv", x,
                                jax.sharding.reshard(self.head[...], P(None, None)))


def test_diloco_on_an_explicit_mesh_reads_its_anchor_back(devices):
    """Two replicas over data on an explicit-sharding mesh: H = 1 with outer SGD at lr 1
    equals synchronous training (to float rounding), and the anchor's model and loss read
    back (replica 0's stacked state gathered first)."""
    mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, explicit=True)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    tokens = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)

    def fresh():
        model = jaxpar.init_sharded(lambda: FsdpRowsLM(rngs=nnx.Rngs(0)), plan)
        return jaxpar.Trainer(model, optax.sgd(0.1), plan)

    run = DiLoCo(fresh(), sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    sync = fresh()
    got = [float(run.step(tokens)["loss"]) for _ in range(3)]
    want = [float(sync.step(tokens)["loss"]) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(run.eval_loss(tokens), sync.eval_loss(tokens), rtol=1e-5)
    anchor = np.asarray(jax.device_get(run.model.up[...]))
    np.testing.assert_allclose(anchor, np.asarray(sync.model.up[...]), rtol=1e-5, atol=1e-6)


def test_a_model_naming_data_under_diloco_is_told_to_leave_it_out(devices):
    mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, explicit=True)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    model = jaxpar.init_sharded(lambda: ExplicitLinearLM(rngs=nnx.Rngs(0)), plan)
    run = DiLoCo(jaxpar.Trainer(model, optax.sgd(0.1), plan), sync_every=2)
    tokens = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
    with pytest.raises(jaxpar.JaxparError, match="names mesh axis 'data' in its own "
                                                 "shardings"):
        run.step(tokens)


def test_diloco_on_a_linen_model_equals_synchronous_at_h1(devices):
    """A Hugging Face-style linen Llama through jaxpar.from_linen, two replicas over data,
    FSDP in each: H = 1 with outer SGD at lr 1 equals synchronous training, and the
    anchor's loss reads back. (The feature-pair table cites it for DiLoCo x linen.)"""
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH), "fsdp_tp",
                                   annotations=LINEN_LLAMA_ANNOTATIONS)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (16, 17)).astype(np.int32)

    def fresh():
        model = jaxpar.init_sharded(lambda: jaxpar.from_linen(
            LinenLlamaForCausalLM(), np.zeros((2, 8), np.int32)), plan)
        return jaxpar.Trainer(model, sgd(), plan)

    run = DiLoCo(fresh(), sync_every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    sync = fresh()
    got = [float(run.step(tokens)["loss"]) for _ in range(3)]
    want = [float(sync.step(tokens)["loss"]) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(run.eval_loss(tokens), sync.eval_loss(tokens), rtol=1e-5)
