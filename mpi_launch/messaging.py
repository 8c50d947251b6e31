"""Messaging helpers every role uses: waiting without spinning, tags, and dicts of arrays.

Never spin (docs/design.md section 3): MPICH's blocking ``Wait``/``Recv`` busy-poll, and on an
oversubscribed machine (8 ranks on 2 cores) a waiting rank then steals the core from the rank that
computes. ``wait_all`` tests the requests and sleeps between tests with an exponential backoff
(50 us up to 1 ms), so a rank that waits costs almost nothing; past ``timeout`` it raises
``PeerTimeout`` naming what it was waiting for. The timeout follows the job's pace: a peer may be
computing a whole step while this rank waits for it (``Role.step_done`` sets it). Bulk tensors
move as numpy buffers (upper-case calls), cut into chunks of ``CHUNK_FLOATS`` elements; small
control messages as pickled objects.

Tags come from mpi_launch.protocol. Chunks of one tensor share one tag: MPI matches messages between two ranks with the same tag in
the order they were posted, so the receiver posts one receive per chunk into views of its buffer.
A SwarmX node forwards (``relay``) or sums (``reduce``) chunk c while chunk c+1 is still arriving,
so a tensor pipelines through the tree instead of being stored and forwarded whole at each level.
"""
import time

import numpy as np
from mpi4py import MPI

from mpi_launch.protocol import tag

#: Seconds a rank waits for a peer before declaring it unresponsive, and why that long
#: (``set_timeout`` changes both; a role sets them from runconfig, ``Role.step_done``).
_timeout = {"seconds": 300.0, "why": "the default"}
_MIN_SLEEP, _MAX_SLEEP = 50e-6, 1e-3

#: Elements per message (1 MiB of float32): large enough that MPI's per-message cost is small
#: against the copy, small enough that a tree of depth d adds d chunk-times, not d tensor-times.
CHUNK_FLOATS = 1 << 18


class PeerTimeout(RuntimeError):
    """A peer did not answer in time (it stopped, hung, or died without the job noticing)."""


class PeerLost(RuntimeError):
    """An exchange with a peer failed in MPI: usually the echo of that peer's death."""


def set_timeout(seconds, why):
    """Set how long waits last before ``PeerTimeout``, and ``why`` (said in its message)."""
    _timeout.update(seconds=float(seconds), why=why)


def _expired(timeout, what):
    """The PeerTimeout of a wait for ``what`` that lasted ``timeout`` (None: the job's timeout)."""
    if timeout is None:
        return PeerTimeout(f"no answer within {_timeout['seconds']:.1f} s ({_timeout['why']}) "
                           f"while waiting for {what}")
    return PeerTimeout(f"no answer within {timeout:g} s while waiting for {what}")


def _test(test, what):
    try:
        return test()
    except Exception as exc:  # mpi4py raises MPI.Exception (and plain Exception for some status errors)
        raise PeerLost(f"MPI error while waiting for {what}: {str(exc).splitlines()[0] if str(exc) else exc}") from None


def wait_all(requests, what, timeout=None):
    """Wait for every request with sleeps in between. Never spins.

    The backoff and the timeout restart whenever a request completes: a rank whose transfers keep
    moving polls often (MPICH moves a large message only while both sides call into MPI) and is
    never taken for a silent peer.
    """
    requests = [r for r in requests if r is not None]
    limit = _timeout["seconds"] if timeout is None else timeout
    deadline, pause = time.monotonic() + limit, _MIN_SLEEP
    while requests:
        done = _test(lambda: MPI.Request.Testsome(requests), what)
        if done is None:  # every request was already complete (MPI_UNDEFINED)
            return
        if done:
            finished = set(done)
            requests = [r for i, r in enumerate(requests) if i not in finished]
            deadline, pause = time.monotonic() + limit, _MIN_SLEEP
            continue
        if time.monotonic() > deadline:
            raise _expired(timeout, what)
        time.sleep(pause)
        pause = min(pause * 2, _MAX_SLEEP)


def recv_object(comm, source, tag_, what, timeout=None):
    """A pickled message of any size from ``source``, received without spinning: probe with sleeps
    in between until it is there (an ``irecv`` without a buffer holds only 32 KiB), then take it."""
    deadline = time.monotonic() + (_timeout["seconds"] if timeout is None else timeout)
    pause = _MIN_SLEEP
    while True:
        message = _test(lambda: comm.improbe(source=source, tag=tag_), what)
        if message is not None:
            return _test(message.recv, what)
        if time.monotonic() > deadline:
            raise _expired(timeout, what)
        time.sleep(pause)
        pause = min(pause * 2, _MAX_SLEEP)


def chunks(a):
    """Views of ``a``'s elements, ``CHUNK_FLOATS`` at a time (one empty view for an empty array)."""
    flat = a.reshape(-1)
    return [flat[i:i + CHUNK_FLOATS] for i in range(0, max(flat.size, 1), CHUNK_FLOATS)]


def isend_arrays(comm, arrays, dest, phase, unit, index=0):
    """Post non-blocking sends of contiguous arrays, chunked; return the requests (keep the arrays alive).

    Array j travels under ``tag(phase, unit, index + j)``.
    """
    return [comm.Isend(c, dest=dest, tag=tag(phase, unit, index + j))
            for j, a in enumerate(arrays) for c in chunks(np.ascontiguousarray(a))]


def irecv_into(comm, arrays, source, phase, unit, index=0):
    """Post chunked non-blocking receives into ``arrays`` (the mirror of ``isend_arrays``); return the requests."""
    return [comm.Irecv(c, source=source, tag=tag(phase, unit, index + j)) for j, a in enumerate(arrays)
            for c in chunks(a)]


def irecv_arrays(comm, shapes_dtypes, source, phase, unit):
    """Post chunked non-blocking receives into fresh arrays; return (arrays, requests)."""
    arrays = [np.empty(s, d) for s, d in shapes_dtypes]
    return arrays, irecv_into(comm, arrays, source, phase, unit)


def _in_order(items, on_done, what):
    """Call ``on_done(payload)`` for each (requests, payload) in order as its requests complete.

    Sleeps with backoff only while the next item is incomplete, and restarts both the backoff and
    the timeout whenever an item completes (a long transfer that keeps moving is not a silent peer).
    """
    for reqs, payload in items:
        deadline, pause = time.monotonic() + _timeout["seconds"], _MIN_SLEEP
        while not _test(lambda: MPI.Request.Testall(reqs), what):
            if time.monotonic() > deadline:
                raise _expired(None, what)
            time.sleep(pause)
            pause = min(pause * 2, _MAX_SLEEP)
        on_done(payload)


def relay(comm, shapes_dtypes, sources, dests, phase, unit, what):
    """Receive array i from ``sources[i]`` and forward each chunk to every rank of ``dests`` as it lands.

    Returns (arrays, send requests); the arrays back the sends, so keep them until those complete.
    """
    arrays = [np.empty(s, d) for s, d in shapes_dtypes]
    sends, items = [], []
    for i, (a, src) in enumerate(zip(arrays, sources)):
        t = tag(phase, unit, i)
        items += [([comm.Irecv(c, source=src, tag=t)], (c, t)) for c in chunks(a)]
    _in_order(items, lambda ct: sends.extend(comm.Isend(ct[0], dest=d, tag=ct[1]) for d in dests), what)
    return arrays, sends


def reduce(comm, shapes_dtypes, kids, dests, phase, unit, what, combine=None):
    """Sum array i over ``kids`` (``tree_sum`` in child order, chunk by chunk) and send it to ``dests[i]``.

    Each chunk is summed and sent on as soon as every child's copy of it has landed; the sum is
    elementwise, so chunking never changes its bits. ``combine`` (default: ``tree_sum``) sums the
    children's chunks (``Precision.wire_sum`` for 16-bit gradients). Returns (sums, send requests).
    """
    from wse_core.tree import tree_sum

    combine = combine or tree_sum
    sums = [np.empty(s, d) for s, d in shapes_dtypes]
    parts = [[np.empty(s, d) for s, d in shapes_dtypes] for _ in kids]
    sends, items = [], []
    for i, total in enumerate(sums):
        t = tag(phase, unit, i)
        kid_chunks = [chunks(p[i]) for p in parts]
        for c, out in enumerate(chunks(total)):
            pieces = [kc[c] for kc in kid_chunks]
            reqs = [comm.Irecv(x, source=k, tag=t) for x, k in zip(pieces, kids)]
            items.append((reqs, (out, pieces, dests[i], t)))

    def add_and_send(item):
        out, pieces, dest, t = item
        out[...] = combine(pieces)
        sends.append(comm.Isend(out, dest=dest, tag=t))

    _in_order(items, add_and_send, what)
    return sums, sends
