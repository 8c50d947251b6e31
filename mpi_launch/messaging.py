"""Messaging helpers every role uses: waiting without spinning, tags, and dicts of arrays.

Never spin (DESIGN.md section 3): MPICH's blocking ``Wait``/``Recv`` busy-poll, and on an
oversubscribed machine (8 ranks on 2 cores) a waiting rank then steals the core from the rank that
computes. ``wait_all`` tests the requests and sleeps between tests with an exponential backoff
(50 us up to 5 ms), so a rank that waits costs almost nothing; past ``timeout`` it raises
``PeerTimeout`` naming what it was waiting for. Bulk tensors move as numpy buffers (upper-case
calls); small control messages as pickled objects.
"""
import time

import numpy as np
from mpi4py import MPI

#: Seconds a rank waits for a peer before declaring it unresponsive (``set_timeout`` changes it).
_timeout = {"seconds": 300.0}
_MIN_SLEEP, _MAX_SLEEP = 50e-6, 5e-3

# Tags: phase (weights forward, weights backward, gradients, control ...) x unit x parameter.
FWD_WEIGHTS, BWD_WEIGHTS, GRADS, DATA, CONTROL, REPORT = range(6)
MAX_UNITS, MAX_PARAMS = 256, 32


class PeerTimeout(RuntimeError):
    """A peer did not answer in time (it stopped, hung, or died without the job noticing)."""


class PeerLost(RuntimeError):
    """An exchange with a peer failed in MPI: usually the echo of that peer's death."""


def set_timeout(seconds):
    """Set how long waits last before ``PeerTimeout``: long while 14 ranks import on 2 cores, short after."""
    _timeout["seconds"] = float(seconds)


def _test(test, what):
    try:
        return test()
    except Exception as exc:  # mpi4py raises MPI.Exception (and plain Exception for some status errors)
        raise PeerLost(f"MPI error while waiting for {what}: {str(exc).splitlines()[0] if str(exc) else exc}") from None


def tag(phase, unit=0, index=0):
    """The MPI tag of message ``index`` of ``unit`` in ``phase``."""
    return (phase * MAX_UNITS + unit) * MAX_PARAMS + index


def wait_all(requests, what, timeout=None):
    """Wait for every request with sleeps in between. Never spins."""
    requests = [r for r in requests if r is not None]
    if not requests:
        return
    timeout = _timeout["seconds"] if timeout is None else timeout
    deadline = time.monotonic() + timeout
    pause = _MIN_SLEEP
    while not _test(lambda: MPI.Request.Testall(requests), what):
        if time.monotonic() > deadline:
            raise PeerTimeout(f"no answer within {timeout:.0f} s while waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, _MAX_SLEEP)


def recv_object(comm, source, tag_, what, timeout=None):
    """A small pickled message from ``source``, received without spinning."""
    req = comm.irecv(source=source, tag=tag_)
    timeout = _timeout["seconds"] if timeout is None else timeout
    deadline = time.monotonic() + timeout
    pause = _MIN_SLEEP
    while True:
        done, value = _test(req.test, what)
        if done:
            return value
        if time.monotonic() > deadline:
            req.Cancel()
            raise PeerTimeout(f"no answer within {timeout:.0f} s while waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, _MAX_SLEEP)


def isend_arrays(comm, arrays, dest, phase, unit):
    """Post non-blocking sends of a list of contiguous arrays; return the requests (keep arrays alive)."""
    return [comm.Isend(np.ascontiguousarray(a), dest=dest, tag=tag(phase, unit, i)) for i, a in enumerate(arrays)]


def irecv_arrays(comm, shapes_dtypes, source, phase, unit):
    """Post non-blocking receives into fresh arrays; return (arrays, requests)."""
    arrays = [np.empty(s, d) for s, d in shapes_dtypes]
    reqs = [comm.Irecv(a, source=source, tag=tag(phase, unit, i)) for i, a in enumerate(arrays)]
    return arrays, reqs
