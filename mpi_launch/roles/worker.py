"""The input worker: reads its CS-2's micro-batches from the global stream and sends them ahead.

Its messages carry no simulated time: input is prefetched and small beside the weights, so the
model takes it as there when a step starts (docs/design.md section 8)."""
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
                    reqs += [self.comm.Isend(a, dest=dest, tag=tag(DATA, m, i)) for i, a in enumerate(parts)]
                msg.wait_all(reqs, f"CS-2 {csx} to take the micro-batches of step {step}")
                self.step_done(step)
        finally:
            stream.close()
