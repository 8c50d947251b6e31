"""The cycle engine as an object you can step: ``Engine(compiled)``, ``step(n)``, ``run(max_cycles)``,
and how a run ended as an ``Outcome``. The cycle rules are ``_engine.pyx``'s; this is its Python
face, which knows the compiled program's arrays by name so that no caller passes them in order."""
import enum

import numpy as np

from wse_core.fabric import _engine


class Outcome(enum.Enum):
    """Where a run stands (``_engine.Engine.advance``'s status codes, by name)."""
    RUNNING = -1          # step(n) ended before the program did
    DONE = 0              # every core idle, every queue empty
    DEADLOCK = 1          # nothing moved and nothing is in flight
    CYCLE_LIMIT = 2       # max_cycles reached (or the engine's last cycle, 2**31 - 2)
    UNREAD_WAVELETS = 3   # wavelets left in a core queue that no task will read

    def is_terminal(self):
        return self is not Outcome.RUNNING


class Engine:
    """One run of a ``run.Compiled`` program from cycle 0, on the program's own memory and launched
    tasks (copy data in and launch before the first step; ``memcpy_d2h`` reads memory between
    steps). It counts, per PE, ``busy`` elements, ``stall`` slots and ``link`` wavelets per port."""

    def __init__(self, compiled):
        f = compiled.fabric
        P = f.width * f.height
        self.busy, self.stall, self.link = np.zeros(P, np.int64), np.zeros(P, np.int64), np.zeros(P * 5, np.int64)
        c = compiled
        self._core = _engine.Engine(
            W=f.width, H=f.height, C=c.C, Q=f.queue_depth, latency=f.hop_latency, rx=c.rx, tx=c.tx,
            pe_code=c.pe_code, mem_off=c.mem_off, mem=c.mem, task_color=c.task_color, task_start=c.task_start,
            task_len=c.task_len, ntasks=c.ntasks, op=c.op, length=c.length, kind=c.kind, arg=c.arg,
            stride=c.stride, immv=c.immv, iarg=c.iarg, ranges=c.ranges, target=c.target, asyn=c.asyn,
            active=c.active, blocked=c.blocked, busy=self.busy, stall=self.stall, link=self.link)

    @property
    def cycles(self):
        """Cycles run so far (when done: the last cycle in which something happened)."""
        return self._core.cycle

    def step(self, n=1):
        """Run ``n`` more cycles, or fewer if the program ends; the ``Outcome`` (RUNNING if it goes on)."""
        return Outcome(self._core.advance(self._core.cycle + n))

    def run(self, max_cycles=10**9):
        """Run until the program ends or ``max_cycles`` cycles in all have run (then CYCLE_LIMIT)."""
        outcome = Outcome(self._core.advance(max_cycles))
        return Outcome.CYCLE_LIMIT if outcome is Outcome.RUNNING else outcome

    def state(self):
        """Per PE: the running task (``cur_task``, -1 none), wavelets in the router (``pending``) and
        per [PE, color] queue counts (``rq_cnt``, ``cq_cnt``); what an error message names."""
        return self._core.state()
