"""A model's list of blocks run as one scanned stack, without editing the model.

A model written as people write it keeps its layers in a list and calls them from a
Python loop (``for layer in self.layers: x = layer(x)``). XLA then compiles one copy of
every layer, and schedules a loop of checkpointed layers poorly: remat saves little or
nothing, and compile time grows with depth. jaxpar's own decoder, like MaxText's
``scan_layers``, stacks its layers' weights over a leading ``layers`` axis and runs them
with ``jax.lax.scan``.

:func:`scan_blocks` gives a model of yours the same, in place: the list becomes one module
of the block's class whose variables are stacked over ``layers`` (their paths lose the
layer index: ``layers/3/mlp/up/kernel`` becomes ``layers/mlp/up/kernel`` shaped
``(n, ...)``), and which still behaves as the list did. Iterating over it yields one
stand-in per layer; the first stand-in called runs the whole stack as a scan on that call's
input and returns the last layer's output, and the others, called on the previous one's
output with the same extra arguments (a mask, positions), return it unchanged. So the
model's own loop runs unedited and computes what it did, once, as a scan.

Each iteration runs under the plan's remat policy (the block's input named
``layer_input``, as :mod:`jaxpar.sharding.block_remat` names it), and state a block
updates (dropout counters, batch statistics) comes out per layer as in the unscanned
model.

When the loop is not a plain chain (an argument that changes from layer to layer, such
as a layer index or a cache; output used between layers; fewer layers called than the
list holds) the model's call runs again with the layers one by one, sliced from the
stack (``scan_blocks=auto``: a warning once, naming the block and the argument), or is
refused in one line (``scan_blocks=true``). :func:`unscan_blocks` gives the model back
with its list.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.errors import JaxparError, JaxparWarning
from jaxpar.sharding import remat as remat_lib
from jaxpar.sharding.annotations import _NAME_KEYS, logical_names
from jaxpar.sharding.blocks import repeated_blocks
from jaxpar.sharding.paths import path_str

LAYERS = "layers"
MODES = ("auto", "true", "false")
"""``Plan.scan_blocks``: ``auto`` scans a list of uniform blocks when the model's loop is a
plain chain (and runs them one by one otherwise), ``true`` refuses a model whose blocks
cannot be scanned, ``false`` leaves the list as it is."""

_SCANNED = "_jaxpar_scanned_base"
"""Class attribute of a stack's class: the block class it stacks."""
_ROOT = "_jaxpar_scan_root_base"
"""Class attribute of a model's class whose call falls back to unscanned layers."""
_UNROLLED: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxpar_unrolled",
                                                                 default=False)
_RUNS: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxpar_scan_runs",
                                                                   default=None)
_WARNED: set[tuple[type, str, str]] = set()


class ScanWarning(JaxparWarning):
    """A model's blocks could not be scanned and run one by one."""


class _NotAChain(Exception):
    """The model's loop over a scanned stack is not a plain chain of calls."""

    def __init__(self, block: str, why: str):
        super().__init__(why)
        self.block, self.why = block, why


def is_scanned(module: Any) -> bool:
    """Whether ``module`` is a stack made by :func:`scan_blocks`."""
    return isinstance(module, nnx.Module) and hasattr(type(module), _SCANNED)


def _names(variable: nnx.Variable, ndim: int) -> tuple:
    names = tuple(logical_names(variable) or ())
    return (LAYERS, *names, *(None,) * (ndim - len(names)))


def _renamed(variable: nnx.Variable, value: Any, names: tuple | None) -> nnx.Variable:
    new = variable.replace(value)
    key = next((k for k in _NAME_KEYS if variable.get_metadata().get(k) is not None),
               "out_sharding")
    if names is not None or variable.get_metadata().get(key) is not None:
        new.set_metadata(key, names)
    return new


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def uniform(blocks: list[nnx.Module]) -> str | None:
    """Why ``blocks`` cannot be stacked (None: they can): one class, one structure, no
    state shared between them."""
    if len(blocks) < 2 or not all(isinstance(b, nnx.Module) for b in blocks):
        return "it is not a list of two or more modules"
    if len({type(b) for b in blocks}) != 1:
        return "its blocks are of different classes"
    graphdefs = [nnx.split(b)[0] for b in blocks]
    if any(g != graphdefs[0] for g in graphdefs[1:]):
        return "its blocks differ in structure (sizes, attributes or submodules)"
    seen: set[int] = set()
    for block in blocks:
        ids = {id(v) for _, v in nnx.iter_graph(block) if isinstance(v, nnx.Variable)}
        if ids & seen:
            return "its blocks share variables"
        seen |= ids
    return None


@functools.cache
def _scanned_class(base: type) -> type:
    """``base`` as a stack: a list-like module whose stand-ins run it as a scan."""
    return type(base.__name__, (base,), {
        _SCANNED: base, "__module__": base.__module__, "__qualname__": base.__qualname__,
        "__len__": lambda self: self._jaxpar_layers,
        "__iter__": _iterate, "__getitem__": _item})


def scan_blocks(model: nnx.Module, path: str, container: Any, remat: str = "none"
                ) -> nnx.Module:
    """Replace the list of blocks at ``path`` in ``model`` by one stack (in place) whose
    layers run as a scan under the remat policy ``remat``; returns the stack.

    Raises:
      JaxparError: when the blocks cannot be stacked (naming the path and why).
    """
    blocks = list(container)
    why = uniform(blocks)
    if why is not None:
        raise JaxparError(f"plan.scan_blocks: the blocks at {path!r} cannot be scanned: {why}; "
                          "set plan.scan_blocks=false")
    splits = [nnx.split(b) for b in blocks]

    def stack(*variables: nnx.Variable) -> nnx.Variable:
        value = jnp.stack([v.get_value() for v in variables])
        return _renamed(variables[0], value, _names(variables[0], value.ndim - 1))

    state = jax.tree.map(stack, *(s for _, s in splits), is_leaf=_is_variable)
    module = nnx.merge(splits[0][0], state)
    object.__setattr__(module, "__class__", _scanned_class(type(blocks[0])))
    module._jaxpar_layers = len(blocks)
    module._jaxpar_container = type(container).__name__
    module._jaxpar_path = path
    module._jaxpar_remat = remat
    parent, key = _parent(model, path)
    setattr(parent, key, module)
    return module


def _parent(model: nnx.Module, path: str) -> tuple[Any, str]:
    *keys, last = path.split("/")
    parent: Any = model
    for key in keys:
        parent = parent[int(key)] if key.isdigit() else getattr(parent, key)
    return parent, last


def layer(stack: nnx.Module, i: int) -> nnx.Module:
    """Layer ``i`` of a stack, as a module of the block's class (a copy of its slices)."""
    graphdef, state = nnx.split(stack)
    state = jax.tree.map(lambda v: _renamed(v, v.get_value()[i], tuple(
        logical_names(v) or (None,))[1:] or None), state, is_leaf=_is_variable)
    block = nnx.merge(graphdef, state)
    object.__setattr__(block, "__class__", type(stack)._jaxpar_scanned_base)
    for name in ("_jaxpar_layers", "_jaxpar_container", "_jaxpar_path", "_jaxpar_remat"):
        vars(block).pop(name, None)
    return block


def unscan_blocks(model: nnx.Module) -> nnx.Module:
    """``model`` with every stack :func:`scan_blocks` made back in its original list (in
    place; the layers are copies of the stack's slices). Returns ``model``."""
    stacks = [(path_str(tuple(p)), m) for p, m in nnx.iter_graph(model) if is_scanned(m)]
    for path, stack in stacks:
        blocks = [layer(stack, i) for i in range(stack._jaxpar_layers)]
        parent, key = _parent(model, path)
        setattr(parent, key, nnx.List(blocks) if stack._jaxpar_container == "List"
                else blocks)
    base = getattr(type(model), _ROOT, None)
    if base is not None:
        object.__setattr__(model, "__class__", base)
    return model


def scanned_paths(model: nnx.Module) -> dict[str, int]:
    """``{path: number of layers}`` of the stacks :func:`scan_blocks` made in ``model``."""
    return {path_str(tuple(p)): m._jaxpar_layers for p, m in nnx.iter_graph(model)
            if is_scanned(m)}


# --- running a stack from the model's own loop ----------------------------------------------


@dataclasses.dataclass
class _Run:
    """One pass of the model's loop over a stack: what the first stand-in was given and
    what the scan returned."""

    stack: nnx.Module
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    out: Any = None
    calls: int = 0

    @property
    def complete(self) -> bool:
        return self.calls in (0, self.stack._jaxpar_layers)


class _Layer:
    """Stand-in for layer ``index`` of a stack, yielded by iterating over it."""

    def __init__(self, run: _Run, index: int):
        self._run, self._index = run, index

    def __getattr__(self, name: str) -> Any:  # layer ``index``'s own (sliced) attributes
        return getattr(layer(self._run.stack, self._index), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run, stack = self._run, self._run.stack
        if _UNROLLED.get():
            return _call_layer(stack, self._index, args, kwargs)
        where = f"{stack._jaxpar_path} ({type(stack).__name__})"
        if self._index != run.calls:
            raise _NotAChain(where, f"layer {self._index} was called after {run.calls} of "
                                    f"{stack._jaxpar_layers}")
        run.calls += 1
        if self._index == 0:
            if not args or not isinstance(args[0], jax.Array):
                raise _NotAChain(where, "its first argument is not an array")
            run.args, run.kwargs = args, kwargs
            run.out = _scan(stack, args, kwargs)
            return run.out
        if args[0] is not run.out:
            raise _NotAChain(where, f"layer {self._index} is not called on layer "
                                    f"{self._index - 1}'s output")
        changed = _changed(run.args[1:], args[1:], run.kwargs, kwargs)
        if changed:
            raise _NotAChain(where, f"argument {changed} changes between layers")
        return run.out


def _changed(first: tuple, now: tuple, kw_first: dict, kw_now: dict) -> str | None:
    """The first extra argument that differs between two layers' calls."""
    if len(first) != len(now) or set(kw_first) != set(kw_now):
        return "list"
    pairs = [(f"#{i + 1}", a, b) for i, (a, b) in enumerate(zip(first, now, strict=True))]
    pairs += [(repr(k), kw_first[k], kw_now[k]) for k in kw_first]
    for name, a, b in pairs:
        same = a is b if isinstance(a, jax.Array) or isinstance(b, jax.Array) else (
            type(a) is type(b) and _equal(a, b))
        if not same:
            return f"{name} ({_brief(a)} then {_brief(b)})"
    return None


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _brief(x: Any) -> str:
    return f"array {tuple(x.shape)}" if isinstance(x, jax.Array) else repr(x)[:30]


def _iterate(stack: nnx.Module):
    run = _Run(stack)
    runs = _RUNS.get()
    if runs is not None:
        runs.append(run)
    return iter([_Layer(run, i) for i in range(stack._jaxpar_layers)])


def _item(stack: nnx.Module, index: int | slice) -> Any:
    if isinstance(index, slice):
        return [_single(stack, i) for i in range(stack._jaxpar_layers)[index]]
    return _single(stack, range(stack._jaxpar_layers)[index])


@functools.cache
def _indexed_class(base: type) -> type:
    """``base`` for a layer reached by indexing a stack: its call runs that layer of the
    stack (the state it updates written back there)."""
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stack, index = vars(self)["_jaxpar_of"]
        return _call_layer(stack, index, args, kwargs)

    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


def _single(stack: nnx.Module, index: int) -> nnx.Module:
    """Layer ``index`` of a stack reached by indexing: a module of the block's class holding
    that layer's slices, whose call runs the layer alone."""
    block = layer(stack, index)
    object.__setattr__(block, "__class__", _indexed_class(type(block)))
    vars(block)["_jaxpar_of"] = (stack, index)
    return block


def _policy(stack: nnx.Module) -> Any:
    return remat_lib.policy(remat_lib.check(stack._jaxpar_remat))


def _layer_fn(stack: nnx.Module, more: tuple, kwargs: dict, *, in_scan: bool) -> Any:
    """``fn(params, rest, x) -> (y, rest)``: one layer of the stack (its slices given) on
    ``x`` with the other arguments ``more``, under the stack's remat policy, returning the
    state it updates. ``in_scan``: the body of the stack's scan, whose output must be
    shaped as its input."""
    graphdef = nnx.graphdef(stack)
    base = type(stack)._jaxpar_scanned_base
    policy = _policy(stack)

    def run(params, rest, x):
        block = nnx.merge(graphdef, params, rest)
        object.__setattr__(block, "__class__", base)
        if policy is not None:
            x = checkpoint_name(x, "layer_input")
        y = block(x, *more, **kwargs)
        if in_scan and (not isinstance(y, jax.Array) or y.shape != x.shape
                        or y.dtype != x.dtype):
            raise _NotAChain(f"{stack._jaxpar_path} ({base.__name__})",
                             "a layer's output is not an array shaped as its input")
        return y, nnx.state(block, nnx.Not(nnx.Param))

    # prevent_cse: a layer called alone from a Python loop would otherwise have its
    # recomputation merged back into the forward pass; a scan's body needs no barrier.
    return run if policy is None else jax.checkpoint(run, policy=policy,
                                                     prevent_cse=not in_scan)


def _call_layer(stack: nnx.Module, i: int, args: tuple, kwargs: dict) -> Any:
    """Run layer ``i`` alone (sliced from the stack), writing back the state it updates."""
    _, params, rest = nnx.split(stack, nnx.Param, ...)
    take = lambda tree: jax.tree.map(lambda v: v[i], tree)
    y, new_rest = _layer_fn(stack, args[1:], kwargs, in_scan=False)(
        take(params), take(rest), args[0])
    nnx.update(stack, jax.tree.map(lambda a, b: a.at[i].set(b), rest, new_rest))
    return y


def _scan(stack: nnx.Module, args: tuple, kwargs: dict) -> Any:
    """Every layer of the stack in turn on ``args[0]`` (the others passed to each), as one
    ``jax.lax.scan``; the state the layers update is written back to the stack."""
    _, params, rest = nnx.split(stack, nnx.Param, ...)
    run = _layer_fn(stack, args[1:], kwargs, in_scan=True)
    y, new_rest = jax.lax.scan(lambda x, state: run(*state, x), args[0], (params, rest))
    nnx.update(stack, new_rest)
    return y


# --- the model's call: falling back to layers one by one -----------------------------------


@functools.cache
def _root_class(base: type, mode: str) -> type:
    call = base.__call__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _UNROLLED.get() or _RUNS.get() is not None:
            return call(self, *args, **kwargs)
        # the values, not the variables (which an aborted scan advances): restored below
        before = jax.tree.map(lambda x: x, nnx.state(self, nnx.Not(nnx.Param)))
        runs: list[_Run] = []
        token = _RUNS.set(runs)
        try:
            out = call(self, *args, **kwargs)
            broken = next((r for r in runs if not r.complete), None)
            failure = None if broken is None else _NotAChain(
                f"{broken.stack._jaxpar_path} ({type(broken.stack).__name__})",
                f"{broken.calls} of its {broken.stack._jaxpar_layers} layers were called")
        except _NotAChain as e:
            failure = e
        finally:
            _RUNS.reset(token)
        if failure is None:
            return out
        if mode == "true":
            raise JaxparError(f"plan.scan_blocks=true: the blocks at {failure.block} cannot "
                              f"run as a scan: {failure.why}; set plan.scan_blocks=false "
                              "(or auto, to run them one by one)")
        key = (base, failure.block, failure.why)  # once per model class and cause
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"jaxpar: the blocks at {failure.block} run one by one, not as a "
                          f"scan: {failure.why} (plan.scan_blocks=false silences this)",
                          ScanWarning, stacklevel=2)
        nnx.update(self, before)
        token = _UNROLLED.set(True)
        try:
            return call(self, *args, **kwargs)
        finally:
            _UNROLLED.reset(token)

    return type(base.__name__, (base,), {"__call__": __call__, _ROOT: base,
                                         "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


def scan_model_blocks(model: nnx.Module, candidates: list[tuple[str, Any]], mode: str,
                      remat: str) -> list[str]:
    """Scan each list of blocks in ``candidates`` (``(path, container)``) that can be, per
    ``mode`` (see :data:`MODES`), in place; returns the paths scanned.

    Raises:
      JaxparError: ``mode`` true and a list that cannot be stacked.
    """
    if mode == "false":
        return []
    done = []
    for path, container in candidates:
        why = uniform(list(container))
        if why is not None and mode == "auto":
            continue
        scan_blocks(model, path, container, remat)
        done.append(path)
    if done and not hasattr(type(model), _ROOT):
        object.__setattr__(model, "__class__", _root_class(type(model), mode))
    return done


def block_lists(model: nnx.Module) -> list[tuple[str, Any]]:
    """``(path, list)`` of each list (``nnx.List`` or list) whose items are all blocks
    :func:`~jaxpar.sharding.blocks.repeated_blocks` finds: the candidates for scanning."""
    owners: dict[str, int] = {}
    for path, _ in repeated_blocks(model):
        owner, _, last = path.rpartition("/")
        if last.isdigit() and owner:
            owners[owner] = owners.get(owner, 0) + 1
    found = []
    for owner, count in owners.items():
        parent, key = _parent(model, owner)
        container = parent[int(key)] if key.isdigit() else getattr(parent, key, None)
        if isinstance(container, nnx.List | list) and len(container) == count:
            found.append((owner, container))
    return found


def layer_class(module: nnx.Module) -> type:
    """The class each layer of ``module`` runs as: a stack's block class, else its own."""
    return getattr(type(module), _SCANNED, type(module))


def set_layer_class(module: nnx.Module, cls: type) -> None:
    """Make ``module``'s layers run as ``cls`` (a stack stays a stack)."""
    object.__setattr__(module, "__class__", _scanned_class(cls) if is_scanned(module) else cls)
