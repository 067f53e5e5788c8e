"""Start-up of a local run: time from launching `rudra-async train` (defaults) to the
server's first update, against one `python -c "import torch"` measured in the same run.

    python benchmarks/startup.py [--reps 5]

Prints medians (min-max) and the ratio (target: <= 1.5x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def import_torch() -> float:
    started = time.time()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.time() - started


def first_update(directory: str) -> float:
    results = Path(directory) / "r.json"
    started = time.time()
    subprocess.run([sys.executable, "-m", "rudra_async", "train", "-q", "--results", str(results)],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return float(json.loads(results.read_text())["first_update_unix"]) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch_s, train_s = [], []
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.reps):  # interleaved, so both see the same machine
            torch_s.append(import_torch())
            train_s.append(first_update(directory))
    a, b = statistics.median(torch_s), statistics.median(train_s)
    print(f"python -c 'import torch':             {a:5.2f} s ({min(torch_s):.2f}-{max(torch_s):.2f})")
    print(f"rudra-async train, launch to update 1: {b:5.2f} s ({min(train_s):.2f}-{max(train_s):.2f})")
    print(f"ratio {b / a:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()
