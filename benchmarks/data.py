"""The token-shard loader's throughput, per process, against what a training step needs.

    python benchmarks/data.py [--tokens 50000000] [--seq 2048] [--batch 16] [--rounds 5]

Writes three sources of ``uint16`` shards (``--tokens`` ids in all, 8 shards each) into a
temporary folder, then times :class:`jaxpar.data.mixture.MixtureLoader` batches for
each variant (one source; the three mixed 5:3:2; each packed with ``data.eos_id``),
``--rounds`` rounds of 20 batches with the variants alternated round by round (this
machine is noisy: a variant's figure is its median round). Tokens per second count the
``batch x seq`` ids a step consumes. ``need`` is what the step of the config would take at
the tokens/s ``make train`` reaches on this machine (``--step-tokens-per-s``, measured by
``jaxpar train --config configs/tiny.yaml``): the ratio says how many times faster than
the step the loader is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpar.data.mixture import MixtureLoader, Source  # noqa: E402
from jaxpar.data.shards import Windows, open_shard, shard_paths  # noqa: E402

EOS = 0


def write_sources(root: Path, tokens: int, shards: int = 8) -> list[str]:
    """Three folders of shards, random ids with an EOS about every 600 tokens."""
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


def loaders(specs: list[str], seq: int, batch: int) -> dict[str, MixtureLoader]:
    def windows(spec: str) -> Windows:
        return Windows([open_shard(p) for p in shard_paths(spec)], seq, name=spec)

    one = [Source(windows(specs[0]))]
    mix = [Source(windows(s), w) for s, w in zip(specs, (5, 3, 2), strict=True)]
    return {"1 source": MixtureLoader(one, batch), "3 mixed": MixtureLoader(mix, batch),
            "1 source, packed": MixtureLoader(one, batch, eos_id=EOS),
            "3 mixed, packed": MixtureLoader(mix, batch, eos_id=EOS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="batches per round")
    parser.add_argument("--step-tokens-per-s", type=float, default=0.0,
                        help="a training step's tokens/s to compare with (0: leave out)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        specs = write_sources(Path(tmp), args.tokens)
        runs = loaders(specs, args.seq, args.batch)
        times: dict[str, list[float]] = {name: [] for name in runs}
        step = 0
        for _ in range(args.rounds):
            for name, loader in runs.items():  # alternated: each round times every variant
                begin = time.perf_counter()
                for _ in range(args.steps):
                    loader.batch(step)
                    step += 1
                times[name].append(time.perf_counter() - begin)
    per_round = args.steps * args.batch * args.seq
    print(f"loader tokens/s per process (batch {args.batch} x seq {args.seq}, "
          f"{args.tokens / 1e6:.0f}M tokens in 24 shards, median of {args.rounds} rounds)")
    print(f"{'variant':<20} {'tokens/s':>12} {'batches/s':>10}"
          + (f" {'x step need':>12}" if args.step_tokens_per_s else ""))
    for name, rounds in times.items():
        rate = per_round / statistics.median(rounds)
        extra = f" {rate / args.step_tokens_per_s:>12.1f}" if args.step_tokens_per_s else ""
        print(f"{name:<20} {rate:>12,.0f} {rate / args.batch / args.seq:>10.1f}{extra}")


if __name__ == "__main__":
    main()
