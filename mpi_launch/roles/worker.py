"""The input worker: reads its CS-2's micro-batches from the global stream and sends them ahead.

Its messages carry no simulated time: input is prefetched and small beside the weights, so the
model takes it as there when a step starts (docs/design.md section 8).

Sends are synchronous (``Issend``): one completes only once the CS-2 has posted the receive of that
step, so a worker reads step s + 1 while its CS-2 computes step s and goes no further. With plain
sends the micro-batches are small enough to go eagerly, and a worker ran thousands of steps ahead
into its CS-2's queue of unexpected messages, which MPI searches on every receive: over TCP between
two hosts step 0 took 36 s with ``max_steps`` 30,000 (0.2 s with 3).
"""
import numpy as np

from mpi_launch import messaging as msg
from mpi_launch.protocol import DATA, tag
from mpi_launch.roles.base import Role


class InputWorker(Role):
    def run(self):
        from data_tools.dataset import GlobalStream

        w = self.plan.num_workers_per_csx
        csx, j = divmod(self.index, w)
        t_in = self.params.train_input
        stream = GlobalStream(t_in.data_dir, mixture=t_in.mixture, shuffle=t_in.shuffle, seed=t_in.shuffle_seed)
        dest = self.plan.csx[csx]
        try:
            for step in range(self.start_step, self.max_steps):
                base = step * self.batch_size + csx * self.per_csx
                reqs, keep = [], []
                for m in range(j, self.n_micro, w):
                    batch = stream.read(base + m * self.mbs, self.mbs)
                    parts = [batch] if isinstance(batch, np.ndarray) else list(batch)
                    keep.append(parts)
                    reqs += [self.comm.Issend(a, dest=dest, tag=tag(DATA, m, i)) for i, a in enumerate(parts)]
                # The CS-2 takes them when it starts that step: a whole step of its compute from now.
                msg.wait_all(reqs, f"CS-2 {csx} to take the micro-batches of step {step}")
                self.step_done(step)
        finally:
            stream.close()

    def step_done(self, step):
        # A worker's step s ends when its CS-2 begins step s: the first ends before the CS-2 has
        # computed anything, so here the first step's allowance lasts until the CS-2 begins the second.
        if step > self.start_step:
            super().step_done(step)
