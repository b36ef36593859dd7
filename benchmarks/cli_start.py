"""How fast the ``jaxpar`` command answers when it has nothing heavy to do.

    python benchmarks/cli_start.py [--repeats 5]

Times, as fresh processes, ``jaxpar --help``, ``jaxpar train --config missing.yaml`` (an
argument error) and ``jaxpar train --out RUN --resume`` on a run already at its last step,
and prints the median and spread of ``--repeats`` runs of each, alternated.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        (run / "checkpoints" / "12").mkdir(parents=True)
        (run / "config.yaml").write_text("train:\n  steps: 12\n")
        (run / "finished.json").write_text('{"step": 12, "bytes": 0}')
        cases = {"jaxpar --help": ["--help"],
                 "train --config missing.yaml": ["train", "--config", "missing.yaml"],
                 "train --resume (finished run)": ["train", "--out", str(run), "--resume"]}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, argv in cases.items():
                begin = time.perf_counter()
                subprocess.run([sys.executable, "-m", "jaxpar.cli", *argv], cwd=ROOT,
                               capture_output=True, check=False)
                times[name].append(time.perf_counter() - begin)
    print(f"{'command':<32} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, got in times.items():
        print(f"{name:<32} {statistics.median(got):>9.2f} {min(got):>7.2f} {max(got):>7.2f}")


if __name__ == "__main__":
    main()
