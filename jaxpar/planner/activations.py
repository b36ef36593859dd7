"""What a layer keeps and holds for the backward pass, per device: the activations saved
by remat policy (:func:`saved_activation_bytes`), those a policy sends to host memory
(:func:`host_activation_bytes`), and the transient working set of one layer's backward
pass and of the loss (:func:`layer_working_bytes`, :func:`loss_working_bytes`).

Per token, activations are counted on the positions a device holds: context parallelism
divides them by the ``context`` size (only attention sees the whole sequence: its key
length), sequence parallelism divides the residual-stream tensors by the tensor size, and
a mixture-of-experts layer adds its routed token slots (see :class:`~jaxpar.planner.
candidate.Local`). The formulas for the dense, single-sequence-shard case are calibrated
against XLA:CPU (``tests/planner/test_planner.py``); the rest follow the code paths of
:mod:`jaxpar.parallel.context` and :mod:`jaxpar.models.moe` tensor by tensor, unmeasured,
but for what a mixture of experts saves under ``dots_with_no_batch_dims_saveable`` and
its backward pass's peak on the TPU compiler (measured against XLA:CPU and the TPU
compiler: :func:`_moe_unbatched_saved`, :func:`_moe_working`). :mod:`jaxpar.planner.
memory` adds them to the step's state, gradients and update.
"""

from __future__ import annotations

from jaxpar.parallel.attention import SPLASH_TILE, cudnn_takes
from jaxpar.planner.candidate import Candidate, Local, dtype_bytes
from jaxpar.planner.model import ModelSpec
from jaxpar.sharding.remat import OFFLOAD, offloaded_names

FLASH_ATTENTION = ("chunked", "cudnn", "splash")
"""Attention implementations that never hold a ``seq x seq`` score matrix: their backward
pass recomputes scores from the saved output and log-sum-exp (see
:mod:`jaxpar.parallel.attention`)."""

_KEEPS_LAYER = ("none",)
"""Remat policies under which the ring's per-step carries (not matmul outputs) stay saved
for the backward pass; the others recompute them while the layer's backward runs."""


def attention_kind(spec: ModelSpec, cand: Candidate, backend: str, seq: int = 0) -> str:
    """The implementation attention runs as: ``spec.attention``, where ``auto`` is splash
    on a TPU, cuDNN's fused kernel on a GPU in half precision (where it takes the heads:
    no soft cap, at most 128 wide), XLA's (scores
    materialised) elsewhere (see :func:`jaxpar.parallel.attention.resolve`). With the
    sequence split over ``context``: splash, per device (:mod:`jaxpar.parallel.context_splash`),
    where it would run and each device's share of ``seq`` is a multiple of its 128-token
    tiles; cuDNN's kernel on chunk pairs (:mod:`jaxpar.parallel.context_blocks`) where it
    would run (the planner does not model sliding windows, which keep it off); otherwise
    the candidate's context attention in plain blocks (``allgather``: the local queries
    against all gathered keys in one go, scores materialised; ``ring``: blockwise with an
    online softmax, see :mod:`jaxpar.parallel.context`)."""
    if spec.attention != "auto":
        kind = spec.attention
    elif backend == "tpu":
        kind = "splash"
    else:
        kind = ("cudnn" if backend == "gpu" and dtype_bytes(cand.precision) == 2
                and cudnn_takes(spec.head_dim, spec.attn_logit_softcap) else "xla")
    if cand.context > 1:
        if kind == "splash" and (not seq or seq % (SPLASH_TILE * cand.context) == 0):
            return "splash"
        if kind == "cudnn" and (not seq or seq % (2 * cand.context) == 0):
            return "cudnn"
        return cand.context_attention
    return kind


def _context_splash_kv(loc: Local, spec: ModelSpec, act: int) -> float:
    """Bytes per local token splash under context parallelism holds beyond the kernel's
    own: the gathered keys and values (``allgather``: ``context`` blocks of each), or
    (``ring``) the blocks in flight: the one in use and the one arriving."""
    if loc.context <= 1:
        return 0.0
    blocks = loc.context if loc.context_attention == "allgather" else 2
    return blocks * 2 * loc.kv_heads * spec.head_dim * act


def _ring_carry(loc: Local, spec: ModelSpec, act: int) -> float:
    """Bytes per local token the ring's scan keeps for its backward pass: at each of its
    ``context`` steps the key/value block it held and, for each of the two merges of a
    query half with a key half, both f32 partial outputs (``heads x head_dim``) and their
    maxima and sums (the block's scores are recomputed)."""
    n, k, h = loc.heads, loc.kv_heads, spec.head_dim
    return loc.context * (2 * k * h * act + 4 * (4 * n * h + 4 * n))


def _moe_saved(spec: ModelSpec, loc: Local, act: int, routing: bool) -> float:
    """Bytes per local token a mixture-of-experts layer adds to what is saved: the
    dispatched tokens and the experts' outputs (``embed`` wide per slot), with
    ``routing`` also the one-hot dispatch/combine tensors and the choice mask
    (``(2 + k) x slots x seq`` elements; capacity path only) and the f32 router logits
    and probabilities."""
    if not loc.slots:
        return 0.0
    per_slot = loc.dispatched / loc.tokens
    out = act * 2 * per_slot * spec.d_model
    if routing:
        if spec.capacity_factor:
            out += act * (2 + spec.experts_per_token) * loc.slots * loc.seq
        out += 8 * spec.n_experts
    return out


def _moe_working(spec: ModelSpec, loc: Local, act: int) -> float:
    """Bytes per local token a mixture-of-experts layer's backward pass holds at its peak
    beyond the dense terms: three one-hot-sized tensors (``slots x seq`` elements on the
    capacity path, in the compute dtype): the recomputed combine tensor, the gradient the
    combine einsum (``bsec,ebcd->bsd``) sends it and that gradient's copy in the layout
    the next einsum reads; and the f32 router logits and probabilities. Neither the
    dispatched tokens nor the experts' outputs (``slots x d_model``) are live then, nor a
    token's ``k`` one-hot choices at ``slots x seq`` each (XLA fuses them into the sums).

    Measured: Qwen3-30B-A3B (128 experts, 8 per token) on v5p-64, fsdp 8 x expert 8,
    ZeRO-3, four sequences of 4096 a device, four layers: the TPU compiler's heap peaks in
    the layer loop's backward at the combine einsum with three ``bf16[4,4096,128,320]``
    buffers (3.75 GiB) live beside two ``slots x expert_ff`` gradients and the saved
    activations (``--xla_dump_to``'s ``*live-range.txt``, "Live ranges at ... (peak)");
    counting ``2 + k`` of them, the dispatched tokens and the experts' outputs, and
    attention's score buffers on top, had the planner's working set at 19.3 GiB and
    its figure at 1.40x the compiler's for the full 48-layer model."""
    if not loc.slots:
        return 0.0
    out = 8.0 * spec.n_experts
    if spec.capacity_factor:
        out += act * 3 * loc.slots * loc.seq
    return out


def _gemma_saved(spec: ModelSpec, loc: Local, act: int, backend: str = "tpu") -> float:
    """Bytes per local token Gemma's extra layer parts add to what ``remat=none`` saves
    (by the block's VJP residuals, ``jax.ad_checkpoint.print_saved_residuals``, and
    XLA:CPU's compiled temp, ``tests/planner/test_gemma_memory.py``): ``post_norms``, two
    more norms over the residual stream, each its float32 input and normalised input
    (``2 x 2 x 4`` bytes per ``d_model`` element, the residual stream's share);
    ``qk_norm``, the same over the queries and keys plus the normalised ones in the
    compute dtype; a GeGLU (``gelu_tanh``) MLP two more ``d_ff``-sized tensors than
    SwiGLU's (the tanh approximation's cube and tanh: five intermediates to SiLU's three),
    in float32 on XLA:CPU. Measured on XLA:CPU per token of a d_model 64 model: post
    norms 1175 bytes (counted 1024), query and key norms 1972 (1920), GeGLU 2048 (2048).
    The other policies recompute them."""
    dr = spec.d_model / loc.residual_split
    out = 16 * dr if spec.post_norms else 0.0
    if spec.qk_norm:
        out += (2 * 4 + act) * (loc.heads + loc.kv_heads) * spec.head_dim
    if spec.mlp_activation.startswith("gelu") and not loc.slots:
        out += 2 * (4 if backend == "cpu" else act) * loc.d_ff
    return out


def _moe_unbatched_saved(spec: ModelSpec, loc: Local) -> float:
    """Bytes per local token a mixture-of-experts layer keeps under
    ``dots_with_no_batch_dims_saveable``: the f32 router logits (``n_experts``), the
    router's matmul being the layer's only one without a batch dimension beside the
    shared experts' (counted with the dense MLP's widths). The experts' einsums
    (``ebcd,edf->ebcf``: the expert is a batch dimension) and the dispatch and combine
    einsums (batched over the sequence) are recomputed in the backward pass, not saved
    (``jax.ad_checkpoint.print_saved_residuals`` on :class:`jaxpar.models.moe.MoE`).

    Measured: the TPU compiler keeps to this. Mixtral 8x7B on v5p-64 (fsdp 8 x expert 8,
    ZeRO-3, four microbatches of one sequence of 4096) saves per layer one ``heads x
    head_dim``, two ``d_model`` and two ``kv_heads x head_dim`` tensors in bf16 (3.5 GiB
    for its 32 layers) and no expert-sized one; counting the dispatched tokens, the
    experts' outputs and three ``slots x expert_ff`` hidden tensors as saved had the
    planner at 35.7 GiB of activations and 53.7 GiB a device where the compiler needs
    26.4 (2.03x). XLA:CPU: ``tests/planner/test_planner.py``'s
    ``moe_expert4_dots_no_batch_dims`` (1.58x before, 0.98x after)."""
    return 4.0 * spec.n_experts if loc.slots else 0.0


def _mlp_output_read(spec: ModelSpec) -> bool:
    """Whether the backward pass reads a layer's MLP output: only when a norm follows it
    (``post_norms``). The residual sum's backward reads no values, so without the norm
    JAX saves (or offloads) no ``mlp_out``."""
    return spec.post_norms


def _named_outputs_kept(spec: ModelSpec) -> int:
    """``d_model``-sized tensors a layer keeps under ``save_attention_and_mlp_outputs``:
    its input and the attention's output, from which the backward pass rebuilds the MLP's
    input (their sum); the MLP's output only where the backward pass reads it
    (:func:`_mlp_output_read`).

    Measured: ``jax.ad_checkpoint.print_saved_residuals`` of a 3-layer decoder keeps two
    ``(layers, batch, seq, d_model)`` stacks, and three with ``post_norms``
    (``tests/planner/test_memory.py``). On the TPU compiler, Gemma 2 27B on v6e-32 (fsdp 4
    x tensor 8, four microbatches, sequence parallelism) holds three bf16
    ``[46,4,1024,4608]`` stacks in its buffer assignment. Without its post-norms the heap
    is 1.63 GiB smaller, one such stack (``docs/benchmarks/tpu-compile.md``)."""
    return 3 if _mlp_output_read(spec) else 2


def saved_activation_bytes(spec: ModelSpec, loc: Local, seq: int, remat: str, act: int,
                           attention: str = "xla", backend: str = "tpu") -> float:
    """Bytes per layer kept from the forward pass for the backward pass.

    Without remat, the tensors the backward of a Llama block reads (XLA keeps them, per
    token): the attention logits (f32) and probabilities (``heads x seq`` each), q and the
    attention output (``heads x head_dim`` each), k and v, six ``d_ff``-sized tensors
    (gate, up, their activations and product) and ``d_model``-sized ones: on XLA:CPU six
    (norm inputs and outputs, residual branches), the TPU compiler the attention's and the
    MLP's inputs (whole, gathered, under sequence parallelism) and each norm's input and
    normalised input in float32. ``full`` keeps only the block input; the other policies
    keep the matmul outputs they name that the backward pass reads
    (:func:`_named_outputs_kept`); ``offload:<names>`` keeps on the device what
    ``full`` keeps (the rest goes to the host: :func:`host_activation_bytes`).
    Flash-style ``attention`` (:data:`FLASH_ATTENTION`) keeps no score-sized tensor, only
    an f32 log-sum-exp per head; ``allgather`` keeps its f32 probabilities against the
    whole sequence and the gathered keys and values; ``ring`` keeps one key/value block
    and the partial outputs it merged per step.

    The ``d_model``-sized tensors but the TPU compiler's matmul inputs are the residual
    stream's, split over ``tensor`` under sequence parallelism. Gemma's norms after each
    sublayer and on queries and keys, and its GeGLU, add to what ``none`` keeps
    (:func:`_gemma_saved`). A mixture of experts replaces the ``d_ff`` terms by its
    routed slots and shared experts and adds the dispatch buffers (:func:`_moe_saved`);
    under ``dots_with_no_batch_dims_saveable`` only its shared experts and router logits
    (:func:`_moe_unbatched_saved`).
    """
    d, h = spec.d_model, spec.head_dim
    n, k, f = loc.heads, loc.kv_heads, loc.ff_per_token
    dr = d / loc.residual_split
    # Per token: what attention keeps beyond q, k, v and its output (f32 scores, and
    # probabilities in the compute dtype; flash-style: one f32 log-sum-exp per head).
    if attention in FLASH_ATTENTION:
        # Under context parallelism the all-gathered keys and values are splash's
        # residuals too (the rings, and cuDNN's chunk pairs, keep this device's own block).
        scores, probs = n * 4, 0
        if attention == "splash" and loc.context_attention == "allgather":
            scores += _context_splash_kv(loc, spec, act)
    elif attention == "ring":
        scores, probs = _ring_carry(loc, spec, act) if remat in _KEEPS_LAYER else 0, 0
    elif attention == "allgather":  # f32 probabilities and the gathered keys and values
        scores, probs = n * seq * 4 + 2 * k * h * act * loc.context, 0
    elif spec.attn_logit_softcap:
        # Capped scores (XLA's attention; splash, the TPU's, caps inside its kernel): the
        # f32 scores, their tanh, the capped and shifted scores and the f32 probabilities
        # by the VJP's residuals; XLA:CPU keeps eight f32 score-sized tensors a layer
        # (fitted: tests/planner/test_gemma_memory.py's model, capped and windowed, was
        # 2.0 MiB of 17.4 over the planner with four).
        scores, probs = 8 * n * seq * 4, 0
    else:
        scores, probs = n * seq * 4, n * seq * act
    if remat == "none":
        # d_model-sized, on the TPU compiler: the attention's and the MLP's matmul input
        # (whole, gathered, under sequence parallelism), and per norm its input and
        # normalised input in float32 (the residual stream's share). Measured: Llama 3.2
        # 3B, tensor 4 with sequence parallelism, 11.7 GiB saved a device.
        stream = act * 2 * d + 4 * 4 * dr if backend != "cpu" else act * 6 * dr
        per_token = (scores + probs + act * (6 * f + 2 * n * h + 2 * k * h) + stream
                     + _moe_saved(spec, loc, act, True)
                     + _gemma_saved(spec, loc, act, backend))
    elif remat.startswith(OFFLOAD) and "layer_input" in offloaded_names(remat):
        per_token = 0.0  # the block input, the only thing kept, is in host memory
    elif remat == "full" or remat.startswith(OFFLOAD):
        per_token = act * dr
    elif remat in ("dots_saveable", "offload_dots"):
        per_token = (scores + act * (2 * n * h + 2 * k * h + 2 * dr + 3 * f)
                     + _moe_saved(spec, loc, act, False))
    elif remat == "dots_with_no_batch_dims_saveable":
        # A mixture of experts' routed matmuls all have a batch dimension (the expert, or
        # the sequence for the dispatch and combine einsums): none of their outputs is
        # kept, only the shared experts' and the router's (see _moe_unbatched_saved).
        f_kept = loc.shared_ff if loc.slots else f
        # On the GPU and TPU compilers the attention's output (its kernel's, or XLA's
        # batched einsum's) is recomputed: of the heads only the query projection is kept
        # (measured: Mixtral 8x7B and Qwen3-30B-A3B on 64 H100s, Gemma 3 12B on 16;
        # Qwen3-30B-A3B on v5p-64, one bf16 [48,4,4096,32,128] stack).
        heads = 2 if backend == "cpu" else 1
        # JAX saves two d_ff-sized outputs (gate and up) and the d_model-sized ones of
        # _named_outputs_kept; the TPU compiler keeps to that (Gemma 2 27B on v6e-32,
        # tensor 8: two bf16 [46,1,8192,4608] and three [46,1,1024,4608] stacks), XLA:CPU
        # and the GPU compiler one d_ff-sized tensor more, and two d_model-sized (fitted).
        ffs, dms = (2, _named_outputs_kept(spec)) if backend == "tpu" else (3, 2)
        per_token = (act * (heads * n * h + 2 * k * h + dms * dr + ffs * f_kept)
                     + _moe_unbatched_saved(spec, loc))
    else:  # save_attention_and_mlp_outputs
        per_token = act * _named_outputs_kept(spec) * dr
    if remat == "offload_dots":
        per_token = act * dr
    return per_token * loc.tokens


def host_activation_bytes(spec: ModelSpec, loc: Local, seq: int, remat: str, act: int,
                          attention: str = "xla", backend: str = "tpu") -> float:
    """Bytes per layer a remat policy saves to host memory instead of the device.

    ``offload:<names>``: per token, ``attention`` (the attention output before its
    projection, ``heads x head_dim``), ``layer_input``, ``attention_out`` and ``mlp_out``
    (``d_model``, the residual stream's share under sequence parallelism; ``mlp_out`` only
    behind a post-norm, the one place the backward pass reads it) and ``mlp_hidden`` (the
    MLP's hidden width, or a mixture of experts' routed slots and shared experts).
    ``offload_dots``: what ``dots_with_no_batch_dims_saveable`` keeps, less the block
    input that stays on the device. Other policies: nothing.
    """
    names = offloaded_names(remat)
    if names:
        dr = spec.d_model / loc.residual_split
        width = {"attention": loc.heads * spec.head_dim, "attention_out": dr,
                 "mlp_hidden": loc.ff_per_token,
                 "mlp_out": dr if _mlp_output_read(spec) else 0.0, "layer_input": dr}
        return act * sum(width.get(n, 0.0) for n in names) * loc.tokens
    if remat == "offload_dots":
        kept = saved_activation_bytes(spec, loc, seq, "dots_with_no_batch_dims_saveable", act,
                                      attention, backend)
        return max(kept - saved_activation_bytes(spec, loc, seq, remat, act, attention,
                                                 backend), 0.0)
    return 0.0


TPU_WORKING_TENSORS = (3, 4)
"""``(d_ff, d_model)``-sized tensors of the compute dtype a layer's backward pass holds at
the TPU compiler's peak, beside attention's buffers (:func:`layer_working_bytes`). Fitted,
with attention's, to the compiler's program requirement (its heap with the gaps between
buffers counted once, :mod:`jaxpar.analysis.tpu_log`) on the ten published runs of
``benchmarks/tpu_compile.py``, all within 10%; the four and eight fitted earlier matched
``memory_analysis()``'s temporaries, which count the gaps twice."""


def layer_working_bytes(spec: ModelSpec, loc: Local, seq: int, act: int,
                        attention: str = "xla", remat: str = "none",
                        backend: str = "tpu") -> float:
    """Transient bytes while one layer runs its backward pass.

    Attention's backward holds score-sized (``heads x seq`` per token) f32 buffers: the
    recomputed softmax, its gradient and the logits' gradient, plus two more d_ff-sized
    and several d_model-sized gradients. Flash-style ``attention`` holds those for one key
    block at a time (``heads x attention_block`` per token), plus f32 copies of q, the
    output's gradient and the q, k, v gradients it accumulates (splash, with the layers'
    inputs offloaded: the copies only). ``allgather`` holds them
    against the whole sequence, with the gathered keys and values and their f32
    gradients; ``ring`` for one half-block pair at a time, with two key/value blocks in
    flight and (when ``remat`` recomputes the layer) the ring's per-step carries.
    A mixture of experts adds its dispatch buffers and routing tensors; on the TPU
    compiler, with a flash kernel, its combine tensor, that tensor's gradient and routing
    tensors (:func:`_moe_working`) at a time attention's buffers are free: the larger of
    the two counts.
    """
    d, h = spec.d_model, spec.head_dim
    n, k = loc.heads, loc.kv_heads
    if attention == "splash":
        # Splash keeps its score blocks in VMEM: in HBM, the f32 copies only (and under
        # context parallelism the keys and values it holds, with their f32 gradients).
        score = 4 * (4 * n * h + 2 * k * h) + _context_splash_kv(loc, spec, act) * (1 + 4 / act)
    elif attention in FLASH_ATTENTION:
        block = min(spec.attention_block, seq) if spec.attention_block > 0 else seq
        score = 3 * n * block * 4 + 4 * (4 * n * h + 2 * k * h)
        # Under context parallelism: the keys and values it holds (gathered, or two ring
        # blocks) and their f32 gradients (summed whole, or travelling with the blocks).
        score += _context_splash_kv(loc, spec, act) * (1 + 4 / act)
    elif attention == "ring":
        # One pair of half blocks at a time: half the local queries against half a block
        # of keys; f32 copies of q, the output gradient and the accumulated q, k, v
        # gradients; and two key/value blocks (the one in use, the one arriving).
        score = (3 * n * max(loc.seq_local // 2, 1) * 4 / 2 + 4 * (4 * n * h + 2 * k * h)
                 + 2 * 2 * k * h * act)
        if remat not in _KEEPS_LAYER:
            score += _ring_carry(loc, spec, act)
    elif attention == "allgather":
        score = 3 * n * seq * 4 + 2 * k * h * (act + 4) * loc.context
    elif backend == "tpu":
        # The TPU compiler's peak holds two f32 score-sized buffers and one in the
        # compute dtype (22B on v4, seq 1024, fitted to its program requirement).
        score = (2 * 4 + act) * n * seq
    elif backend == "gpu" and spec.attn_logit_softcap:
        # The GPU compiler's peak holds seven f32 score-sized buffers under a soft cap
        # (Gemma 2 9B on 8 H100s: seven [1,4,2,8192,8192], 14 GiB of its 54.5).
        score = 7 * 4 * n * seq
    else:
        score = 3 * n * seq * 4
    if backend != "cpu" and attention in FLASH_ATTENTION:
        # The kernel's score blocks live inside attention's backward alone, which never
        # runs with the experts': the larger of the two (see _moe_working).
        both = max(score, _moe_working(spec, loc, act))
    else:
        # XLA's attention keeps the recomputed forward pass's scores until attention's
        # backward, after the MLP's: XLA:CPU's peak holds them beside the experts' hidden
        # gradients, the dispatched tokens, the experts' outputs and ``k + 1`` one-hot
        # tensors (the ``k`` choices materialised before their sum; ``2 + k`` counted).
        both = score + _moe_saved(spec, loc, act, True)
    # Beside attention's: d_ff-sized tensors (the recomputed gate and up projections, the
    # hidden gradient, and on XLA:CPU and the GPU compiler the activation's) and
    # d_model-sized gradients (on the TPU, TPU_WORKING_TENSORS).
    ff_tensors, model_tensors = TPU_WORKING_TENSORS if backend == "tpu" else (4, 8)
    return loc.tokens * (both + act * (ff_tensors * loc.ff_per_token + model_tensors * d))


def loss_working_bytes(spec: ModelSpec, loc: Local, seq: int) -> float:
    """Transient bytes of the loss and its gradient: f32 logits and their gradient
    (``vocab`` per token each) for every token; with ``loss_chunk``, for ``loss_chunk``
    positions of each sequence at a time, plus the chunk's softmax (the gradient of a
    recomputed chunk does not reuse its logits' buffer; measured on XLA:CPU). Under
    context parallelism a device holds ``seq / context`` positions of each sequence."""
    if spec.loss_chunk:
        return loc.seqs * min(spec.loss_chunk, loc.seq_local or seq) * 3 * loc.vocab * 4
    return loc.tokens * 2 * loc.vocab * 4


def working_set_bytes(spec: ModelSpec, loc: Local, seq: int, act: int,
                      attention: str = "xla") -> float:
    """Transient bytes while one layer runs its backward pass, or while the loss runs
    (the larger: they never coexist); see :func:`layer_working_bytes` and
    :func:`loss_working_bytes`."""
    return max(layer_working_bytes(spec, loc, seq, act, attention),
               loss_working_bytes(spec, loc, seq))
