"""Where a real run's CPU goes: each process's CPU seconds and context switches per update,
over a few seconds in the middle of a ``rudra-async train`` run (all learners connected).

    python benchmarks/cpu_per_update.py LEARNERS [PROTOCOL] [--model mlp] [--dataset digits]
        [--batch-size 16] [--epochs 2000] [--seconds 5]

The runtime model (docs/study/runtime_model.md) charges a learner ``compute_s + client_s``
(and wake-up costs) per step and the server ``server_s`` per push; this shows what the real
processes spent, to find what the model misses (its error at many learners per core).
Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

from timing import cpu_seconds  # benchmarks/timing.py (the script's directory is on sys.path)

PROGRESS = re.compile(r"updates +(\d+) \( *(\d+)/s\).*learners (\d+)")


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(child) for child in f.read().split()]
        except OSError:
            pass
    return found


def usage(pids: list[int]) -> dict[int, tuple[float, int, int]]:
    """pid → (CPU seconds, voluntary switches, involuntary switches), for those still running."""
    found = {}
    for pid in pids:
        try:
            cpu = cpu_seconds(pid)
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        switches = [int(re.search(rf"^{kind}_ctxt_switches:\s+(\d+)", status, re.M).group(1))
                    for kind in ("voluntary", "nonvoluntary")]  # fmt: skip
        found[pid] = (cpu, *switches)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("learners", type=int)
    ap.add_argument("protocol", nargs="?", default="async")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=float, default=2000)  # stopped after the window: only needs to outlast it
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rudra_async", "train", "-l", str(args.learners), "--protocol", args.protocol,
         "-b", str(args.batch_size), "--epochs", str(args.epochs), "--model", args.model,
         "--dataset", args.dataset, "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its progress lines as they are written, not in 4 KB blocks
    )  # fmt: skip
    counts: list[tuple[int, int, int]] = []  # (updates so far, updates last second, learners connected)

    def read() -> None:
        for line in proc.stdout:
            if found := PROGRESS.search(line):
                counts.append(tuple(int(g) for g in found.groups()))

    threading.Thread(target=read, daemon=True).start()
    while not any(rate > 0 and connected == args.learners for _, rate, connected in counts):
        if proc.poll() is not None:
            raise SystemExit("the run ended before every learner was connected: give more --epochs")
        time.sleep(0.2)
    time.sleep(1.0)
    pids = descendants(proc.pid)
    for _ in range(20):  # a learner's process may not be listed yet under the process that started it
        if len(pids) > args.learners:
            break
        time.sleep(0.1)
        pids = descendants(proc.pid)
    before, updates0, t0 = usage(pids), counts[-1][0], time.monotonic()
    time.sleep(args.seconds)
    after, updates1, t1 = usage(pids), counts[-1][0], time.monotonic()
    proc.send_signal(signal.SIGINT)  # the window is measured: the rest of the run is not needed
    proc.wait(timeout=120)
    if set(before) - set(after):
        raise SystemExit("a process ended inside the window (a learner done with its epochs): give more --epochs")
    updates = updates1 - updates0
    if updates <= 0:
        raise SystemExit("no update in the window: give more --epochs")
    print(f"λ = {args.learners} {args.protocol}: {updates / (t1 - t0):,.0f} updates/s")
    print("| process | CPU per update | voluntary switches per update | involuntary | CPU share |")
    print("| --- | --- | --- | --- | --- |")
    total = 0.0
    for pid in sorted(set(before) & set(after)):
        cpu, voluntary, involuntary = (a - b for a, b in zip(after[pid], before[pid]))
        if not cpu:
            continue  # an idle helper (multiprocessing's)
        total += cpu
        role = "server (train)" if pid == proc.pid else f"learner {pid}"
        print(f"| {role} | {1e3 * cpu / updates:.3f} ms | {voluntary / updates:.2f} | {involuntary / updates:.2f} "
              f"| {cpu / (t1 - t0):.2f} |")  # fmt: skip
    print(f"| all | {1e3 * total / updates:.3f} ms | | | {total / (t1 - t0):.2f} cores |")


if __name__ == "__main__":
    main()
