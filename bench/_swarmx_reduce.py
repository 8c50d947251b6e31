"""SwarmX tree reduce against MPI_Reduce / MPI_Allreduce on the same ranks (run under mpiexec).

    mpiexec -n R python -m bench._swarmx_reduce NUM_CSX FANOUT REPEATS MIB [MIB ...]

The ranks are those of a cluster's plan without its coordinator and input workers: world rank 0 is
the MemoryX, then the SwarmX nodes (root first), then the CS-2 leaves. Each leaf holds a float32
buffer of the given size. ``swarmx``: the leaves send it up the tree (``messaging.reduce`` at
every node, exactly as training does) to the MemoryX. ``mpi_reduce``: ``MPI_Reduce`` over the
leaves and the MemoryX (root; it contributes zeros). ``mpi_allreduce``: ``MPI_Allreduce`` over the
leaves. ``*_nb`` are the non-blocking forms waited with ``messaging.Link.wait_all``, which sleeps where
the blocking calls busy-poll. Times are from the ranks leaving a barrier to the last rank done;
rank 0 prints one JSON object: median seconds per method and size.
"""
import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from mpi_launch import messaging as msg
from mpi_launch.plan import make_plan
from mpi_launch.protocol import GRADS, Layout
from wse_core.microbatch import tree_sum


def main(argv):
    num_csx, fanout, repeats = int(argv[0]), int(argv[1]), int(argv[2])
    sizes = [float(x) for x in argv[3:]]
    comm = MPI.COMM_WORLD
    link = msg.Link(comm, Layout(), bells=msg.Bells.open(comm))  # as a training job's ranks wait
    plan = make_plan(num_csx=num_csx, num_wgt_servers=1, num_workers_per_csx=1, swarmx_fanout=fanout,
                     unit_bytes=[1])
    shift = plan.memoryx[0]  # plan rank -> world rank (no coordinator here)
    world = {r - shift for r in [plan.memoryx[0], *plan.swarmx, *plan.csx]}
    if comm.size != len(world):
        raise SystemExit(f"_swarmx_reduce: needs {len(world)} ranks for num_csx {num_csx}, got {comm.size}")
    me = comm.rank + shift
    is_leaf, is_node, is_dest = me in plan.csx, me in plan.swarmx, me == plan.memoryx[0]
    reduce_comm = comm.Split(0 if (is_leaf or is_dest) else MPI.UNDEFINED, key=comm.rank)
    leaf_comm = comm.Split(0 if is_leaf else MPI.UNDEFINED, key=comm.rank)
    results = {}
    for mib in sizes:
        n = int(mib * 2**20) // 4
        layout = [((n,), np.float32)]
        rng = np.random.default_rng(me)
        buf = rng.standard_normal(n, dtype=np.float32) if is_leaf else np.zeros(n, np.float32)
        out = np.empty(n, np.float32)
        times = {}

        def swarmx():
            if is_leaf:
                link.wait_all(link.isend_arrays([buf], plan.parent[me] - shift, GRADS, 0), "parent")
            elif is_node:
                parent = plan.parent[me]
                dest = (parent if parent is not None else plan.memoryx[0]) - shift
                _, sends = link.reduce(layout, [k - shift for k in plan.children[me]], [dest], GRADS, 0,
                                       "children")
                link.wait_all(sends, "parent")
            else:
                link.wait_all(link.irecv_into([out], plan.swarmx_root - shift, GRADS, 0), "root")

        def mpi_reduce(nonblocking):
            def go():
                if reduce_comm == MPI.COMM_NULL:
                    return
                root = 0  # the MemoryX is world rank 0, so rank 0 of reduce_comm
                if nonblocking:
                    link.wait_all([reduce_comm.Ireduce(buf, out if is_dest else None, op=MPI.SUM, root=root)], "reduce")
                else:
                    reduce_comm.Reduce(buf, out if is_dest else None, op=MPI.SUM, root=root)
            return go

        def mpi_allreduce(nonblocking):
            def go():
                if leaf_comm == MPI.COMM_NULL:
                    return
                if nonblocking:
                    link.wait_all([leaf_comm.Iallreduce(buf, out, op=MPI.SUM)], "allreduce")
                else:
                    leaf_comm.Allreduce(buf, out, op=MPI.SUM)
            return go

        methods = {"swarmx": swarmx, "mpi_reduce": mpi_reduce(False), "mpi_reduce_nb": mpi_reduce(True),
                   "mpi_allreduce": mpi_allreduce(False), "mpi_allreduce_nb": mpi_allreduce(True)}
        for name, fn in methods.items():
            samples = []
            for rep in range(repeats + 1):  # the first is a warm-up
                link.wait_all([comm.Ibarrier()], "barrier")
                t0 = time.perf_counter()
                fn()
                dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if rep:
                    samples.append(dt)
            times[name] = statistics.median(samples)
            if name == "swarmx":  # the tree's sum must be exactly the pairwise tree over the leaves
                leaves = comm.gather(buf if is_leaf else None, root=0)
                if is_dest:
                    expect = tree_sum([leaves[c - shift] for c in plan.csx])
                    if not np.array_equal(out, expect):
                        raise SystemExit(f"_swarmx_reduce: wrong sum at {mib} MiB")
        results[str(mib)] = times
    if comm.rank == 0:
        print(json.dumps({"num_csx": num_csx, "fanout": fanout, "ranks": comm.size, "repeats": repeats,
                          "seconds": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
