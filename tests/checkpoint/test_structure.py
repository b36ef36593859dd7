"""Checkpoints read across the layouts a user's blocks ran in: a list, a scanned stack,
pipeline stages. The model is :class:`tests.user_models.LlamaLike` (no jaxpar inside); a
checkpoint written in one layout must restore onto another and continue with the losses
the first layout gives, and a pipelined run from the CLI samples and resumes without
stages."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.checkpoint import structure
from jaxpar.checkpoint.checkpointer import Checkpointer
from jaxpar.cli import main
from jaxpar.hf.own_weights import FILE, load_own_weights
from jaxpar.parallel.staged import StageSplit, stage_model
from jaxpar.runs.generate import load_run_model
from tests import user_models as um

LAYERS = 4
LLAMA_SPLIT = StageSplit(embed=lambda m, t: m.embed_tokens(t), blocks="layers",
                         head=lambda m, h: m.lm_head(m.norm(h)))
"""How LlamaLike divides into pipeline stages (``pipeline.split`` names it below)."""


def tokens(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, um.VOCAB, (8, 17)).astype(np.int32)


def trainer(layout: str) -> jaxpar.Trainer:
    """LlamaLike as a list (``list``), scanned (``scan``) or on 2 stages by GPipe."""
    axes = {"stage": 2, "fsdp": 4} if layout == "staged" else {"fsdp": 8}
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), "fsdp",
                                   annotations=um.LLAMA_ANNOTATIONS,
                                   scan_blocks=layout == "scan")

    def build() -> nnx.Module:
        model = um.LlamaLike(layers=LAYERS, rngs=nnx.Rngs(0))
        return stage_model(model, LLAMA_SPLIT, stages=2, schedule="gpipe") if (
            layout == "staged") else model

    return jaxpar.Trainer(jaxpar.init_sharded(build, plan), optax.adam(1e-2), plan)


@pytest.mark.parametrize("saved,restored", [("scan", "list"), ("staged", "scan")])
def test_a_checkpoint_restores_onto_another_layout_and_continues(devices, tmp_path, saved,
                                                                   restored):
    """Two steps in one layout, saved; restored in another, the third step's loss is the
    one the saving layout computes (rtol 1e-5), and the weights are the same arrays."""
    first = trainer(saved)
    for i in range(2):
        first.step(tokens(i))
    with Checkpointer(tmp_path, every=1, async_save=False) as ckpt:
        ckpt.save(first, force=True)
    second = trainer(restored)
    with Checkpointer(tmp_path) as ckpt:
        stacks = ckpt.restore(second)["stacks"]
    assert stacks == {"scan": [{"path": "layers", "home": "layers", "layers": LAYERS,
                                "stages": 0, "per": 1, "rest": ""}],
                      "staged": [{"path": "blocks", "home": "layers", "layers": LAYERS,
                                  "stages": 2, "per": 2, "rest": "model/"}]}[saved]
    assert structure.stacks_of(second.structure) == (
        [] if restored == "list" else [structure.Stack("layers", "layers", LAYERS)])
    assert second.step_count == 2
    own = {layout: jaxpar.unscan_blocks(t.model.unstaged() if layout == "staged"
                                        else t.model)
           for layout, t in ((saved, first), (restored, second))}
    a, b = (nnx.to_flat_state(nnx.state(own[k], nnx.Param)) for k in (saved, restored))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()),
                                      err_msg=str(path))
    np.testing.assert_allclose(second.step(tokens(2))["loss"], first.step(tokens(2))["loss"],
                               rtol=1e-5)


CONFIG = f"""\
model:
  factory: tests.user_models:llama_like
  kwargs: {{d: 32, heads: 4, kv_heads: 2, ff: 64, layers: {LAYERS}}}
  vocab_size: {um.VOCAB}
mesh: {{stage: 2, fsdp: 4}}
pipeline: {{schedule: 1f1b, microbatches: 4, split: tests.checkpoint.test_structure:LLAMA_SPLIT}}
plan: {{rules: fsdp}}
train: {{steps: 2, global_batch: 16, seq_len: 16}}
checkpoint: {{every: 2}}
data: {{source: ids.npy}}
"""


def test_a_1f1b_user_run_samples_exports_and_resumes_without_stages(devices, tmp_path,
                                                                      monkeypatch, capsys):
    """The issue's case: a 1F1B run of a user's model; `jaxpar sample --run` reads it into
    the model without stages, `jaxpar export` writes it under the model's own names (read
    back into the user's class, it computes what the run's model does), and `--resume` on
    fsdp 8 without stages continues with the losses the pipelined run gives (rtol 1e-5).
    The commands run in this process (the model and the split are found by import path
    as in a fresh one; a subprocess each cost a JAX start and a compile cache read)."""
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(
        0, um.VOCAB, 20_000).astype(np.uint16))
    (tmp_path / "run.yaml").write_text(CONFIG)
    # Four steps on the pipeline, checkpoints at 2 and 4: steps 3 and 4 are what a resume
    # from step 2 must give.
    assert main(["train", "--config", "run.yaml", "--devices", "8", "--out", "a",
                 "train.steps=4"]) == 0
    capsys.readouterr()
    assert main(["sample", "--run", "a", "--prompt", "!#", "--max-tokens", "4",
                 "--temperature", "0"]) == 0
    sampled = capsys.readouterr().out
    assert sampled.startswith("!#") and len(sampled.strip()) >= 3
    assert main(["export", "--run", "a", "--to-hf", "own"]) == 0
    mine = load_own_weights(um.LlamaLike(d=32, heads=4, kv_heads=2, ff=64, layers=LAYERS,
                                         rngs=nnx.Rngs(1)), tmp_path / "own" / FILE)
    assert mine.layers[3].self_attn.q_proj.kernel.shape == (32, 4, 8)  # under its own names
    run_model, _ = load_run_model(tmp_path / "a")
    x = jax.numpy.asarray(tokens(0)[:, :-1])
    np.testing.assert_allclose(mine(x), run_model(x), rtol=1e-5, atol=1e-5)

    def losses(run: str) -> list[float]:
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text()
                .splitlines()]
        return [r["loss"] for r in rows if "loss" in r and r["step"] > 2]

    # The pipelined run's checkpoint 2, resumed on fsdp 8 without stages.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
    assert main(["train", "--config", "run.yaml", "--devices", "8", "--out", "b",
                 "--resume", "train.steps=4", "mesh.stage=1", "mesh.fsdp=8"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert len(losses("a")) == 2
    np.testing.assert_allclose(losses("b"), losses("a"), rtol=1e-5)


def test_unscan_gives_the_model_as_written(devices):
    model = trainer("scan").model
    assert jaxpar.scanned_paths(model) == {"layers": LAYERS}
    plain = jaxpar.unscan_blocks(model)
    assert isinstance(plain.layers, nnx.List) and len(plain.layers) == LAYERS
    assert isinstance(plain.layers[0], um.LlamaDecoderLayer) and not jaxpar.scanned_paths(plain)
    x = jax.numpy.asarray(tokens(0)[:, :-1])
    reference = um.LlamaLike(layers=LAYERS, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(plain(x), reference(x), rtol=1e-5, atol=1e-5)
