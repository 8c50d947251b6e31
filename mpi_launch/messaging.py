"""Messaging every role uses: a rank's ``Link`` (its communicator, the job's tag layout and how long
it waits for a peer), waits that never spin, chunked relay and reduce, and the headers of tensors.

Never spin (docs/design.md section 3): MPICH's blocking ``Wait``/``Recv`` busy-poll, and on an
oversubscribed machine (8 ranks on 2 cores) a waiting rank then steals the core from the rank that
computes. Every wait goes through ``poll``, the one backoff loop: it tests and sleeps between tests
(50 us doubling up to 200 us, both the sleep and the deadline restarted on progress), so a rank that
waits costs almost nothing; past the timeout it raises ``PeerTimeout`` naming what it was waiting
for. The timeout follows the job's pace: a peer may be computing a whole step while this rank waits
for it (``Role.step_done`` sets it on the rank's link). Bulk tensors move as numpy buffers
(upper-case calls), cut into chunks of ``CHUNK_FLOATS`` elements; small control messages as
pickled objects.

Tags come from the link's ``protocol.Layout``; the messages of a step are ``protocol.STEP``. Chunks
of one tensor share one tag: MPI matches messages between two ranks with the same tag in the order
they were posted, so the receiver posts one receive per chunk into views of its buffer. A SwarmX
node forwards (``relay``) or sums (``reduce``) chunk c while chunk c+1 is still arriving, so a
tensor pipelines through the tree instead of being stored and forwarded whole at each level.
"""
import contextlib
import threading
import time

import numpy as np
from mpi4py import MPI

from mpi_launch.protocol import HEADER, Layout

#: A step is a chain of waits (a header, then its tensor, hop after hop, for every micro-batch), each
#: ending up to one sleep after its message came: with 1 ms, a small GPT-2's step of 4 micro-batches
#: took 0.57 s on 2 cores, with 200 us 0.18 s, for the same CPU time (2.9 s for 12 steps).
_MIN_SLEEP, _MAX_SLEEP = 50e-6, 2e-4

#: The longest sleep of a rank off the streaming path (``Link.off_path``): the coordinator and the
#: input workers wait most of a step, and waking every 200 us cost each 5% of a core, taken from the
#: computing CS-2s (measured: 3,200 wake-ups a second each, on 2 cores shared by 7 ranks).
OFF_PATH_SLEEP = 2e-3

#: How often ``Link.progress``'s helper tests its requests while the rank computes.
PROGRESS_EVERY = 1e-3

#: Elements per message (1 MiB of float32, 512 KiB of a mixed-precision run's 16-bit values): large
#: enough that MPI's per-message cost is small against the copy, small enough that a tree of depth d
#: adds d chunk-times, not d tensor-times.
CHUNK_FLOATS = 1 << 18

#: What a poll's test returns: nothing has moved yet, something has (the wait restarts), all done.
IDLE, MOVED, DONE = 0, 1, 2


class PeerTimeout(RuntimeError):
    """A peer did not answer in time (it stopped, hung, or died without the job noticing)."""


class PeerLost(RuntimeError):
    """An exchange with a peer failed in MPI: usually the echo of that peer's death."""


def poll(test, seconds, expired, max_sleep=_MAX_SLEEP):
    """Call ``test()`` until it returns ``DONE``, sleeping between calls that return ``IDLE``. Never spins.

    The sleep starts at 50 us and doubles up to ``max_sleep`` (200 us); after ``MOVED`` (something completed) the
    test runs again at once and both the sleep and the deadline restart: a rank whose transfers
    keep moving polls often (MPICH moves a large message only while both sides call into MPI) and
    is never taken for a silent peer. Past ``seconds`` without progress it raises ``expired()``.
    """
    deadline, pause = time.monotonic() + seconds, _MIN_SLEEP
    while True:
        state = test()
        if state == DONE:
            return
        if state == MOVED:
            deadline, pause = time.monotonic() + seconds, _MIN_SLEEP
            continue
        if time.monotonic() > deadline:
            raise expired()
        time.sleep(pause)
        pause = min(pause * 2, max_sleep)


def _mpi(call, what):
    """``call()``, an MPI error becoming ``PeerLost`` naming ``what`` was waited for."""
    try:
        return call()
    except Exception as exc:  # mpi4py raises MPI.Exception (and plain Exception for some status errors)
        raise PeerLost(f"MPI error while waiting for {what}: {str(exc).splitlines()[0] if str(exc) else exc}") from None


def chunks(a):
    """Views of ``a``'s elements, ``CHUNK_FLOATS`` at a time (one empty view for an empty array)."""
    flat = a.reshape(-1)
    return [flat[i:i + CHUNK_FLOATS] for i in range(0, max(flat.size, 1), CHUNK_FLOATS)]


class Link:
    """A rank's end of the job's messaging: ``comm``, the job's tag ``layout`` (``protocol.Layout``)
    and how long a wait lasts before ``PeerTimeout`` (``timeout`` seconds, and ``why`` that long,
    said in its message). One per rank, held by its role; nothing of it is process-wide."""

    def __init__(self, comm, layout=None, timeout=300.0, why="the default"):
        self.comm, self.layout = comm, layout or Layout()
        self.max_sleep = _MAX_SLEEP
        self.set_timeout(timeout, why)

    def off_path(self):
        """This rank's waits are off the streaming path: they may sleep up to ``OFF_PATH_SLEEP``."""
        self.max_sleep = OFF_PATH_SLEEP

    @contextlib.contextmanager
    def on_path(self):
        """Waits inside are on the step's path after all: they sleep at most 200 us again."""
        off, self.max_sleep = self.max_sleep, _MAX_SLEEP
        try:
            yield
        finally:
            self.max_sleep = off

    def set_timeout(self, seconds, why):
        """Set how long waits last before ``PeerTimeout``, and ``why`` (said in its message)."""
        self.timeout, self.why = float(seconds), why

    def tag(self, phase, unit=0, index=0):
        """The MPI tag of message ``index`` of ``unit`` in ``phase`` (``protocol.Layout.tag``)."""
        return self.layout.tag(phase, unit, index)

    def _poll(self, test, what, timeout=None):
        """``poll`` for ``what``: ``timeout`` seconds, or the job's (which says why it is that long)."""
        if timeout is None:
            seconds, said = self.timeout, f"{self.timeout:.1f} s ({self.why})"
        else:
            seconds, said = timeout, f"{timeout:g} s"
        poll(test, seconds, lambda: PeerTimeout(f"no answer within {said} while waiting for {what}"), self.max_sleep)

    @contextlib.contextmanager
    def progress(self, requests):
        """Drive ``requests`` from a helper thread while the body computes, every ``PROGRESS_EVERY``.

        MPICH moves a large message only while both ends call into MPI: a CS-2 computing a unit
        made none, so the next unit's weights crossed only once it waited for them. The body must
        not touch these requests itself (MPI forbids testing one request from two threads at once);
        an MPI error here is left for the rank's own next wait on them to report.
        """
        live = [r for r in requests if r is not None]
        stop = threading.Event()

        def drive():
            while not stop.wait(PROGRESS_EVERY):
                try:
                    if MPI.Request.Testall(live):
                        return
                except Exception:  # noqa: BLE001 - the rank's own wait raises PeerLost for it
                    return

        helper = threading.Thread(target=drive, name="wse-progress", daemon=True) if live else None
        if helper is not None:
            helper.start()
        try:
            yield
        finally:
            if helper is not None:
                stop.set()
                helper.join()

    def done(self, requests, what):
        """Whether every request has completed, without waiting (buffers behind them may be let go)."""
        live = [r for r in requests if r is not None]
        return not live or bool(_mpi(lambda: MPI.Request.Testall(live), what))

    def wait_all(self, requests, what, timeout=None):
        """Wait for every request (``timeout`` seconds without progress, or the job's). Never spins."""
        pending = [r for r in requests if r is not None]

        def test():
            if not pending:
                return DONE
            done = _mpi(lambda: MPI.Request.Testsome(pending), what)
            if done is None:  # every request was already complete (MPI_UNDEFINED)
                return DONE
            if not done:
                return IDLE
            finished = set(done)
            pending[:] = [r for i, r in enumerate(pending) if i not in finished]
            return MOVED

        self._poll(test, what, timeout)

    def recv_object(self, source, tag_, what, timeout=None):
        """A pickled message of any size from ``source``, received without spinning: probe until it is
        there (an ``irecv`` without a buffer holds only 32 KiB), then take it."""
        got = []

        def test():
            message = _mpi(lambda: self.comm.improbe(source=source, tag=tag_), what)
            if message is None:
                return IDLE
            got.append(_mpi(message.recv, what))
            return DONE

        self._poll(test, what, timeout)
        return got[0]

    def send_header(self, dest, phase, unit, header, **extra):
        """Post the header of a tensor (``(first, last)`` plus any extra times); returns the request."""
        first, last = header
        return self.comm.isend({"first": first, "last": last, **extra}, dest=dest, tag=self.tag(HEADER, unit, phase))

    def recv_header(self, source, phase, unit, what):
        """The header of a tensor from ``source`` (waits without spinning)."""
        return self.recv_object(source, self.tag(HEADER, unit, phase), f"{what} (its header)")

    def isend_arrays(self, arrays, dest, phase, unit, index=0):
        """Post non-blocking sends of contiguous arrays, chunked; return the requests (keep the arrays alive).

        Array j travels under ``tag(phase, unit, index + j)``.
        """
        return [self.comm.Isend(c, dest=dest, tag=self.tag(phase, unit, index + j))
                for j, a in enumerate(arrays) for c in chunks(np.ascontiguousarray(a))]

    def irecv_into(self, arrays, source, phase, unit, index=0):
        """Post chunked non-blocking receives into ``arrays`` (the mirror of ``isend_arrays``); return the requests."""
        return [self.comm.Irecv(c, source=source, tag=self.tag(phase, unit, index + j))
                for j, a in enumerate(arrays) for c in chunks(a)]

    def irecv_arrays(self, shapes_dtypes, source, phase, unit):
        """Post chunked non-blocking receives into fresh arrays; return (arrays, requests)."""
        arrays = [np.empty(s, d) for s, d in shapes_dtypes]
        return arrays, self.irecv_into(arrays, source, phase, unit)

    def _in_order(self, items, on_done, what):
        """Call ``on_done(payload)`` for each (requests, payload) in order as its requests complete;
        the wait restarts whenever an item completes (a long transfer that keeps moving is not a silent peer)."""
        items = list(items)
        at = [0]

        def test():
            if at[0] == len(items):
                return DONE
            reqs, payload = items[at[0]]
            if not _mpi(lambda: MPI.Request.Testall(reqs), what):
                return IDLE
            on_done(payload)
            at[0] += 1
            return MOVED

        self._poll(test, what)

    def relay(self, shapes_dtypes, sources, dests, phase, unit, what):
        """Receive array i from ``sources[i]`` and forward each chunk to every rank of ``dests`` as it lands.

        Returns (arrays, send requests); the arrays back the sends, so keep them until those complete.
        """
        comm = self.comm
        arrays = [np.empty(s, d) for s, d in shapes_dtypes]
        sends, items = [], []
        for i, (a, src) in enumerate(zip(arrays, sources)):
            t = self.tag(phase, unit, i)
            items += [([comm.Irecv(c, source=src, tag=t)], (c, t)) for c in chunks(a)]
        self._in_order(items, lambda ct: sends.extend(comm.Isend(ct[0], dest=d, tag=ct[1]) for d in dests), what)
        return arrays, sends

    def reduce(self, shapes_dtypes, kids, dests, phase, unit, what, combine=None):
        """Sum array i over ``kids`` (``tree_sum`` in child order, chunk by chunk) and send it to ``dests[i]``.

        Each chunk is summed and sent on as soon as every child's copy of it has landed; the sum is
        elementwise, so chunking never changes its bits. ``combine`` (default: ``tree_sum``) sums the
        children's chunks (``Precision.wire_sum`` for 16-bit gradients). Returns (sums, send requests).
        """
        from wse_core.tree import tree_sum

        comm = self.comm
        combine = combine or tree_sum
        sums = [np.empty(s, d) for s, d in shapes_dtypes]
        parts = [[np.empty(s, d) for s, d in shapes_dtypes] for _ in kids]
        sends, items = [], []
        for i, total in enumerate(sums):
            t = self.tag(phase, unit, i)
            kid_chunks = [chunks(p[i]) for p in parts]
            for c, out in enumerate(chunks(total)):
                pieces = [kc[c] for kc in kid_chunks]
                reqs = [comm.Irecv(x, source=k, tag=t) for x, k in zip(pieces, kids)]
                items.append((reqs, (out, pieces, dests[i], t)))

        def add_and_send(item):
            out, pieces, dest, t = item
            out[...] = combine(pieces)
            sends.append(comm.Isend(out, dest=dest, tag=t))

        self._in_order(items, add_and_send, what)
        return sums, sends
