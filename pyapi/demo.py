"""`wse demo`: the main job on built-in defaults.

The weight-streaming cluster is not built yet, so the demo runs, and says it runs, what exists:
a real 2-rank MPI job through the mpich wheel's mpiexec, and the fused AdamW kernel measured
against numpy and against memory-copy bandwidth.
"""
import argparse
import time

INTRO = """\
wse demo
  The weight-streaming cluster (CS-2, MemoryX and SwarmX ranks training a model) is not built yet.
  This demo runs what exists today:
    1. `wse doctor`: versions, and a real 2-rank MPI job through the mpich wheel's mpiexec;
    2. `wse bench optim`: the fused AdamW update on 16M float32 parameters against plain numpy
       and against memory-copy bandwidth, all measured in this run.
"""


def main():
    from bench import optim
    from pyapi import doctor

    print(INTRO, flush=True)
    t0 = time.perf_counter()
    print("== 1. wse doctor", flush=True)
    if doctor.main() != 0:
        return 1
    print("\n== 2. wse bench optim --repeats 5", flush=True)
    result = optim.run(argparse.Namespace(size=16 * 2**20, repeats=5))
    print(optim.report(result))
    print(f"\nwse demo: done in {time.perf_counter() - t0:.1f} s. "
          "For more: `wse bench optim --json optim.json`, `wse --help`.")
    return 0
