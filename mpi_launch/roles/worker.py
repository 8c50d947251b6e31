"""The input worker: reads its CS-2's micro-batches from the global stream and sends them ahead
(CS-2 c's round m is the step's micro-batch ``wse_core.microbatch.MicroBatches.index(m, c)``).

It sends STEP["data"] (``mpi_launch.protocol``). Its messages carry no simulated time: input is
prefetched and small beside the weights, so the model takes it as there when a step starts
(docs/design/time-model.md "The walk").

Sends are synchronous (``Issend``): one completes only once the CS-2 has posted the receive of that
step, so a worker is at most ``AHEAD_STEPS`` steps ahead of the step its CS-2 computes (a slow read,
a new file, does not stall the CS-2) and no further (docs/design.md section 2). With plain sends the
micro-batches are small enough to go eagerly, and a worker ran thousands of steps ahead into its
CS-2's queue of unexpected messages, which MPI searches on every receive: over TCP between two hosts
step 0 took 36 s with ``max_steps`` 30,000 (0.2 s with 3).
"""
import collections

import numpy as np

from mpi_launch.protocol import DATA
from mpi_launch.roles.base import Role


#: Steps of micro-batches a worker has sent beyond the one its CS-2 has taken.
AHEAD_STEPS = 2


class InputWorker(Role):
    # A worker's step s ends when its CS-2 begins step s: the first ends before the CS-2 has
    # computed anything, the second holds its start-up, so neither sets the pace (Role.step_done).
    UNCOUNTED_STEPS = 2

    def run(self):
        from data_tools.dataset import GlobalStream

        self.link.off_path()  # it waits for its CS-2 to take data sent ahead (Issend: copied already)
        w = self.plan.num_workers_per_csx
        csx, j = divmod(self.index, w)
        t_in = self.params.train_input
        stream = GlobalStream(t_in.data_dir, mixture=t_in.mixture, shuffle=t_in.shuffle, seed=t_in.shuffle_seed)
        dest = self.plan.csx[csx]
        sent = collections.deque()  # (step, requests, arrays they send) not yet taken by the CS-2

        def taken():
            # The CS-2 takes a step's micro-batches when it begins that step.
            step, reqs, _ = sent.popleft()
            self.link.wait_all(reqs, f"CS-2 {csx} to take the micro-batches of step {step}")
            self.step_done(step)

        try:
            for step in range(self.start_step, self.max_steps):
                reqs, keep = [], []
                for m in range(j, self.n_micro, w):
                    lo, hi = self.round_range(m, csx)
                    batch = stream.read(step * self.batch_size + lo, hi - lo)
                    parts = [batch] if isinstance(batch, np.ndarray) else list(batch)
                    keep.append(parts)
                    reqs += [self.comm.Issend(a, dest=dest, tag=self.link.tag(DATA, m, i)) for i, a in enumerate(parts)]
                self.link.ring(dest)
                sent.append((step, reqs, keep))
                if len(sent) >= AHEAD_STEPS:
                    taken()
            while sent:
                taken()
        finally:
            stream.close()
