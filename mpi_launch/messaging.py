"""Messaging every role uses: a rank's ``Link`` (its communicator, the job's tag layout and how long
it waits for a peer), waits that never spin, chunked relay and reduce, and the headers of tensors.

Never spin (docs/design/ranks.md "Never spin while waiting"): MPICH's blocking ``Wait``/``Recv`` busy-poll, and on an
oversubscribed machine (8 ranks on 2 cores) a waiting rank then steals the core from the rank that
computes. Every wait goes through ``poll``, the one backoff loop: it tests and sleeps between tests
(50 us growing fourfold up to a ceiling, both the sleep and the deadline restarted on progress), so a rank
that waits costs almost nothing; past the timeout it raises ``PeerTimeout`` naming what it was
waiting for. A test that finds nothing calls into MPI ``DRAIN`` times more before the rank sleeps
(``Link.drain``): MPICH takes one message a call off a rank's shared-memory queue, so a header
behind a burst of other messages waited a sleep per message. When all the job's ranks share one
machine each has a doorbell (``Bells``): a sender rings its receiver, a SwarmX node that took a
tensor rings its senders, and a waiting rank sleeps on its bell, so the ceiling (20 ms) only bounds
what no bell announces. Without doorbells it is 200 us (2 ms off the path). The timeout follows the job's pace: a peer may be computing a whole step while this rank waits
for it (``Role.step_done`` sets it on the rank's link). Bulk tensors move as numpy buffers
(upper-case calls), cut into chunks of ``CHUNK_FLOATS`` elements; small control messages as
pickled objects.

A rank with several things to wait for at once runs them as lanes (``Lanes``): generators that
yield what they wait for next, moved by one poll loop, so one slow peer holds up only the lane
that needs it.

Tags come from the link's ``protocol.Layout``; the messages of a step are ``protocol.STEP``. Chunks
of one tensor share one tag: MPI matches messages between two ranks with the same tag in the order
they were posted, so the receiver posts one receive per chunk into views of its buffer. A SwarmX
node forwards (``relay``) or sums (``reduce``) chunk c while chunk c+1 is still arriving, so a
tensor pipelines through the tree instead of being stored and forwarded whole at each level.
"""
import contextlib
import os
import select
import threading
import time

import numpy as np
from mpi4py import MPI

from mpi_launch.protocol import HEADER, Layout
from wse_core.errors import JobError

#: A step is a chain of waits (a header, then its tensor, hop after hop, for every micro-batch), each
#: ending up to one sleep after its message came: with 1 ms, a small GPT-2's step of 4 micro-batches
#: took 0.57 s on 2 cores, with 200 us 0.18 s, for the same CPU time (2.9 s for 12 steps).
_MIN_SLEEP, _MAX_SLEEP = 50e-6, 2e-4

#: How much a sleep that ran out grows: after a message, a rank looks again 50 us, 200 us, 800 us
#: ... later. Fourfold, not twofold: with doorbells MemoryX and SwarmX woke 370 times a second, 300
#: and 245 (``wse bench peers``' GPT-2 on 2 CS-2s; steps 320-321 ms, 316-319 fourfold).
_GROWTH = 4

#: The longest sleep of a rank off the streaming path (``Link.off_path``): the coordinator and the
#: input workers wait most of a step, and waking every 200 us cost each 5% of a core, taken from the
#: computing CS-2s (measured: 3,200 wake-ups a second each, on 2 cores shared by 7 ranks).
OFF_PATH_SLEEP = 2e-3

#: How often ``Link.progress``'s helper tests its requests while the rank computes (without doorbells).
PROGRESS_EVERY = 1e-3

#: The longest sleep of a rank with a doorbell (``Bells``), on the streaming path or off it: every
#: message a role waits for rings it awake, so this bounds only what no bell announces.
#: ``wse bench peers``' GPT-2 on 2 CS-2s (7 ranks, 2 cores): MemoryX and SwarmX woke 3,300 times a
#: second each at 200 us, 600-700 with bells and 2 ms, 360-370 with 20 ms; a step took 400-420 ms,
#: 336-359 with bells (2 ms) and ``DRAIN``, 406-417 with ``DRAIN`` alone; 2 ms against 20 ms,
#: alternated: 339/332, 334/328, 333/329 ms.
BELL_SLEEP = 20e-3

#: Calls into MPI after a test that found nothing, before the rank sleeps (``Link.drain``).
DRAIN = 32

#: Elements per message (1 MiB of float32, 512 KiB of a mixed-precision run's 16-bit values): large
#: enough that MPI's per-message cost is small against the copy, small enough that a tree of depth d
#: adds d chunk-times, not d tensor-times.
CHUNK_FLOATS = 1 << 18

#: What a poll's test returns: nothing has moved yet, something has (the wait restarts), all done.
IDLE, MOVED, DONE = 0, 1, 2


class PeerTimeout(JobError):
    """A peer did not answer in time (it stopped, hung, or died without the job noticing)."""


class PeerLost(JobError):
    """An exchange with a peer failed in MPI: usually the echo of that peer's death."""


def poll(test, seconds, expired, max_sleep=_MAX_SLEEP, sleep=time.sleep):
    """Call ``test()`` until it returns ``DONE``, sleeping between calls that return ``IDLE``. Never spins.

    The sleep starts at 50 us and grows fourfold up to ``max_sleep`` (200 us); after ``MOVED`` (something completed) the
    test runs again at once and both the sleep and the deadline restart: a rank whose transfers
    keep moving polls often (MPICH moves a large message only while both sides call into MPI) and
    is never taken for a silent peer. ``sleep`` may end early and say so (``Bells.wait``, rung):
    the message that rang may take a moment to land, so the sleep starts again at 50 us. Past
    ``seconds`` without progress it raises ``expired()``.
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
        rung = sleep(pause)
        pause = _MIN_SLEEP if rung else min(pause * _GROWTH, max_sleep)


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


class Bells:
    """A doorbell for every rank of a job on one machine: a pipe each rank sleeps on (``wait``) and
    any peer writes a byte to (``ring``) after posting it a message (a SwarmX node also after taking a
    tensor from it). A waiting rank then wakes when something is there for it, not hundreds of times
    a second to look (docs/design/ranks.md "Doorbells"). A bell only wakes: nothing depends on it being
    rung, a rank still tests at least every ``BELL_SLEEP``."""

    def __init__(self, read_fd, write_fds):
        self._read, self._write = read_fd, write_fds

    @classmethod
    def open(cls, comm):
        """Every rank's bell (collective), or None when the ranks are not all on this machine (or
        the pipes cannot be opened: the ranks then wake to look, as without).

        Each rank makes an anonymous pipe and its peers open its read end's ``/proc/<pid>/fd/<n>``
        for writing (a pipe opened there is opened as a named one would be). Nothing is ever named
        in the file system: named pipes in a directory of /dev/shm were, and a job killed while they
        were made (the launcher killed during start-up) left the directory behind."""
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        one_machine = node.Get_size() == comm.Get_size()
        node.Free()
        if not one_machine:
            return None
        read, own = os.pipe()  # its own write end: the read end never sees an end of file
        for fd in (read, own):
            os.set_blocking(fd, False)
        ok = read < 1024  # select's limit (poll and epoll would round a sleep up to 1 ms)
        ends = comm.allgather((os.getpid(), read))
        write = {comm.rank: own}
        try:
            for r, (pid, fd) in enumerate(ends):
                if r != comm.rank:
                    write[r] = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no /proc, or one that hides other processes' descriptors
            ok = False
        ok = comm.allreduce(ok, op=MPI.LAND)
        if not ok:
            for fd in {read, *write.values()}:
                os.close(fd)
            return None
        return cls(read, write)

    def ring(self, rank):
        """Wake ``rank`` (if it sleeps in ``wait``); a full pipe already holds a wake-up."""
        try:
            os.write(self._write[rank], b"\1")
        except (BlockingIOError, BrokenPipeError):
            pass

    def wait(self, seconds):
        """Sleep until a peer rings (True) or ``seconds`` pass (False); the bell is quiet again after."""
        if not select.select([self._read], [], [], seconds)[0]:
            return False
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        return True


class Lanes:
    """Waits a rank runs side by side (docs/design/ranks.md "Lanes"). A lane is a generator that yields
    ``(test, what)`` for what it waits for next: ``test()`` returns None until that has come, then
    a value, which is sent back into the lane. ``advance`` takes whatever has come without waiting;
    ``wait`` polls (never spinning) until one lane has ended, the others moving meanwhile."""

    def __init__(self, link, *lanes):
        self.link, self._lanes, self._ended = link, [], {}
        for lane in lanes:
            self.add(lane)

    def add(self, lane):
        """Start running ``lane`` too; returns it."""
        self._lanes.append([lane, None, None])  # the generator, its test and what it waits for
        return lane

    def advance(self):
        """Move every lane as far as what has come lets it; whether anything moved."""
        moved = False
        for state in self._lanes:
            lane, test, what = state
            while True:
                if test is None:
                    value = None  # a lane not started yet
                else:
                    value = test()
                    if value is None:
                        break
                moved = True
                try:
                    test, what = lane.send(value)
                except StopIteration as end:
                    self._ended[lane] = end.value
                    break
            state[1], state[2] = test, what
        self._lanes = [s for s in self._lanes if s[0] not in self._ended]
        return moved

    def waiting_for(self):
        """What the lanes wait for, for an error message."""
        return "; ".join(w for _, t, w in self._lanes if t is not None) or "nothing"

    def wait(self, lane, timeout=None):
        """Poll until ``lane`` has ended, moving every lane; returns the lane's value."""
        def test():
            moved = self.advance()
            if lane in self._ended:
                return DONE
            return MOVED if moved else IDLE

        self.link._poll(test, _Said(self.waiting_for), timeout)
        return self._ended.pop(lane)


class _Said:
    """A description computed when it is said (a timeout names what the lanes wait for then)."""

    def __init__(self, say):
        self.say = say

    def __str__(self):
        return self.say()


class Link:
    """A rank's end of the job's messaging: ``comm``, the job's tag ``layout`` (``protocol.Layout``)
    and how long a wait lasts before ``PeerTimeout`` (``timeout`` seconds, and ``why`` that long,
    said in its message). One per rank, held by its role; nothing of it is process-wide."""

    def __init__(self, comm, layout=None, timeout=300.0, why="the default", bells=None):
        self.comm, self.layout, self.bells = comm, layout or Layout(), bells
        self.max_sleep = _MAX_SLEEP if bells is None else BELL_SLEEP
        self.set_timeout(timeout, why)

    def off_path(self):
        """This rank's waits are off the streaming path: without a doorbell they may sleep longer
        (``OFF_PATH_SLEEP``); with one, every rank sleeps up to ``BELL_SLEEP``."""
        if self.bells is None:
            self.max_sleep = OFF_PATH_SLEEP

    @contextlib.contextmanager
    def on_path(self):
        """Waits inside are on the step's path after all: they sleep as little as the streaming ranks'."""
        off, self.max_sleep = self.max_sleep, _MAX_SLEEP if self.bells is None else BELL_SLEEP
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

        def drained():  # what was queued behind the first message is taken before the rank sleeps
            state = test()
            if state == IDLE:
                self.drain()
                state = test()
            return state

        poll(drained, seconds, lambda: PeerTimeout(f"no answer within {said} while waiting for {what}"), self.max_sleep,
             time.sleep if self.bells is None else self.bells.wait)

    def drain(self):
        """Call into MPI ``DRAIN`` times: MPICH takes one message a call from a rank's shared-memory queue."""
        probe, me = self.comm.Iprobe, self.comm.rank
        for _ in range(DRAIN):
            probe(source=me, tag=MPI.ANY_TAG)

    def ring(self, *ranks):
        """Wake ``ranks`` to a message just posted to them, or taken from them (``Bells``)."""
        if self.bells is not None:
            for r in ranks:
                self.bells.ring(r)

    @contextlib.contextmanager
    def progress(self, requests):
        """Drive ``requests`` from a helper thread while the body computes: every ``PROGRESS_EVERY``,
        or, with a doorbell, whenever it rings (at least every ``BELL_SLEEP``).

        MPICH moves a large message only while both ends call into MPI: a CS-2 computing a unit
        made none, so the next unit's weights crossed only once it waited for them. The body must
        not touch these requests itself (MPI forbids testing one request from two threads at once);
        an MPI error here is left for the rank's own next wait on them to report.
        """
        live = [r for r in requests if r is not None]
        stop = threading.Event()
        wait, every = (stop.wait, PROGRESS_EVERY) if self.bells is None else (self.bells.wait, BELL_SLEEP)

        def drive():
            pause = every
            while True:
                rung = wait(pause)
                if stop.is_set():
                    return
                try:
                    if MPI.Request.Testall(live):
                        return
                    self.drain()
                except Exception:  # noqa: BLE001 - the rank's own wait raises PeerLost for it
                    return
                pause = _MIN_SLEEP if rung else min(pause * _GROWTH, every)

        helper = threading.Thread(target=drive, name="wse-progress", daemon=True) if live else None
        if helper is not None:
            helper.start()
        try:
            yield
        finally:
            if helper is not None:
                stop.set()
                self.ring(self.comm.rank)  # the helper may sleep on this rank's bell
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

    def send_object(self, obj, dest, tag_):
        """Send a pickled object (a report, a control message) and ring ``dest``."""
        self.comm.send(obj, dest=dest, tag=tag_)
        self.ring(dest)

    def isend_object(self, obj, dest, tag_):
        """Post a pickled object and ring ``dest``; returns the request."""
        req = self.comm.isend(obj, dest=dest, tag=tag_)
        self.ring(dest)
        return req

    def send_header(self, dest, phase, unit, header, **extra):
        """Post the header of a tensor (``(first, last)`` plus any extra times); returns the request."""
        first, last = header
        return self.isend_object({"first": first, "last": last, **extra}, dest, self.tag(HEADER, unit, phase))

    def recv_header(self, source, phase, unit, what):
        """The header of a tensor from ``source`` (waits without spinning)."""
        return self.recv_object(source, self.tag(HEADER, unit, phase), f"{what} (its header)")

    def isend_arrays(self, arrays, dest, phase, unit, index=0):
        """Post non-blocking sends of contiguous arrays, chunked; return the requests (keep the arrays alive).

        Array j travels under ``tag(phase, unit, index + j)``.
        """
        reqs = [self.comm.Isend(c, dest=dest, tag=self.tag(phase, unit, index + j))
                for j, a in enumerate(arrays) for c in chunks(np.ascontiguousarray(a))]
        self.ring(dest)
        return reqs

    def irecv_into(self, arrays, source, phase, unit, index=0):
        """Post chunked non-blocking receives into ``arrays`` (the mirror of ``isend_arrays``); return the requests."""
        return [self.comm.Irecv(c, source=source, tag=self.tag(phase, unit, index + j))
                for j, a in enumerate(arrays) for c in chunks(a)]

    def irecv_arrays(self, shapes_dtypes, source, phase, unit):
        """Post chunked non-blocking receives into fresh arrays; return (arrays, requests)."""
        arrays = [np.empty(s, d) for s, d in shapes_dtypes]
        return arrays, self.irecv_into(arrays, source, phase, unit)

    def arrived(self, requests, what):
        """A lane's test (``Lanes``): True once every request has completed."""
        return lambda: True if _mpi(lambda: MPI.Request.Testall(requests), what) else None

    def completing(self, requests, what):
        """A lane's wait for every request to complete (``yield from``)."""
        yield self.arrived(requests, what), what

    def header(self, source, phase, unit, what):
        """A lane's wait for the header of a tensor from ``source`` (``yield from``); returns it."""
        tag_, what = self.tag(HEADER, unit, phase), f"{what} (its header)"

        def test():
            message = _mpi(lambda: self.comm.improbe(source=source, tag=tag_), what)
            return None if message is None else _mpi(message.recv, what)

        return (yield test, what)

    def run(self, lane):
        """Run one lane (``Lanes``) to its end; returns its value."""
        return Lanes(self, lane).wait(lane)

    def relay(self, shapes_dtypes, sources, dests, phase, unit, what):
        """Receive array i from ``sources[i]`` and forward each chunk to every rank of ``dests`` as it lands.

        Returns (arrays, send requests); the arrays back the sends, so keep them until those complete.
        """
        sends = []
        return self.run(self.relaying(shapes_dtypes, sources, dests, phase, unit, what, sends)), sends

    def relaying(self, shapes_dtypes, sources, dests, phase, unit, what, sends):
        """``relay`` as a lane (``Lanes``): its sends go to ``sends``; returns the arrays."""
        comm = self.comm
        arrays = [np.empty(s, d) for s, d in shapes_dtypes]
        items = []
        for i, (a, src) in enumerate(zip(arrays, sources)):
            t = self.tag(phase, unit, i)
            items += [(comm.Irecv(c, source=src, tag=t), c, t) for c in chunks(a)]
        for req, c, t in items:
            yield self.arrived([req], what), what
            sends.extend(comm.Isend(c, dest=d, tag=t) for d in dests)
            self.ring(*dests)
        self.ring(*set(sources))  # their sends are done
        return arrays

    def reduce(self, shapes_dtypes, kids, dests, phase, unit, what, combine=None):
        """Sum array i over ``kids`` (``tree_sum`` in child order, chunk by chunk) and send it to ``dests[i]``.

        Each chunk is summed and sent on as soon as every child's copy of it has landed; the sum is
        elementwise, so chunking never changes its bits. ``combine`` (default: ``tree_sum``) sums the
        children's chunks (``Precision.wire_sum`` for 16-bit gradients). Returns (sums, send requests).
        """
        sends = []
        return self.run(self.reducing(shapes_dtypes, kids, dests, phase, unit, what, sends, combine)), sends

    def reducing(self, shapes_dtypes, kids, dests, phase, unit, what, sends, combine=None):
        """``reduce`` as a lane (``Lanes``): its sends go to ``sends``; returns the sums."""
        from wse_core.microbatch import tree_sum

        comm = self.comm
        combine = combine or tree_sum
        sums = [np.empty(s, d) for s, d in shapes_dtypes]
        parts = [[np.empty(s, d) for s, d in shapes_dtypes] for _ in kids]
        items = []
        for i, total in enumerate(sums):
            t = self.tag(phase, unit, i)
            kid_chunks = [chunks(p[i]) for p in parts]
            for c, out in enumerate(chunks(total)):
                pieces = [kc[c] for kc in kid_chunks]
                reqs = [comm.Irecv(x, source=k, tag=t) for x, k in zip(pieces, kids)]
                items.append((reqs, out, pieces, dests[i], t))
        for reqs, out, pieces, dest, t in items:
            yield self.arrived(reqs, what), what
            out[...] = combine(pieces)
            sends.append(comm.Isend(out, dest=dest, tag=t))
            self.ring(dest)
        self.ring(*kids)  # their sends are done
        return sums
