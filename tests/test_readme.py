"""The README's Python examples that touch LoRA, losses, linen or Hugging Face checkpoints,
executed as written: each block runs in a namespace holding what its prose says it is
given (``model``, ``plan``, ...), then any ``trainer`` it built takes a step."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.adapters import lora
from jaxpar.models import Transformer
from tests import user_models as um
from tests.helpers import SMALL

README = Path(__file__).resolve().parents[1] / "README.md"
TOPICS = re.compile(r"lora|loss|linen|hf\.|stage_model", re.IGNORECASE)


def blocks() -> list[str]:
    text = README.read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if TOPICS.search(b)
            and "jax_num_cpu_devices" not in b]  # those set up JAX: a process of their own


def _plan() -> jaxpar.Plan:
    return jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp")


def _batch(code: str, vocab: int) -> object:
    tokens = np.random.default_rng(0).integers(0, vocab, (8, 17)).astype(np.int32)
    if "batch[" in code:  # a loss over a dict batch
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                "mask": np.ones((8, 16), np.float32)}
    return tokens


def namespace(code: str, tmp_path: Path) -> tuple[dict, int]:
    """What the block's surrounding prose gives it, and the model's vocabulary."""
    plan = _plan()
    ns = {"jax": jax, "jnp": jnp, "np": np, "nnx": nnx, "optax": optax, "jaxpar": jaxpar,
          "lora": lora, "plan": plan}
    vocab = SMALL.vocab_size
    if "from_linen" in code:  # the linen section: a GPT-2-style linen decoder
        ns["plan"] = jaxpar.Plan.from_preset(plan.mesh, "fsdp_tp",
                                             annotations=um.GPT_ANNOTATIONS)
        ns["LinenGPT"] = um.LinenGPT
        vocab = um.VOCAB
    elif "self_attn" in code:  # the LoRA-on-any-projection block: a Llama-like and an MHA model
        annotated = jaxpar.Plan.from_preset(plan.mesh, "fsdp_tp",
                                            annotations=um.LLAMA_ANNOTATIONS)
        ns["plan"] = annotated
        ns["model"] = jaxpar.init_sharded(lambda: um.LlamaLike(rngs=nnx.Rngs(0)), annotated)
        ns["mha_model"] = jaxpar.init_sharded(lambda: um.MhaLM(rngs=nnx.Rngs(0)), annotated)
        vocab = um.VOCAB
    elif "stage_model" in code:  # pipeline stages for a Llama-like model of the user's
        mesh = jaxpar.make_mesh({"stage": 2, "fsdp": 4})
        ns["plan"] = jaxpar.Plan.from_preset(mesh, "fsdp", annotations=um.LLAMA_ANNOTATIONS)
        ns["MyLM"] = lambda rngs: um.LlamaLike(d=32, heads=4, kv_heads=2, ff=64, rngs=rngs)
        vocab = um.VOCAB
    elif "hf." in code:  # a Hugging Face folder written by transformers
        from jaxpar import hf
        from tests.hf.test_convert import make_hf_model

        make_hf_model(tmp_path / "hf", "llama31")
        code = code.replace("path/to/model", str(tmp_path / "hf"))
        code = code.replace('"out/', f'"{tmp_path}/out/')
        base = hf.load(tmp_path / "hf", plan=plan)
        ns["lora_model"] = lora.apply(base, rank=4, plan=plan)
    else:
        ns["model"] = jaxpar.init_sharded(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)), plan)
    ns["__code__"] = code
    return ns, vocab


@pytest.mark.parametrize("code", blocks(), ids=lambda b: b.strip().splitlines()[0][:40])
def test_readme_block_runs(devices, code, tmp_path):
    ns, vocab = namespace(code, tmp_path)
    code = ns.pop("__code__")
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102 - the README's own code
    trainer = ns.get("trainer")
    if trainer is not None:
        losses = [trainer.step(_batch(code, vocab))["loss"] for _ in range(2)]
        assert np.isfinite(losses).all()
    if "merged" in ns:
        assert not lora.adapted(ns["merged"])
    if "hf.save(" in code:
        assert (tmp_path / "out" / "model" / "config.json").exists()
        assert (tmp_path / "out" / "adapters" / "adapter_config.json").exists()


def test_every_topic_block_is_collected():
    assert len(blocks()) >= 4


def test_the_python_api_block_runs_as_printed_in_a_fresh_interpreter(tmp_path):
    """The first block under "The Python API" sets up its own 8 CPU devices, so it runs
    as a user would paste it: a new Python process in the repository."""
    import subprocess
    import sys

    text = README.read_text()
    code = re.search(r"## The Python API\n\n```python\n(.*?)```", text, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", code], cwd=README.parent, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'loss'" in done.stdout and "'step': 1" in done.stdout, done.stdout

