"""The mesh planner: choose a mesh, ZeRO stage, remat policy and microbatching for a model
on a machine, from a cost model that needs no devices.

Public API: :func:`plan` (search), :func:`estimate` (one candidate), :func:`predict` (the
figures for an actual run config, as ``jaxpar inspect`` measures them) and :func:`command`
(the ``jaxpar plan`` CLI).
"""

from jaxpar.planner.predict import predict

__all__ = ["predict"]
