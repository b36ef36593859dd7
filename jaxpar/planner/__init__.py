"""The mesh planner: choose a mesh (data, pipeline, FSDP, expert, context and tensor
parallelism), ZeRO stage, remat policy, sequence parallelism, context attention and
microbatching for a model on a machine, from a cost model that needs no devices.

Public API: :func:`plan` (search), :func:`estimate` (one candidate), :func:`predict` (the
figures for an actual run config, as ``jaxpar inspect`` measures them) and :func:`command`
(the ``jaxpar plan`` CLI, in :mod:`jaxpar.cli.plan`). Host offload (optimizer state,
streamed layer weights, activations saved to the host) is priced by
:mod:`jaxpar.planner.offload` and searched with ``plan(..., offload="auto")``.

Example::

    from jaxpar.planner import plan
    best = plan("configs/llama-7b.yaml", chips="tpu-v5p:256", global_batch=512, seq=4096)[0]
    print(best.candidate.describe(), best.step_time_s, best.mfu)
"""

from __future__ import annotations

from jaxpar.planner.api import estimate, plan, resolve_model
from jaxpar.planner.catalog import BUILTIN, Chip, Machine, load_catalog, parse_chips
from jaxpar.planner.cost import Candidate, Estimate
from jaxpar.planner.prediction import predict

__all__ = ["BUILTIN", "Candidate", "Chip", "Estimate", "Machine", "estimate",
           "load_catalog", "parse_chips", "plan", "predict", "resolve_model"]
