"""The loaders' throughput, per process, against what a training step needs.

    python benchmarks/data.py [--tokens 50000000] [--seq 2048] [--batch 16] [--rounds 5]

Token shards: three sources of ``uint16`` shards (``--tokens`` ids in all, 8 shards each)
in a temporary folder, read by :class:`jaxpar.data.mixture.MixtureLoader` (one source;
the three mixed 5:3:2; each packed with ``data.eos_id``).

Documents tokenized as read: the standard library's ``.py`` files (``--doc-bytes`` of them,
one document each, cut into pieces of at most 4 KB) as Parquet, a byte-level BPE
tokenizer of 8,192 ids trained on them by Hugging Face ``tokenizers``, read by
:class:`jaxpar.data.streams.DocumentLoader` with 1 and 4 worker threads (one source; the
Parquet and a zstd ``.jsonl`` copy mixed 1:1), packed with segment ids.

Every variant runs ``--rounds`` rounds of ``--steps`` batches, the variants alternated
round by round (this machine is noisy: a variant's figure is its median round). Tokens
per second count the ``batch x seq`` ids a step consumes. ``x step need`` compares with a
training step's tokens/s (``--step-tokens-per-s``, e.g. what ``make train`` logs): how
many times faster than the step the loader is. ``--json`` writes the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EOS = 0


def write_sources(root: Path, tokens: int, shards: int = 8) -> list[str]:
    """Three folders of shards, random ids with an EOS about every 600 tokens."""
    import numpy as np

    rng = np.random.default_rng(0)
    specs = []
    for name, share in (("web", 0.5), ("code", 0.3), ("books", 0.2)):
        folder = root / name
        folder.mkdir(parents=True)
        per = int(tokens * share) // shards
        for i in range(shards):
            ids = rng.integers(1, 50_000, per, dtype=np.uint16)
            ids[rng.random(per) < 1 / 600] = EOS
            ids.tofile(folder / f"{name}-{i:05d}.bin")
        specs.append(str(folder))
    return specs


def loaders(specs: list[str], seq: int, batch: int) -> dict:
    """The token-shard loaders (:class:`jaxpar.data.mixture.MixtureLoader`) by name."""
    from jaxpar.data.mixture import MixtureLoader, Source
    from jaxpar.data.shards import Windows, open_shard, shard_paths

    def windows(spec: str) -> Windows:
        return Windows([open_shard(p) for p in shard_paths(spec)], seq, name=spec)

    one = [Source(windows(specs[0]))]
    mix = [Source(windows(s), w) for s, w in zip(specs, (5, 3, 2), strict=True)]
    return {"1 source": MixtureLoader(one, batch), "3 mixed": MixtureLoader(mix, batch),
            "1 source, packed": MixtureLoader(one, batch, eos_id=EOS),
            "3 mixed, packed": MixtureLoader(mix, batch, eos_id=EOS)}


def write_documents(root: Path, doc_bytes: int) -> tuple[list[str], object, int]:
    """Standard-library sources as Parquet and zstd jsonl documents, and a BPE tokenizer
    trained on them; returns (the two specs, the tokenizer, its EOS id)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxpar.data.loader import stdlib_corpus

    text = stdlib_corpus(doc_bytes).tobytes().decode("utf-8", "replace")
    docs = [text[i:i + 4096] for i in range(0, len(text), 4096)]
    pq.write_table(pa.table({"text": docs}), root / "docs.parquet", row_group_size=1024)
    (root / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return ([str(root / "docs.parquet"), str(root / "docs.jsonl.zst")], tokenizer,
            tokenizer.token_to_id("<|endoftext|>"))


def document_loaders(specs: list[str], tokenizer: object, eos: int, seq: int,
                     batch: int) -> dict:
    """The tokenizing loaders (:class:`jaxpar.data.streams.DocumentLoader`) by name."""
    from jaxpar.data.documents import open_documents
    from jaxpar.data.streams import DocumentLoader

    one = [(open_documents(specs[0]), 1.0)]
    mix = [(open_documents(s), 1.0) for s in specs]
    return {f"docs, {name}, {w} worker{'s' * (w > 1)}":
            DocumentLoader(sources, tokenizer, eos, batch, seq, workers=w)
            for name, sources in (("1 source", one), ("2 mixed", mix)) for w in (1, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="batches per round")
    parser.add_argument("--step-tokens-per-s", type=float, default=0.0,
                        help="a training step's tokens/s to compare with (0: leave out)")
    parser.add_argument("--doc-bytes", type=int, default=20_000_000,
                        help="bytes of documents for the tokenizing loaders")
    parser.add_argument("--json", help="write the table to this file")
    args = parser.parse_args()
    if str(ROOT) not in sys.path:  # run from a clone without installing jaxpar
        sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        specs = write_sources(Path(tmp), args.tokens)
        runs: dict = loaders(specs, args.seq, args.batch)
        doc_specs, tokenizer, eos = write_documents(Path(tmp), args.doc_bytes)
        runs.update(document_loaders(doc_specs, tokenizer, eos, args.seq, args.batch))
        times: dict[str, list[float]] = {name: [] for name in runs}
        done = dict.fromkeys(runs, 0)  # each loader's next batch (documents are read in order)
        for _ in range(args.rounds):
            for name, loader in runs.items():  # alternated: each round times every variant
                begin = time.perf_counter()
                for _ in range(args.steps):
                    loader.batch(done[name])
                    done[name] += 1
                times[name].append(time.perf_counter() - begin)
    per_round = args.steps * args.batch * args.seq
    print(f"loader tokens/s per process (batch {args.batch} x seq {args.seq}, "
          f"{args.tokens / 1e6:.0f}M tokens in 24 shards; {args.doc_bytes / 1e6:.0f} MB of "
          f"documents; median of {args.rounds} rounds)")
    print(f"{'variant':<34} {'tokens/s':>12} {'batches/s':>10}"
          + (f" {'x step need':>12}" if args.step_tokens_per_s else ""))
    table = []
    for name, rounds in times.items():
        rate = per_round / statistics.median(rounds)
        extra = f" {rate / args.step_tokens_per_s:>12.1f}" if args.step_tokens_per_s else ""
        print(f"{name:<34} {rate:>12,.0f} {rate / args.batch / args.seq:>10.1f}{extra}")
        table.append({"variant": name, "tokens_per_s": rate})
    if args.json:
        import json

        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": table}, indent=1))


# --- the site's table (docs/hooks/generated.py) ---------------------------------------------

COMMAND = ("python benchmarks/data.py --rounds 3 --step-tokens-per-s 6817 "
           "--json benchmarks/results/data.json")
"""The command that wrote ``benchmarks/results/data.json``."""


def _rate(tokens_per_s: float) -> str:
    return (f"{tokens_per_s / 1e6:.1f}M" if tokens_per_s >= 1e6
            else f"{tokens_per_s / 1e3:.0f}k")


def markdown(results: dict) -> str:
    """The printed table as markdown, from the saved ``--json`` file."""
    a = results["args"]
    need = a.get("step_tokens_per_s") or 0
    lines = ["| loader | variant | tokens/s | batches/s"
             + (" | x the step's need |" if need else " |"),
             "|---|---|---:|---:" + ("|---:|" if need else "|")]
    for row in results["rows"]:
        name, rate = row["variant"], row["tokens_per_s"]
        kind = "documents, tokenized as read" if name.startswith("docs, ") else "token shards"
        variant = name.removeprefix("docs, ")
        lines.append(f"| {kind} | {variant} | {_rate(rate)} | "
                     f"{rate / a['batch'] / a['seq']:.1f} |"
                     + (f" {rate / need:,.0f} |" if need else ""))
    lines += ["", f"Tokens per second of one process at batch {a['batch']} x seq {a['seq']} "
              f"({a['tokens'] / 1e6:.0f}M tokens in 24 shards; {a['doc_bytes'] / 1e6:.0f} MB "
              f"of documents), the median of {a['rounds']} alternated rounds of {a['steps']} "
              "batches."
              + (f" \"x the step's need\" divides by {need:,.0f} tokens/s, the training "
                 "step the loader feeds." if need else "")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
