"""What brought a collective: jaxpar.analysis.sources reads the op and the model's line from
the compiled HLO, and nanoGPT's fused q/k/v projection (tests/user_models.py), annotated
as docs/guides/models.md says, trains on fsdp 4 x tensor 2 without any all-to-all."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.analysis.hlo import count_collectives
from jaxpar.analysis.sources import SPLIT_HINT, collective_sources, explain_collectives
from tests import user_models as um

# nanoGPT as docs/guides/models.md annotates a fused projection under tensor parallelism:
# c_attn's columns split over tensor, its output gathered before the split, whole heads on
# each device for the attention that follows (c_proj off the tensor axis).
FUSED_ANNOTATIONS = [
    (r"wte/embedding$", ("vocab", "embed")),
    (r"wpe/embedding$", (None, "embed")),
    (r"attn/c_attn/kernel$", ("embed", "heads")),
    (r"attn/c_proj/kernel$", (None, "embed")),
    (r"mlp/c_fc/kernel$", ("embed", "mlp")),
    (r"mlp/c_proj/kernel$", ("mlp", "embed")),
]
FUSED_LAYOUTS = [
    ("type:GPTBlock", ("batch", "seq", "embed")),
    (r"wte/embedding$", ("vocab", "embed")),
    (r"attn/c_attn$", ("batch", "seq", None)),
]
SPLIT_LINE = next(i for i, line in enumerate(inspect.getsource(um).splitlines(), 1)
                  if "jnp.split(self.c_attn(x), 3, axis=2)" in line)


def tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, um.VOCAB, (8, 17)).astype(np.int32)


def nanogpt_trainer(mesh_axes, preset, devices=None, **knobs) -> jaxpar.Trainer:
    mesh = jaxpar.make_mesh(mesh_axes, devices=devices)
    plan = jaxpar.Plan.from_preset(mesh, preset, **knobs)
    model = jaxpar.init_sharded(lambda: um.NanoGPT(rngs=nnx.Rngs(0)), plan)
    return jaxpar.Trainer(model, optax.adam(1e-2), plan, loss_fn=um.nanogpt_loss)


def test_fused_qkv_annotated_as_the_guide_says_has_no_all_to_all(devices):
    trainer = nanogpt_trainer({"fsdp": 4, "tensor": 2}, "fsdp_tp",
                              annotations=FUSED_ANNOTATIONS, layouts=FUSED_LAYOUTS)
    compiled = trainer.lower(tokens(0)).compile()
    trainer.use_compiled(tokens(0), compiled)  # the steps below run what is counted here
    hlo = compiled.as_text()
    counts = count_collectives(hlo)
    assert counts["all-to-all"] == 0, (counts, explain_collectives(hlo))
    assert explain_collectives(hlo) == []
    params = dict(nnx.to_flat_state(trainer.state["params"]))
    kernel = next(v for p, v in params.items() if p[-2:] == ("c_attn", "kernel"))
    spec = kernel.get_value().sharding.spec
    assert "tensor" in spec and "fsdp" in spec, spec  # stored split, computed split
    losses = [trainer.step(tokens(i))["loss"] for i in range(3)]
    one = nanogpt_trainer({"data": 1}, "dp", devices=jax.devices()[:1])
    np.testing.assert_allclose(losses, [one.step(tokens(i))["loss"] for i in range(3)],
                               rtol=1e-5)


def test_the_split_of_a_tensor_sharded_fused_output_is_named(devices):
    # The heads annotation alone (tests/user_models.NANOGPT_ANNOTATIONS) splits c_attn's
    # output contiguously over tensor: the backward of jnp.split exchanges it all-to-all.
    trainer = nanogpt_trainer({"fsdp": 4, "tensor": 2}, "fsdp_tp",
                              annotations=um.NANOGPT_ANNOTATIONS)
    hlo = trainer.lower(tokens(0)).compile().as_text()
    assert count_collectives(hlo)["all-to-all"] > 0
    rows = collective_sources(hlo)
    assert sum(r["count"] for r in rows) == count_collectives(hlo)["all-to-all"]
    top = rows[0]
    assert (top["op"], top["backward"], top["line"]) == ("concatenate", True, SPLIT_LINE), top
    assert top["file"].endswith("tests/user_models.py")
    assert top["function"] == "CausalSelfAttention.__call__"
    line = explain_collectives(hlo)[0]
    assert f"all-to-alls from the backward pass of tests/user_models.py:{SPLIT_LINE}" in line
    assert "`q, k, v = jnp.split(self.c_attn(x), 3, axis=2)`" in line
    assert line.endswith(SPLIT_HINT)


def test_a_small_program_names_its_own_line(devices):
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = NamedSharding(mesh, P("fsdp", None, "tensor"))

    def f(a, b):
        y = jnp.concatenate([a, b], axis=2)  # a dimension sharded over tensor, joined
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P("fsdp"))) * 2

    arg = jax.ShapeDtypeStruct((8, 4, 8), jnp.float32, sharding=sharded)
    hlo = jax.jit(f).lower(arg, arg).compile().as_text()
    rows = collective_sources(hlo, kinds=("all-to-all", "all-gather"))
    joined = [r for r in rows if not r["argument"]]
    assert joined and all(r["file"].endswith("tests/analysis/test_sources.py") for r in joined)
    assert {r["function"] for r in joined} == {
        "test_a_small_program_names_its_own_line.<locals>.f"}
    assert all("jnp.concatenate([a, b], axis=2)" in r["code"] for r in joined)
    assert not any(r["backward"] for r in rows)
    # Shardy moves the arguments' tensor split before the join: named by argument.
    for line in explain_collectives(hlo):
        assert line.startswith("1 all-to-all resharding the program's argument "), line


def test_source_file_metadata_and_no_metadata():
    older = ('  %a = f32[2]{0} all-to-all(f32[2]{0} %x), replica_groups={{0,1}}, '
             'metadata={op_name="jit(f)/transpose(jvp())/reshape" '
             'source_file="/home/me/model.py" source_line=12}')
    bare = "  %b = f32[2]{0} all-to-all(f32[2]{0} %x), replica_groups={{0,1}}"
    rows = collective_sources("\n".join([older, older, bare]))
    assert [(r["count"], r["op"], r["backward"], r["line"]) for r in rows] == [
        (2, "reshape", True, 12), (1, "?", False, None)]
    lines = explain_collectives("\n".join([older, bare]))
    assert lines[0].startswith("1 all-to-all from the backward pass of /home/me/model.py:12 "
                               "(HLO op reshape): a reshape")
    assert "unknown line" in lines[1]
    assert explain_collectives("HloModule m\n") == []
