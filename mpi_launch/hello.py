"""The smallest real MPI job: every rank reports in, rank 0 checks them and prints one JSON line.

Run it with ``mpiexec -n 2 python -m mpi_launch.hello``; ``wse doctor`` does exactly that.
"""
import json
import os
import socket


def main():
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    # Both messaging paths the cluster uses: pickled objects (gather) and numpy buffers (Allreduce).
    reports = comm.gather({"rank": comm.rank, "host": socket.gethostname(), "pid": os.getpid()}, root=0)
    total = np.zeros(1, dtype=np.int64)
    comm.Allreduce(np.array([comm.rank + 1], dtype=np.int64), total, op=MPI.SUM)
    if comm.rank == 0:
        size = comm.size
        ok = (sorted(r["rank"] for r in reports) == list(range(size))
              and int(total[0]) == size * (size + 1) // 2)
        print(json.dumps({
            "ok": ok,
            "size": size,
            "hosts": sorted({r["host"] for r in reports}),
            "library_version": " ".join(MPI.Get_library_version().split("\n", 1)[0].split()),
            "mpi4py": __import__("mpi4py").__version__,
        }), flush=True)


if __name__ == "__main__":
    main()
