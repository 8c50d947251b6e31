"""The roles of the weight-streaming cluster, one module and one class each, with a ``run()``
(and the pipelined run's CS-2, ``pipeline``: docs/design.md section 3).

One training step is the table ``mpi_launch.protocol.STEP``: every message, its sender and
receiver, its tag, what it holds and the simulated time it carries (docs/design.md section 3 tells
the step as a story). Each role's docstring names the rows it sends and receives.

Every rank talks through its ``messaging.Link`` (``base.Role.link``): the communicator, the job's
tag layout and how long it waits for a peer. All sends are non-blocking and all waits go through
the link (``messaging.poll``: sleeps, never spins). Every sum follows ``wse_core.microbatch``'s tree, so the
weights are bit-identical to the single-process reference step for num_csx = 1, 2, 4, ...
(power-of-two fan-out). Every rank also keeps the emulated hardware's simulated time
(``base.Role.clock``; docs/design/time-model.md "The clock") by the table's clock rules.
"""
from mpi_launch.roles.coordinator import Coordinator
from mpi_launch.roles.csx import CS2
from mpi_launch.roles.memoryx import MemoryX
from mpi_launch.roles.pipeline import PipelinedCS2
from mpi_launch.roles.swarmx import SwarmX
from mpi_launch.roles.worker import InputWorker

ROLES = {"coordinator": Coordinator, "memoryx": MemoryX, "swarmx": SwarmX, "csx": CS2, "worker": InputWorker,
         "pipeline": PipelinedCS2}
