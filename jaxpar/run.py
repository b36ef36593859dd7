"""The training run behind ``jaxpar train``: config in, a trained model and a run folder out.

The run folder holds ``config.yaml`` (the resolved config) and ``metrics.jsonl`` (one JSON
object per logged step: step, loss, step_time_s, tokens_per_s, grad_norm).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from jaxpar.config import Config
from jaxpar.data import TokenLoader, load_tokens, split_holdout
from jaxpar.train import Trainer


def make_loader(config: Config) -> TokenLoader:
    """The training loader for this process, from the config's data section."""
    tokens = load_tokens(config.data.source, config.data.max_bytes)
    train_tokens, _ = split_holdout(tokens, config.data.holdout_fraction)
    loader = TokenLoader(
        train_tokens, config.train.global_batch, config.train.seq_len, seed=config.train.seed,
        process_index=jax.process_index(), process_count=jax.process_count(),
    )
    loader.vocab_check(config.model.vocab_size)
    return loader


def train(config: Config, out_dir: str | Path | None = None, *, progress: bool = True
          ) -> tuple[Trainer, list[dict[str, Any]]]:
    """Train ``config`` for ``config.train.steps`` steps; returns the trainer and logged metrics."""
    loader = make_loader(config)
    trainer = Trainer.from_config(config)
    out = Path(out_dir) if out_dir is not None else None
    is_writer = jax.process_index() == 0
    if out is not None and is_writer:
        out.mkdir(parents=True, exist_ok=True)
        config.save(out / "config.yaml")
    metrics_file = (out / "metrics.jsonl").open("a") if out is not None and is_writer else None
    tokens_per_step = config.train.global_batch * config.train.seq_len
    history: list[dict[str, Any]] = []
    bar = tqdm(range(trainer.step_count, config.train.steps), desc="train",
               disable=not (progress and is_writer), dynamic_ncols=True)
    try:
        for step in bar:
            start = time.perf_counter()
            metrics = trainer.step(loader.batch(step))
            elapsed = time.perf_counter() - start
            metrics.update(step_time_s=elapsed, tokens_per_s=tokens_per_step / elapsed)
            history.append(metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}",
                            tok_s=f"{metrics['tokens_per_s']:,.0f}", step_s=f"{elapsed:.3f}")
            if metrics_file is not None and (step % config.train.log_every == 0
                                             or step == config.train.steps - 1):
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
    finally:
        if metrics_file is not None:
            metrics_file.close()
    return trainer, history


def summarize(history: list[dict[str, Any]], skip_first: int = 1) -> dict[str, float]:
    """Final loss and mean throughput, excluding the first (compiling) steps."""
    steady = history[skip_first:] or history
    return {
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "mean_step_time_s": sum(m["step_time_s"] for m in steady) / max(len(steady), 1),
        "mean_tokens_per_s": sum(m["tokens_per_s"] for m in steady) / max(len(steady), 1),
    }
