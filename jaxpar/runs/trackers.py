"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

``train.trackers`` names them (default ``[tensorboard]``). Each receives every logged row
(the scalars of :func:`jaxpar.runs.monitor.tensorboard_tags`) at its step.

Weights & Biases runs through its own library: the run config is the W&B config (with the
mesh and device count the run resolved), the run's id is kept in ``OUT/wandb-id`` so a
``--resume`` continues the same W&B run, and the files go under ``OUT/wandb``. Its mode and
project come from W&B's environment (``WANDB_MODE=offline`` writes locally, for machines
without a network; ``WANDB_PROJECT``, default ``jaxpar``).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any


class WandbTracker:
    """One W&B run per run folder, continued on resume.

    Args:
      out: the run folder.
      config: the run config as a dict (logged as the W&B config).
      summary: figures known at the start (the layout, the planner's prediction) for the
        run's summary.
      resumed: whether this is a ``--resume`` of the run in ``out``.
    """

    def __init__(self, out: Path, config: dict[str, Any], summary: dict[str, Any],
                 resumed: bool):
        import wandb

        id_file = out / "wandb-id"
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else (
            secrets.token_hex(4))
        id_file.write_text(run_id)
        (out / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxpar"),
                              name=out.name, id=run_id, resume="allow", dir=str(out),
                              config=config, reinit="create_new")
        self.run.summary.update(summary)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Log one row's scalars at ``step``."""
        self.run.log(values, step=step)

    def close(self) -> None:
        """Finish the W&B run (offline: its files are complete on disk)."""
        self.run.finish()
