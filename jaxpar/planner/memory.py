"""Per-device memory of one candidate: model state, and what the compiled step holds on top.

Memory follows the Trainer's state layout: working parameters (compute dtype under mixed
precision), f32 master weights (mixed precision only), optimizer moments, each sharded as
the ZeRO stage says; plus what the compiled step needs on top (XLA's "temp"): gradient
buffers, the activations saved for the backward pass (by remat policy), and the working
set of one layer's backward pass and of the loss.

The activations saved for the backward pass and the backward pass's working set are
:mod:`jaxpar.planner.activations`; the gradient-accumulation sum's layout was measured
against the TPU and GPU compilers (:func:`_accumulator_elems`).

A model jaxpar did not write (``model.factory``) has no formulas: its activations and
backward working set are XLA's temporaries of its loss and gradient compiled for one device
at the rows that device holds (:mod:`jaxpar.planner.traced`), in ``activation_bytes``
(``working_bytes`` 0); ``traced_residual_bytes`` is what its VJP saves by the jaxpr.

Host offload (:mod:`jaxpar.planner.offload`) moves state and saved activations to host
memory: the device's arguments and saved activations drop by what moved (reported as
``host_*`` bytes), and its temporaries gain what comes back for a while: the streamed
layers' weights, the offloaded activations in flight and, for a streamed update, the
offloaded optimizer state of the tensors being updated.
"""

from __future__ import annotations

from jaxpar.parallel.schedules import peak_in_flight
from jaxpar.planner.activations import (
    attention_kind,
    host_activation_bytes,
    layer_working_bytes,
    loss_working_bytes,
    saved_activation_bytes,
)
from jaxpar.planner.candidate import (
    OPTIMIZER_MOMENTS,
    Candidate,
    dtype_bytes,
    local_sizes,
    pipe_microbatches,
    pipe_repeats,
    scheduled_backward,
)
from jaxpar.planner.layout import Layout
from jaxpar.planner.model import ModelSpec
from jaxpar.planner.offload import STAGING_LAYERS, STREAMED_LAYERS, state_offload


def _expert_state_bytes(lay: Layout, cand: Candidate) -> float:
    """Per-device bytes of the routed experts' parameters, master weights and moments."""
    c = dtype_bytes(cand.precision)
    mixed = c != 4
    moments = OPTIMIZER_MOMENTS.get(cand.optimizer, 2)
    total = 0.0  # (the f32 weights: the master, or without mixed precision the params)
    for p in lay.placed:
        if "expert" not in p.tensor.names:
            continue
        store = p.zero if cand.zero_stage >= 3 else p.base
        opt = p.zero if cand.zero_stage >= 1 else p.base
        copy = store * c if mixed and cand.stores_weight_copy else 0  # beside the master
        total += copy + opt * 4 + moments * opt * 4
    return total


def _accumulator_elems(lay: Layout, cand: Candidate) -> float:
    """Per-device elements of gradient accumulation's f32 running sum: laid out like the
    gradients the step keeps, ZeRO-2 and 3's shards (the trainer places the sum so:
    :func:`jaxpar.parallel.accumulation.accumulate`), else the base layout. Measured on
    the TPU compiler, Gemma 2 27B on v6e-32, data 2 x fsdp 2 x tensor 8, ZeRO-3, 16
    microbatches: ``f32[46,4608,1152]`` per MLP projection, split 32 ways; the GPU
    compiler, Llama 3.1 8B on 8 H100s, data 2 x fsdp 2 x tensor 2, ZeRO-3, eight
    microbatches: ``f32[32,1024,7168]``."""
    return lay.total("zero" if cand.zero_stage >= 2 else "base")


def tied_table_bytes(spec: ModelSpec, lay: Layout, act: int, backend: str) -> float:
    """Bytes of the gathered copies of a tied embedding table the TPU compiler keeps
    beyond the gradient :func:`memory` counts: the table serves the lookup and the output
    head, and the step's layout holds it, gathered and in the compute dtype, in four
    buffers (the lookup's, the head's in its transposed layout, the head's gradient, the
    lookup's gradient), three more than the gradient. Measured, the memory-usage reports
    of ``benchmarks/tpu_compile.py``'s MaxText 22B on v4-128 (four bf16 [32768,6144]
    buffers and an f32 pair), 16B on 2 x v5e-256 (four bf16 [5120,32768] and one
    [256,20,32768]) and Gemma 2 27B on v6e-32 (four to five bf16 [32000,4608], the table
    split over tensor=8). An untied table is read once, by the lookup, and the head is a
    matmul weight like a layer's: nothing to add. XLA:CPU's are counted by its whole
    gradients."""
    if backend != "tpu" or not spec.tie_embeddings:
        return 0.0
    return sum(3 * act * p.compute for p in lay.placed if p.tensor.path == "embed")


def memory(spec: ModelSpec, lay: Layout, cand: Candidate, global_batch: int, seq: int,
           backend: str = "tpu") -> dict[str, float]:
    """Per-device bytes: state (``argument``), XLA temporaries (``temp``) and their sum,
    in device memory; ``expert_state_bytes`` is the part of the state that belongs to
    routed experts.

    ``param_bytes``, ``master_bytes`` and ``opt_bytes`` are the whole state, wherever it
    lives; ``host_opt_bytes``, ``host_param_bytes`` and ``host_activation_bytes`` the
    parts host offload keeps in host memory instead (``host_bytes`` their sum), which
    ``argument_bytes`` and ``activation_bytes`` leave out; ``offload_transient_bytes``
    what of them is back on the device at once (in ``temp_bytes``): ``STREAMED_LAYERS``
    layers' streamed weights, ``STAGING_LAYERS`` layers' offloaded activations, and
    during a streamed update the offloaded state of the tensors being updated (none with
    ``host_update``, where the update's buffers leave the device too). On XLA:CPU
    (``backend="cpu"``) offload changes the arguments only, as compiled there: the
    offloaded activations stay in ``activation_bytes``."""
    c = dtype_bytes(cand.precision)
    mixed = c != 4
    stage = cand.zero_stage
    base, zero = lay.total("base"), lay.total("zero")
    store = zero if stage >= 3 else base
    opt_elems = zero if stage >= 1 else base
    moments = OPTIMIZER_MOMENTS.get(cand.optimizer, 2)
    params = store * (c if mixed else 4)
    master = opt_elems * 4 if mixed else 0
    cast = 0.0  # the weights cast to the compute dtype inside the step (no stored copy)
    if mixed and not cand.stores_weight_copy:
        # The compilers cast the whole stack before the layer loop and hold the cast for
        # the step (the backward pass uses it too): the copy moves from the arguments to
        # the temporaries (measured on the TPU compiler, Llama 3.1 8B on v6e-8: arguments
        # -1.87 GiB, temporaries +1.82 GiB; XLA:CPU: the same bytes both ways).
        params, master, cast = master, 0, store * c
    opt = moments * opt_elems * 4
    loc = local_sizes(spec, lay, cand, global_batch, seq)
    batch = global_batch * (seq + 1) * 4 / lay.dp / loc.context
    act = c
    stages = lay.sizes.get("stage", 1)
    host_act = staging = 0.0
    traced = None
    if spec.is_transformer:
        layers = spec.n_layers / stages
        attention = attention_kind(spec, cand, backend, seq)
        saved = layers * saved_activation_bytes(spec, loc, seq, cand.remat, act, attention,
                                                backend)
        per_layer = host_activation_bytes(spec, loc, seq, cand.remat, act, attention, backend)
        host_act, staging = layers * per_layer, min(STAGING_LAYERS, layers) * per_layer
        if stages > 1 and scheduled_backward(cand):
            # 1F1B: each in-flight (microbatch, chunk) keeps only its input; one chunk's
            # activations live while the stage runs that chunk's backward.
            m = pipe_microbatches(cand, stages)
            v = pipe_repeats(cand, spec.n_layers, stages)
            inflight = peak_in_flight(cand.pipeline_schedule, stages, m, v)
            # Besides: the pipeline's input and its gradient, for all m microbatches.
            block_input = saved_activation_bytes(spec, loc, seq, "full", act, attention)
            saved = (inflight + 2 * m) * block_input + saved / v
            host_act /= v
        elif stages > 1:
            # jax.grad of the forward loop keeps what every one of its r m + p - 1
            # iterations ran: a layer of each stage on one microbatch.
            m = pipe_microbatches(cand, stages)
            r = pipe_repeats(cand, spec.n_layers, stages)
            inflight = m * (r * m + stages - 1) / (r * m)
            saved *= inflight
            host_act *= inflight
        # XLA:CPU runs bf16 matmuls in f32, so its transients are f32 whatever the policy.
        layer_work = layer_working_bytes(spec, loc, seq, 4 if backend == "cpu" else c,
                                         attention, cand.remat, backend)
        loss_work = loss_working_bytes(spec, loc, seq)
    elif spec.tracer is not None:
        # A model of the user's: the one-device step compiled at this device's rows
        # (jaxpar.planner.traced), activations and backward working set together.
        rows = max(global_batch // (lay.dp * loc.context * cand.microbatches), 1)
        traced = spec.tracer.activations(cand.remat, cand.precision, rows, seq)
        saved, layer_work = traced.temp_bytes, 0.0
        loss_work = 0.0
    else:
        saved = layer_work = loss_work = 0.0
    # Gradients: XLA:CPU accumulates them whole, in the compute layout, in f32 (its
    # reductions are all-reduces followed by a slice); the GPU figure is the same layout
    # in the compute dtype (not measured against a compiler yet). The TPU compiler reduces
    # each layer's gradients as the backward loop produces them (a reduce-scatter to the
    # stored layout): the step holds the reduced gradients, in the compute dtype, and one
    # layer's before reduction; weights outside the layer loop (the embedding, the output
    # head) have their whole gradient at once before it is reduced (measured:
    # benchmarks/tpu_compile.py). With gradient accumulation an f32 running sum as well.
    # A user's model whose blocks are not stacked (traced: no ``layers`` axis) has each
    # weight's gradient reduced as the backward pass makes it, on XLA:CPU too: the stored
    # layout, and one weight's whole gradient before its reduction (measured on LlamaLike
    # under fsdp: tests/planner/test_traced.py).
    if backend != "tpu" and traced is not None:
        unstacked = [p for p in lay.placed if not p.tensor.per_layer]
        whole = max((p.compute - p.base for p in unstacked), default=0)
        grads = (sum(p.compute if p.tensor.per_layer else p.base for p in lay.placed)
                 + whole) * (4 if backend == "cpu" else c)
    elif backend == "cpu":
        grads = lay.total("compute") * 4
    else:
        layers = max(spec.n_layers / lay.sizes.get("stage", 1), 1)
        grads = 0.0
        for p in lay.placed:
            reduced = p.zero if stage >= 2 else p.base
            whole = (p.compute - reduced) / (layers if p.tensor.per_layer else 1)
            grads += (reduced + whole) * c
    if cand.microbatches > 1:
        grads += _accumulator_elems(lay, cand) * 4
    # The update: clipped gradients and Adam's new moments in the optimizer's layout (on
    # the host under host_update).
    update = opt_elems * 4
    off = state_offload(spec, lay, cand)
    stream = STREAMED_LAYERS * off.params_per_layer
    # A streamed update (offloaded state, updated on the device) takes a slab at a time:
    # the offloaded tensors' f32 gradients and state come down a slab at a time.
    kept = 1.0 - off.optimizer / (master + opt) if master + opt else 1.0
    # Updated on the host, the slabs still pass through device memory (the TPU compiler
    # slices the host buffers there), the update's own buffers do not. The TPU compiler
    # updates the state in place: no buffer of the update's size at its peak (Gemma 2 9B
    # on v6e-8, tensor 8, 16 microbatches: the heap holds the f32 accumulators, the bf16
    # gradients and weights and the saved activations, and no moment-sized buffer).
    in_place = backend == "tpu" and traced is None
    update_device = off.update_transient + (
        0.0 if cand.host_update or in_place else update * kept)
    transient = off.update_transient
    if backend == "cpu":
        # XLA:CPU's host and device memory are one RAM: measured, offload moves the
        # state's arguments to host memory and leaves the step's temporaries as they are
        # (no streamed copies, the update's buffers where they were), and its memory
        # analysis counts the offloaded activations among the temporaries.
        stream = staging = transient = 0.0
        update_device = update
        saved, host_act = saved + host_act, 0.0
    # The loss runs first in the backward pass and the update after it, so the update's
    # buffers never meet the loss's working set (counting them with a layer's is the
    # calibrated approximation).
    work = max(layer_work, loss_work)
    # ZeRO++: the weights gathered once a step stay whole for the whole step.
    gathered = (sum(p.compute for p in lay.placed if p.store_dp_axes) * c
                if "int8" in (cand.quantize_gather, cand.quantize_reduce) else 0.0)
    if cand.quantize_reduce == "int8":  # qgZ quantizes from a float32 copy of them
        gathered += sum(p.compute for p in lay.placed if p.store_dp_axes) * 4
    if cand.hpz:  # hpZ: the in-slice copy (the stored shard times the data axis), and
        # its float32 gradient, held until it is reduced across slices
        copy = sum((p.zero if cand.zero_stage >= 3 else p.base) * lay.sizes["data"]
                   for p in lay.placed if "data" in p.store_dp_axes)
        gathered += copy * (c + 4)
    if traced is not None:
        # A traced model's activations include its backward working set; the update runs
        # once the backward pass has freed them (measured on LlamaLike: the step holds the
        # gradients and the larger of the two).
        peak = max(stream + staging + max(update_device - saved, 0.0), loss_work)
    elif backend != "cpu":
        # The TPU compiler updates the optimizer state in place, after the backward pass
        # has freed its working set (measured: benchmarks/tpu_compile.py).
        peak = max(layer_work + stream + staging, update_device, loss_work)
    else:
        peak = max(layer_work + stream + staging + update_device, loss_work)
    tied = tied_table_bytes(spec, lay, c, backend)  # only a transformer ties its table
    temp = grads + saved + gathered + peak + cast + tied
    argument = params + master + opt + batch - off.optimizer - off.params
    host = off.optimizer + off.params + host_act
    if backend != "cpu":  # streamed weights' gradients leave the layer loop to the host
        host += off.params
    return {"param_bytes": params, "master_bytes": master, "opt_bytes": opt,
            "batch_bytes": batch, "grad_bytes": grads, "activation_bytes": saved,
            "working_bytes": work, "update_bytes": update, "argument_bytes": argument,
            "output_bytes": argument - batch, "temp_bytes": temp,
            "total_bytes": argument + temp,
            "expert_state_bytes": _expert_state_bytes(lay, cand),
            "host_opt_bytes": off.optimizer, "host_param_bytes": off.params,
            "host_activation_bytes": host_act, "host_bytes": host,
            "offload_transient_bytes": stream + staging + transient,
            "gathered_weight_bytes": gathered, "tied_table_bytes": tied,
            **({"traced_residual_bytes": traced.residual_bytes} if traced else {})}
