"""The training run behind ``jaxpar train``: config in, a trained model and a run folder out.

The run folder holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one JSON
object per logged step: step, loss, step_time_s, tokens_per_s, grad_norm, eval_loss on
steps that evaluated the held-out data (``train.eval_every``), and checkpoint_block_s on
steps that started a save) and ``checkpoints/`` (see
:mod:`jaxpar.checkpoint`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from jaxpar.assembly import build_trainer
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import Config
from jaxpar.data import TokenLoader, load_tokens, split_holdout
from jaxpar.errors import JaxparError
from jaxpar.train import Trainer


def make_loader(config: Config, *, holdout: bool = False) -> TokenLoader:
    """This process's loader over the training tokens (or, with ``holdout``, over the
    held-out tail of the corpus: ``data.holdout_fraction``)."""
    tokens = load_tokens(config.data.source, config.data.max_bytes)
    train_tokens, held_out = split_holdout(tokens, config.data.holdout_fraction)
    chosen = held_out if holdout else train_tokens
    if len(chosen) < config.train.seq_len + 2:
        part = "held-out" if holdout else "training"
        raise JaxparError(
            f"data.source {config.data.source!r}: the {part} part has {len(chosen)} tokens, "
            f"fewer than one window of train.seq_len + 1 = {config.train.seq_len + 1}"
            + ("; raise data.holdout_fraction or turn off train.eval_every" if holdout else ""))
    loader = TokenLoader(
        chosen, config.train.global_batch, config.train.seq_len,
        seed=config.train.seed + (1 if holdout else 0),
        process_index=jax.process_index(), process_count=jax.process_count(),
    )
    loader.vocab_check(config.model.vocab_size)
    return loader


def evaluate(trainer: Trainer, holdout: TokenLoader, batches: int) -> float:
    """Mean loss over the first ``batches`` held-out batches (the same ones every time)."""
    return sum(trainer.eval_loss(holdout.batch(i)) for i in range(batches)) / batches


def _trim_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after ``last_step`` (steps that will be trained again on resume)."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    keep = []
    for line in rows:
        try:
            if json.loads(line).get("step", 0) <= last_step:
                keep.append(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def _changed_keys(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """Config keys that differ, ignoring layout-only sections a resume may change."""
    out = []
    for key in sorted(set(saved) | set(now)):
        if not prefix and key in _LAYOUT_SECTIONS:
            continue
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed_keys(a, b, f"{prefix}{key}.")
        elif a != b and not (isinstance(a, list) and tuple(a) == b):
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


_LAYOUT_SECTIONS = ("mesh", "plan", "pipeline", "checkpoint")


def _say(text: str) -> None:
    if jax.process_index() == 0:
        tqdm.write(f"jaxpar: {text}")


def train(config: Config, out_dir: str | Path | None = None, *, progress: bool = True,
          resume: bool = False, max_steps: int | None = None
          ) -> tuple[Trainer, list[dict[str, Any]]]:
    """Train ``config`` up to ``config.train.steps`` steps; returns the trainer and the
    metrics of the steps this call trained.

    With ``out_dir``, checkpoints go to ``out_dir/checkpoints`` (see
    :mod:`jaxpar.checkpoint`) every ``checkpoint.every`` steps and at the end.

    Args:
      resume: continue from the newest complete checkpoint in ``out_dir/checkpoints``
        (the layout may differ from the one it was saved under); a fresh start when there
        is none. ``metrics.jsonl`` is continued without repeating steps.
      max_steps: stop after this many steps in this call (saving a checkpoint first), as a
        time-boxed session on preemptible machines would.

    Raises:
      JaxparError: for ``resume`` without ``out_dir``, or a fresh run into a folder that
        already holds checkpoints (nothing saved is ever overwritten).
    """
    if resume and out_dir is None:
        raise JaxparError("--resume needs --out: the run folder that holds checkpoints/")
    loader = make_loader(config)
    holdout = make_loader(config, holdout=True) if config.train.eval_every > 0 else None
    out = Path(out_dir) if out_dir is not None else None
    is_writer = jax.process_index() == 0
    ckpt = (Checkpointer.from_config(out / "checkpoints", config.checkpoint)
            if out is not None else None)
    metrics_file = None
    history: list[dict[str, Any]] = []
    try:
        saved = ckpt.steps() if ckpt is not None else []
        if saved and not resume:
            raise JaxparError(
                f"{ckpt.directory} already holds checkpoints (steps {saved}); "
                "pass --resume to continue that run, or choose another --out")
        trainer = build_trainer(config)
        resumed = False
        if saved:
            meta = ckpt.restore(trainer)
            resumed = True
            step = trainer.step_count
            data_pos = (meta.get("data") or {}).get("position", step)
            if data_pos != step:
                raise JaxparError(f"checkpoint {ckpt.path(step)}: data position {data_pos} "
                                  f"does not match step {step}")
            _say(f"resumed from {ckpt.path(step)} (step {step} of {config.train.steps})")
            changed = _changed_keys(ckpt.config(step), config.to_dict())
            if changed:
                _say("config differs from the checkpoint's (the run will not match an "
                     "uninterrupted one): " + "; ".join(changed))
        elif resume:
            _say(f"no checkpoint in {out / 'checkpoints'}; starting from step 0")
        if out is not None and is_writer:
            out.mkdir(parents=True, exist_ok=True)
            config.save(out / "config.yaml")
            if resumed:
                _trim_metrics(out / "metrics.jsonl", trainer.step_count)
            metrics_file = (out / "metrics.jsonl").open("a" if resumed else "w")
        tokens_per_step = config.train.global_batch * config.train.seq_len
        end = config.train.steps
        if max_steps is not None:
            end = min(end, trainer.step_count + max_steps)
        bar = tqdm(range(trainer.step_count, end), desc="train",
                   disable=not (progress and is_writer), dynamic_ncols=True)
        for step in bar:
            start = time.perf_counter()
            metrics = trainer.step(loader.batch(step))
            elapsed = time.perf_counter() - start
            metrics.update(step_time_s=elapsed, tokens_per_s=tokens_per_step / elapsed)
            if ckpt is not None:
                blocked = ckpt.save(trainer, config=config,
                                    force=trainer.step_count == end)
                if blocked is not None:
                    metrics["checkpoint_block_s"] = blocked
            if holdout is not None and (trainer.step_count % config.train.eval_every == 0
                                        or trainer.step_count == end):
                metrics["eval_loss"] = evaluate(trainer, holdout, config.train.eval_batches)
            history.append(metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}",
                            tok_s=f"{metrics['tokens_per_s']:,.0f}", step_s=f"{elapsed:.3f}")
            if metrics_file is not None and (step % config.train.log_every == 0
                                             or step == end - 1 or "eval_loss" in metrics):
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
    finally:
        if metrics_file is not None:
            metrics_file.close()
        if ckpt is not None:
            ckpt.close()
    return trainer, history


def summarize(history: list[dict[str, Any]], skip_first: int = 1) -> dict[str, float]:
    """Final loss and mean throughput, excluding the first (compiling) steps."""
    steady = history[skip_first:] or history
    return {
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "mean_step_time_s": sum(m["step_time_s"] for m in steady) / max(len(steady), 1),
        "mean_tokens_per_s": sum(m["tokens_per_s"] for m in steady) / max(len(steady), 1),
    }
