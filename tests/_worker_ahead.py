"""How far an input worker runs ahead of a CS-2 that is slow to take its micro-batches.

Run with the plan's ranks (``mpiexec -n <world size> python tests/_worker_ahead.py RUN_DIR``): the
worker rank runs the real ``InputWorker``, noting in RUN_DIR/worker_step each step whose sends
completed; the CS-2 rank takes step 0's micro-batches, stays away for ``AWAY_S`` (it only lets MPI
progress), reads how far the worker got meanwhile, then takes every later step and checks each
micro-batch against the stream.
Other ranks only finalize. The CS-2 rank prints ``{"worker_done": last step the worker finished}``.
"""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from data_tools.dataset import GlobalStream
from mpi_launch.protocol import DATA
from mpi_launch.resolved import ResolvedRun
from mpi_launch.roles.base import Role
from mpi_launch.roles.worker import InputWorker
from mpi_launch.rundir import RunDir
from mpi_launch.spec import RunSpec

AWAY_S = 2.0


def main(run_dir):
    comm = MPI.COMM_WORLD
    run = RunDir(run_dir).read_run()
    resolved = ResolvedRun.from_json(run["resolved"], RunSpec.from_dict(run["params"]))
    role, index = resolved.plan.role_of(comm.rank)
    if role == "worker":
        Noting(comm, resolved, run, index).run()
    elif role == "csx":
        take(comm, resolved, run)
    MPI.Finalize()


class Noting(InputWorker):
    def step_done(self, step):
        super().step_done(step)
        tmp = self.model_dir / "worker_step.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, self.model_dir / "worker_step")  # never read half written


def take(comm, resolved, run):
    me = Role(comm, resolved, run, 0)  # the tag layout and batch geometry of the real CS-2
    params = resolved.spec
    (worker,) = resolved.plan.workers[0]
    stream = GlobalStream(params.train_input.data_dir, shuffle=params.train_input.shuffle,
                          seed=params.train_input.shuffle_seed)

    def receive_step(step):
        for m in range(me.n_micro):
            got = [np.empty(shape, dtype) for shape, dtype in me.model.example_layout(me.round_size(m), me.seq_len())]
            for i, a in enumerate(got):
                comm.Recv(a, source=worker, tag=me.link.tag(DATA, m, i))
            lo, hi = me.round_range(m)
            assert np.array_equal(got[0], stream.read(step * me.batch_size + lo, hi - lo)), (step, m)

    receive_step(0)
    noted, deadline = me.model_dir / "worker_step", time.monotonic() + 60
    while not noted.exists() and time.monotonic() < deadline:  # the worker learns step 0 was taken
        comm.Iprobe()
        time.sleep(0.01)
    away = time.monotonic() + AWAY_S
    while time.monotonic() < away:  # the worker is free to run ahead now, as far as its sends let it
        comm.Iprobe()  # MPI progress, as a CS-2 at work makes none: no acknowledgement waits on this rank
        time.sleep(0.01)
    done = int(noted.read_text())
    for step in range(1, me.max_steps):
        receive_step(step)
    stream.close()
    print(json.dumps({"worker_done": done}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
