"""Why the test suite runs torch at one thread per process (tests/conftest.py): a decode-sized loop (4 rows through
896 x 4864 matmuls, Qwen2.5-0.5B's MLP width, and a small softmax per step) timed alone and as two processes side by
side, at 1 and 2 torch threads each. On a 2-core machine two processes of two OpenMP threads each wait on each
other's threads; of one thread each they share the cores cleanly.

    python benchmarks/oversubscribed_threads.py [--steps 300]   ->  results/benchmarks/oversubscribed_threads.tsv

One row per (processes, threads, process): wall and CPU seconds, in float32, the CPU and its bf16 kind named
(kvlab.util.hardware.device_name).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

LOOP = """
import resource, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
w = [torch.randn(896, 4864) for _ in range(4)]
x = torch.randn(4, 896)
t = time.perf_counter()
for _ in range(int(sys.argv[2])):
    for m in w:
        x = (x @ m @ m.T).tanh() * 0.01 + x
    torch.softmax(torch.randn(4, 2, 600), -1).sum()
r = resource.getrusage(resource.RUSAGE_SELF)
print(time.perf_counter() - t, r.ru_utime + r.ru_stime)
"""


def timed(processes: int, threads: int, steps: int) -> list[tuple[float, float]]:
    procs = [subprocess.Popen([sys.executable, "-c", LOOP, str(threads), str(steps)], stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    out = [p.communicate()[0].split() for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("the timed loop failed")
    return [(float(wall), float(cpu)) for wall, cpu in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="results/benchmarks/oversubscribed_threads.tsv")
    args = parser.parse_args()
    from kvlab.util.hardware import device_name

    cpu = device_name("cpu").rsplit(",", 1)[0] + ")"  # the CPU and its bf16 kind; the threads are the rows' own

    rows = []
    for processes in (1, 2):
        for threads in (1, 2):
            for i, (wall, cpu) in enumerate(timed(processes, threads, args.steps)):
                rows.append({"processes": processes, "threads": threads, "process": i, "steps": args.steps,
                             "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "cpu": cpu, "dtype": "float32"})
                print(f"{processes} process(es) x {threads} thread(s), #{i}: {wall:.2f} s wall, {cpu:.2f} s CPU")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
