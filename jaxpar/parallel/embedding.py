"""Token-embedding lookup that leaves the table where its weight layout puts it.

A table ``(vocab, embed)`` sharded for FSDP has its ``embed`` dimension split over the
``fsdp`` axes. Gathering rows from it in the batch-split activation layout would first
gather the whole table to every device (``vocab x embed`` values a device) and, in the
backward pass, all-reduce a whole-table gradient: for a 32k vocabulary that is two
table-sized transfers a step, more than all the decoder layers' weight gathers of a small
model. :func:`lookup` instead gathers the token ids (``batch x seq`` integers) over the
axes the table's ``embed`` is split on, looks every token up in the local columns, and
moves the result into the batch-split layout with one all-to-all of the activations
(``batch x seq x embed / devices`` values a device). Its gradient runs the same way back:
an all-to-all, then a scatter-add into the local columns, with no reduction over the
table. A vocabulary split is looked up with a masked local gather whose partial rows are
summed over the splitting axes: over ``tensor``, Megatron's vocab-parallel embedding; with
``plan.vocab_over_fsdp`` over ``fsdp`` too, the ids first gathered over it.

The activations' all-to-all is smaller than the table whenever a device holds fewer
tokens than the vocabulary has entries, which is the case for the batch sizes training
uses (thousands of tokens a device against 32k-256k entries).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.sharding.plan import Plan, constrain
from jaxpar.sharding.rules import axes_entry, entry_axes

TABLE = ("vocab", "embed")
"""Logical names of an embedding table."""


def lookup(table: jax.Array, tokens: jax.Array, plan: Plan | None,
           out_names: tuple[str, str, str], *, in_place: bool = True) -> jax.Array:
    """``table[tokens]``: ``(vocab, embed)`` rows for ``(batch, seq)`` ids, returned in the
    layout of ``out_names`` (the residual stream's logical names).

    The table is looked up in its weight layout: the ids are gathered over every mesh
    axis that splits the table (its ``embed`` columns under FSDP, its vocabulary under
    ``plan.vocab_over_fsdp``) and also splits the batch; a vocabulary split is resolved by
    a masked local gather whose partial rows are summed over it, an ``embed`` split by an
    all-to-all into the batch-split layout (see the module docstring). Without
    ``in_place`` (a table tied to the output head, which gathers it whole anyway) the
    ``embed`` columns are gathered to the activation layout first."""
    if plan is None:
        return jnp.take(table, tokens, axis=0)
    if plan.explicit:
        # An explicit mesh types every array's sharding, and a gather from a split table
        # by split ids has no single answer: the rows are asked for in the residual
        # stream's layout.
        table = constrain(table, TABLE)
        out = plan.activation_sharding(out_names, (*tokens.shape, table.shape[1]))
        return table.at[tokens].get(out_sharding=out)
    # ZeRO++'s int8 gathers (qwZ, qgZ) bring every weight whole before the step uses it:
    # a whole table is looked up where it is, with no collective at all.
    in_place = in_place and "int8" not in (plan.quantize_gather, plan.quantize_reduce)
    split = entry_axes(plan.param_spec(TABLE, shape=table.shape)[1]) if in_place else ()
    vocab = tuple(a for a in entry_axes(plan.act_spec(TABLE, shape=table.shape)[0])
                  if a not in split)
    out = plan.act_spec(out_names, shape=(*tokens.shape, table.shape[1]))
    # The ids are gathered over the axes that split the table; the other batch and
    # sequence splits stay.
    ids = tuple(axes_entry(tuple(a for a in entry_axes(e) if a not in split and a not in vocab))
                for e in out[:2])
    table = plan.place(table, plan.sharding(PartitionSpec(axes_entry(vocab), axes_entry(split))))
    tokens = plan.place(tokens, plan.sharding(PartitionSpec(*ids)))
    rows = jnp.take(table, tokens, axis=0)
    rows = plan.place(rows, plan.sharding(PartitionSpec(*ids, axes_entry(split))))
    if split and entry_axes(ids[1]):
        rows = _all_to_all(rows, plan, ids, split)
    return constrain(rows, out_names)


def _all_to_all(rows: jax.Array, plan: Plan, ids: tuple, split: tuple[str, ...]
                ) -> jax.Array:
    """Rows looked up in the table's ``embed`` split, moved to the batch split by an
    explicit all-to-all over ``split``. Left to GSPMD with the sequence split too (context
    parallelism), the TPU compiler gathered the whole microbatch's activations to every
    device and sliced them (Llama 2 70B at 128k tokens on v5p-512, fsdp 16 x context 4 x
    tensor 8: a 32 GiB ``bf16[16,131072,8192]`` buffer a device)."""
    batch = (*entry_axes(ids[0]), *split)
    move = lambda x: jax.lax.all_to_all(x, split, 0, 2, tiled=True)
    return plan.shard_map(move, in_specs=PartitionSpec(*ids, axes_entry(split)),
                          out_specs=PartitionSpec(axes_entry(batch), ids[1], None))(rows)
