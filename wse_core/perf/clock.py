"""The simulated clock's two pieces, shared by the ranks (mpi_launch) and the analytical walk
(``perf.step``), so both keep time by the same rules (docs/design/time-model.md "The clock").

A tensor crossing a link travels with a *header* ``(first, last)``: when its first chunk can start
on this link, and when its last byte left the link before (None on the first link). A ``Port`` (one
end of a link, kept by the rank at that end) serialises what crosses it:

    start = max(first, port free, accept)       accept: when the receiver has room for it
    end   = max(start + bytes / rate, last + latency + chunk / rate)
    the next link's header: (start + chunk / rate + latency, end)

so a tensor pipelines through a chain of links chunk by chunk, and a busy port delays what follows.
"""


class Port:
    """A link's port: its rate and when it is next free (seconds of simulated time)."""

    def __init__(self, gbps, *, latency_s, chunk_bytes):
        self.rate = gbps * 1e9 / 8
        self.latency, self.chunk = latency_s, chunk_bytes
        self.free = 0.0

    def carry(self, nbytes, header, accept=0.0):
        """Move ``nbytes`` with ``header`` across this port; return (the next link's header, the time
        its last byte has crossed)."""
        first, last = header
        start = max(first, self.free, accept)
        head = min(self.chunk, nbytes) / self.rate
        end = start + nbytes / self.rate
        if last is not None:
            end = max(end, last + self.latency + head)
        self.free = end
        return (start + head + self.latency, end), end


class Clock:
    """A rank's simulated time: compute advances it; a message received sets it to at least the
    time the message arrived."""

    def __init__(self, now=0.0):
        self.now = float(now)

    def advance(self, seconds):
        self.now += seconds
        return self.now

    def receive(self, t):
        self.now = max(self.now, t)
        return self.now
