"""``jaxpar tokenize``: text corpora into token shards (see
:mod:`jaxpar.data.tokenize_shards`), then the line that trains on them."""

from __future__ import annotations

import argparse

from jaxpar.data.tokenize_shards import write_shards
from jaxpar.errors import JaxparError
from jaxpar.storage.folders import check_writable
from jaxpar.storage.remote import check_bucket, is_remote, output_folder


def command(args: argparse.Namespace) -> int:
    """Check the output folder, tokenize, say how to train on the result."""
    if args.workers < 0:
        raise JaxparError(f"--workers {args.workers}: give 1 or more (0: one per CPU)")
    if is_remote(args.out):  # written locally, then uploaded
        check_bucket(args.out, "--out")
    else:
        check_writable(args.out, "--out")
    with output_folder(args.out, "--out") as local:
        manifest = write_shards(args.inputs, args.tokenizer, local, field=args.field,
                                workers=args.workers)
    shards = manifest["shards"]
    print(f"jaxpar: wrote {len(shards)} shards, {manifest['tokens']:,} tokens "
          f"({manifest['token_dtype']}, end of document {manifest['eos_id']}) to {args.out}; "
          f"train on them with data.source={args.out} data.token_dtype="
          f"{manifest['token_dtype']} data.eos_id={manifest['eos_id']}")
    return 0
