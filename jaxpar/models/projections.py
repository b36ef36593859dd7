"""Projection geometry: an einsum view of a projection layer, telling which kernel
dimensions contract with the input and which reach the output.

``nnx.Linear`` is ``"...i,io->...o"``; an ``nnx.LinearGeneral`` contracting its input's
last two axes into one output feature is ``"...ab,abc->...c"``. LoRA (which dimensions an
adapter's two factors take), int8 storage (which dimensions a scale spans) and linen
interception all read it.
"""

from __future__ import annotations

import dataclasses
import re
import string

from flax import nnx

from jaxpar.errors import JaxparError


@dataclasses.dataclass(frozen=True)
class ProjectionSpec:
    """Einsum view of a projection layer, for a single (unstacked) kernel.

    Attributes:
      x: subscripts of the input (may contain ``...``).
      kernel: subscripts of the kernel, one letter per kernel dimension.
      out: subscripts of the output.
      in_letters: kernel letters contracted with the input (in kernel order).
      out_letters: kernel letters that only reach the output (in kernel order).
      shared: kernel letters present in input, kernel and output (batched, e.g. per-head).
    """

    x: str
    kernel: str
    out: str
    in_letters: str
    out_letters: str
    shared: str

    @property
    def equation(self) -> str:
        """The layer's own einsum equation."""
        return f"{self.x},{self.kernel}->{self.out}"

    def free_letters(self, n: int) -> str:
        """``n`` letters not used by the equation (for rank and stacking dimensions)."""
        used = set(self.equation)
        free = [c for c in string.ascii_letters if c not in used]
        if len(free) < n:
            raise JaxparError(f"einsum {self.equation!r} leaves no free subscript letters")
        return "".join(free[:n])


def letters(sub: str) -> str:
    """The subscript letters of one einsum operand, without its ``...``."""
    return sub.replace("...", "")


def parse_einsum(equation: str) -> ProjectionSpec:
    """Describe ``"input,kernel->output"`` (the form ``nnx.Einsum`` takes)."""
    eq = equation.replace(" ", "")
    m = re.fullmatch(r"([A-Za-z.]*),([A-Za-z]+)->([A-Za-z.]*)", eq)
    if m is None:
        raise JaxparError(
            f"cannot adapt einsum {equation!r}: expected 'input,kernel->output' with a kernel "
            "without '...'"
        )
    x, k, out = m.groups()
    xl, ol = set(letters(x)), set(letters(out))
    in_l = "".join(c for c in k if c in xl and c not in ol)
    out_l = "".join(c for c in k if c in ol and c not in xl)
    shared = "".join(c for c in k if c in xl and c in ol)
    if len(in_l) + len(out_l) + len(shared) != len(k) or len(set(k)) != len(k):
        raise JaxparError(f"cannot adapt einsum {equation!r}: every kernel letter must appear "
                          "once and reach the input or the output")
    if not in_l or not out_l:
        raise JaxparError(f"einsum {equation!r} has no contracted or no output kernel dimension")
    return ProjectionSpec(x, k, out, in_l, out_l, shared)


LINEAR_SPEC = parse_einsum("...i,io->...o")

PROJECTION_TYPES: tuple[type, ...] = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
"""Float layers that LoRA can adapt and int8 storage can quantize."""


def linear_general_spec(
    axis: tuple[int, ...],
    n_out: int,
    batch_axis: tuple[int, ...] = (),
) -> ProjectionSpec:
    """The einsum view of an ``nnx.LinearGeneral`` contracting input ``axis`` (kernel
    ``(*batch, *in_features, *out_features)`` with ``n_out`` output dimensions).

    ``lax.dot_general`` pairs the kernel's input dimensions with the *sorted* input axes
    and lays out its result as (batch axes, the input's other axes in order, output
    features); the einsum below does the same. Non-negative axes are counted from the
    front of the input, negative ones from the back, so one equation serves every input
    rank. ``batch_axis`` (the input axes Flax batches over, ``0 .. k-1``) become
    dimensions shared by input, kernel and output.

    Raises:
      JaxparError: for repeated axes, or an axis that is also a batch axis.
    """
    axis, batch = tuple(int(a) for a in axis), tuple(sorted(int(b) for b in batch_axis))
    if len(set(axis)) != len(axis) or set(axis) & set(batch) or not axis:
        raise JaxparError(f"cannot describe nnx.LinearGeneral(axis={axis}, batch_axis="
                          f"{batch}) as an einsum: axes must be distinct and not batch axes")
    pos = sorted(a for a in axis if a >= 0)
    neg = sorted(a for a in axis if a < 0)
    n_prefix = max([*pos, *batch], default=-1) + 1
    n_suffix = -min(neg, default=0)
    need = n_prefix + n_suffix + n_out
    if need > len(string.ascii_letters):
        raise JaxparError(f"nnx.LinearGeneral(axis={axis}) needs too many einsum subscripts")
    letters = string.ascii_letters[:need]
    prefix, suffix = letters[:n_prefix], letters[n_prefix:n_prefix + n_suffix]
    out_l = letters[n_prefix + n_suffix:]
    in_l = "".join(prefix[a] for a in pos) + "".join(suffix[a] for a in neg)
    batch_l = "".join(prefix[b] for b in batch)
    kept_front = "".join(c for c in prefix if c not in in_l and c not in batch_l)
    kept_back = "".join(c for c in suffix if c not in in_l)
    return parse_einsum(f"{prefix}...{suffix},{batch_l}{in_l}{out_l}->"
                        f"{batch_l}{kept_front}...{kept_back}{out_l}")


def stack_depth(kernel_ndim: int, spec: ProjectionSpec) -> int:
    """Leading stacking dimensions of a kernel (e.g. 1 for layers made with ``nnx.vmap``)."""
    lead = kernel_ndim - len(spec.kernel)
    if lead < 0:
        raise JaxparError(f"kernel of rank {kernel_ndim} does not fit einsum {spec.equation!r}")
    return lead
