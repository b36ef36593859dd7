"""How the TPU compiler runs FSDP's weight gathers and gradient reduce-scatters.

:mod:`jaxpar.planner.comms` lists a step's collectives by what they do: a weight gathered
before its matmul, a weight's gradient reduce-scattered back to its shards. How each one
runs is the compiler's choice, and the bytes on the links follow from it. Read from the
programs the TPU compiler builds for jaxpar's steps (the published runs of
``benchmarks/tpu_compile.py``, and a 4-layer Llama-8B-shaped FSDP step compiled for 16 to
256 devices of each generation: ``tests/planner/test_lowering.py`` keeps the rule):

* **Up to 32 devices**, a weight gathered for a layer's forward matmuls and a gradient
  reduce-scattered out of the backward's are run inside the matmul (a *collective matmul*,
  the compiler's windowed einsum) when the layer's input on a device is over 4 MiB (a
  step of 4 MiB per device runs rings; of 6 MiB, collective matmuls): the shards pass
  around the ring in both directions as the matmul consumes them, and a device receives
  ``n + 1`` shards where a ring all-gather receives ``n - 1``. The backward pass's
  gathers, whose weights feed more than one matmul, stay all-gathers; so do the forward's
  on a mesh with a tensor axis, where the collective matmuls are the tensor axis's
  (Gemma 2 27B on v6e-32, data 2 x fsdp 2 x tensor 8: the fsdp gathers as rings, the
  gradients' reduce-scatters over data and fsdp in the matmuls; the planner passes such
  gathers a layer input of 0).
* **Beyond 32 devices**, v5e and v6e gather with all-gathers, but reduce gradients with an
  all-reduce whose sum each device slices: twice a reduce-scatter's bytes.
* **v4 and v5p** (a 3D torus) also gather beyond 32 devices with an all-reduce, of a
  buffer of zeros holding each device's shard: twice an all-gather's bytes.
* **TPU7x** gathers that way (its SparseCores run the all-reduce) and keeps its
  reduce-scatters.

GPUs and XLA:CPU run the collectives as listed (a ring of each kind).
"""

from __future__ import annotations

from dataclasses import dataclass

FORMS = ("ring", "windowed", "all-reduce")
"""How a collective runs: a ring of its own kind, a collective matmul's permutes, or an
all-reduce."""


@dataclass(frozen=True)
class Lowering:
    """One compiler's choices for a weight's gathers and its gradient's reduce-scatters.

    Attributes:
      windowed_up_to: over at most this many devices, forward gathers and gradient
        reduce-scatters of a layer's weights run as collective matmuls (0: never)...
      windowed_above: ...when a device's layer input is over this many bytes.
      gather_as_all_reduce: beyond that, weights are gathered with an all-reduce.
      scatter_as_all_reduce: beyond that, gradients are reduced with an all-reduce.
    """

    windowed_up_to: int = 0
    windowed_above: int = 4 << 20
    gather_as_all_reduce: bool = False
    scatter_as_all_reduce: bool = False

    def form(self, kind: str, n: int, phase: str, per_layer: bool = True,
             layer_input: float = float("inf")) -> str:
        """How a weight's ``kind`` collective (``all-gather`` or ``reduce-scatter``) over
        ``n`` devices in ``phase`` (:data:`jaxpar.planner.links.PHASES`) runs: one of
        :data:`FORMS`. ``per_layer``: the weight is a layer's (inside the layer loop);
        ``layer_input``: the bytes of a layer's input on a device."""
        if n <= 1 or kind not in ("all-gather", "reduce-scatter"):
            return "ring"
        if n <= self.windowed_up_to:
            matmul = phase == "forward" if kind == "all-gather" else phase == "gradient"
            windowed = matmul and per_layer and layer_input > self.windowed_above
            return "windowed" if windowed else "ring"
        if kind == "all-gather":
            return "all-reduce" if self.gather_as_all_reduce else "ring"
        return "all-reduce" if self.scatter_as_all_reduce else "ring"

    def wire_factor(self, kind: str, n: int, phase: str, per_layer: bool = True,
                    layer_input: float = float("inf")) -> float:
        """Bytes on the links for the collective as it runs, over a ring's of its kind
        (arguments as :meth:`form`'s): ``(n + 1) / (n - 1)`` for a collective matmul, 2
        for an all-reduce, else 1."""
        form = self.form(kind, n, phase, per_layer, layer_input)
        if form == "windowed":
            return (n + 1) / (n - 1)
        return 2.0 if form == "all-reduce" else 1.0


RING = Lowering()
"""Every collective a ring of its kind (GPUs, XLA:CPU)."""

_TPU = {
    "tpu-v4": Lowering(32, gather_as_all_reduce=True, scatter_as_all_reduce=True),
    "tpu-v5p": Lowering(32, gather_as_all_reduce=True, scatter_as_all_reduce=True),
    "tpu-v5e": Lowering(32, scatter_as_all_reduce=True),
    "tpu-v6e": Lowering(32, scatter_as_all_reduce=True),
    "tpu-v7": Lowering(32, gather_as_all_reduce=True),
}


def lowering_for(chip_name: str) -> Lowering:
    """The :class:`Lowering` of the compiler for ``chip_name`` (a catalog key):
    :data:`RING` for chips other than TPUs."""
    return _TPU.get(chip_name, RING)
