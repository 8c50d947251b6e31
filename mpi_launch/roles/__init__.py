"""The roles of the weight-streaming cluster, one module and one class each, with a ``run()``
(and the pipelined run's CS-2, ``pipeline``: docs/design.md section 9).

One training step (docs/design.md section 2), for streaming units u = 0..U-1:

* input workers send each CS-2 its micro-batches of the global batch (stream positions
  [t*B, (t+1)*B) of ``GlobalStream``; CS-2 c owns a contiguous run of them);
* forward: each MemoryX sends the weights it owns of unit u to the SwarmX root, which relays them
  down the tree; every CS-2 runs unit u on all its micro-batches while unit u+1 is already arriving;
* loss: each CS-2 reports its loss sum and token count to the coordinator;
* backward: weights stream down again, in reverse; each CS-2 tree-sums its micro-batch gradients
  and sends them up; each SwarmX node tree-sums its children's sums in order and passes the result
  up, the root to the MemoryX that owns the parameter;
* update: MemoryX ranks send the coordinator each parameter's sum of squares; the coordinator
  computes the global norm (in parameter order, as the reference does), the clip factor and the
  learning rate, and tells MemoryX to apply the fused optimizer update.

All sends are non-blocking and all waits go through ``messaging.wait_all`` (sleeps, never spins).
Every sum follows ``wse_core.tree``, so the weights are bit-identical to the single-process
reference step for num_csx = 1, 2, 4, ... (power-of-two fan-out). Every rank also keeps the
emulated hardware's simulated time (``base.Role.clock``; docs/design.md section 8); the messages
that carry it are described in ``mpi_launch.protocol``.
"""
from mpi_launch.roles.coordinator import Coordinator
from mpi_launch.roles.csx import CS2
from mpi_launch.roles.memoryx import MemoryX
from mpi_launch.roles.pipeline import PipelinedCS2
from mpi_launch.roles.swarmx import SwarmX
from mpi_launch.roles.worker import InputWorker

ROLES = {"coordinator": Coordinator, "memoryx": MemoryX, "swarmx": SwarmX, "csx": CS2, "worker": InputWorker,
         "pipeline": PipelinedCS2}
