"""The analytical walk of one weight-streaming training step: the time the emulated cluster takes,
for any model, batch and number of CS-2s, without running anything (docs/design.md section 8).

It follows the protocol the ranks run (docs/design.md section 2), on ports that serialise what
crosses them (each is busy until its last byte has left):

* MemoryX server k streams the weights of the units it owns to the SwarmX root over its own link;
  the tree relays them, chunk by chunk, to every CS-2 (a node sends to all its children at once,
  one port per child). A CS-2 holds two units of weights: unit u's may start arriving when it
  starts computing unit u - 1 (for the first unit: when the step starts; backward, in reverse).
* A CS-2 computes each unit on its slice of the batch (``model.unit_seconds``), forward in unit
  order, then backward in reverse with the weights streamed again; it sends each unit's gradient
  sum as soon as its backward ends. Its I/O port carries weights in and gradients out: one budget
  of ``Hardware.io_gbps`` (the reading this model takes of the published 1.2 Tb/s).
* Each SwarmX node sums its children's gradients chunk by chunk and passes the sum up; the root
  sends each parameter's sum to its MemoryX. Every link of the tree is one port too, shared by the
  weights going down and the gradients coming up.
* When every gradient has arrived (the global norm needs all of them), MemoryX applies the update
  (``memoryx_update_seconds`` of the bytes it owns), and the next step's stream begins.

A tensor crossing a chain of links moves in chunks of ``chunk_bytes``: on each link it starts
when its first chunk has arrived (plus the hop latency) and the port is free, and ends no earlier
than its whole size at that link's rate after it started, nor than one chunk after it ended on
the link before. All CS-2s do the same work at the same times (data parallel, one tree depth),
so the walk follows one path from MemoryX to a CS-2 and back.
"""
import math
from dataclasses import asdict, dataclass, field

from wse_core.perf.hardware import Hardware
from wse_core.perf.model import memoryx_update_seconds, unit_seconds, unit_work

#: Bytes per message of a tensor through the tree: the ranks' chunk (mpi_launch.messaging).
CHUNK_BYTES = 1 << 20


def tree_depth(num_csx, fanout):
    """SwarmX levels between MemoryX and the CS-2s, as mpi_launch.plan builds the tree."""
    depth, n = 1, num_csx
    while n > fanout:
        n, depth = math.ceil(n / fanout), depth + 1
    return depth


def balance(sizes, parts):
    """Split ``sizes`` into ``parts`` (<= len(sizes)) contiguous non-empty runs minimising the largest
    run's sum; the run of each item. How MemoryX servers share the units (mpi_launch.plan)."""

    def runs_needed(cap):
        runs, total = 1, 0
        for s in sizes:
            if total + s > cap:
                runs, total = runs + 1, 0
            total += s
        return runs

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # the smallest capacity that fits in `parts` runs
        mid = (lo + hi) // 2
        if runs_needed(mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    owner, run, total = [], 0, 0
    for i, s in enumerate(sizes):
        # Open a new run when this one is full, or when the remaining items are needed one per run.
        if (total + s > lo or len(sizes) - i <= parts - 1 - run) and total > 0 and run < parts - 1:
            run, total = run + 1, 0
        owner.append(run)
        total += s
    return owner


@dataclass
class StepTime:
    """One step of the emulated cluster, seconds; ``parts`` says where the time went."""
    step_s: float
    samples_per_s: float
    compute_s: float          # forward + backward on one CS-2
    stream_s: float           # weights (twice) and gradients over one CS-2's I/O: the I/O-bound time
    exposed_stream_s: float   # time the CS-2 waited for weights (the stream not hidden by compute)
    reduce_tail_s: float      # from the CS-2's last gradient out to the last gradient at MemoryX
    optimizer_s: float        # MemoryX's update
    tree_depth: int
    num_csx: int
    detail: dict = field(default_factory=dict)

    def to_dict(self):
        return asdict(self)


class _Port:
    def __init__(self, gbps):
        self.rate, self.free = gbps * 1e9 / 8, 0.0


def _send(path, nbytes, ready, hop_latency, chunk):
    """Move ``nbytes`` through ``path`` (ports), ready at the first at ``ready``: its arrival time."""
    first_ready, prev_end = ready, None
    for port in path:
        start = max(first_ready, port.free)
        end = start + nbytes / port.rate
        if prev_end is not None:
            end = max(end, prev_end + hop_latency + min(chunk, nbytes) / port.rate)
        port.free = end
        first_ready = start + min(chunk, nbytes) / port.rate + hop_latency
        prev_end = end
    return prev_end


def walk_step(model, *, num_csx, samples_per_csx, micro_batch_size, seq_len=None, num_wgt_servers=1,
              swarmx_fanout=None, hw=None, chunk_bytes=CHUNK_BYTES, steps=3):
    """The simulated time of a training step of ``model`` (a ``wse_core.nn`` Model) on ``num_csx``
    CS-2s, each with ``samples_per_csx`` samples in micro-batches of ``micro_batch_size``: the
    period of the last of ``steps`` steps walked back to back (the first is a start-up)."""
    hw = hw or Hardware()
    fanout = swarmx_fanout or hw.swarmx_fanout
    depth = tree_depth(num_csx, fanout)
    n_micro = max(1, samples_per_csx // micro_batch_size)
    cost = [unit_seconds(unit_work(u, micro_batch_size, seq_len), hw) for u in model.units]
    fwd = [n_micro * c["forward"] for c in cost]
    bwd = [n_micro * c["backward"] for c in cost]
    nbytes = model.unit_bytes(itemsize=hw.bytes_per_value)
    owner = balance(nbytes, num_wgt_servers)
    owned = [sum(b for b, o in zip(nbytes, owner) if o == k) for k in range(num_wgt_servers)]
    mx = [_Port(hw.memoryx_gbps) for _ in range(num_wgt_servers)]
    link = min(hw.swarmx_port_gbps * hw.swarmx_ports_per_child, hw.io_gbps)
    tree = [_Port(link) for _ in range(depth - 1)]     # root -> ... -> the last node before the CS-2
    csx = _Port(hw.io_gbps)                             # the CS-2's own I/O
    lat = hw.swarmx_hop_latency_s
    start, starts = 0.0, []
    for _ in range(steps):
        starts.append(start)
        waited = 0.0
        # Forward: unit u may arrive once unit u - 1 is computing.
        t, request = start, start
        for u in range(len(model.units)):
            arrive = _send([mx[owner[u]], *tree, csx], nbytes[u], request, lat, chunk_bytes)
            waited += max(0.0, arrive - t)
            begin = max(t, arrive)
            request, t = begin, begin + fwd[u]
        # Backward in reverse: weights again, gradients out as each unit ends.
        request, grads_at_memoryx, last_out = t, 0.0, 0.0
        for u in reversed(range(len(model.units))):
            arrive = _send([mx[owner[u]], *tree, csx], nbytes[u], request, lat, chunk_bytes)
            waited += max(0.0, arrive - t)
            begin = max(t, arrive)
            request, t = begin, begin + bwd[u]
            # The gradient sum goes up: the CS-2's port, the tree (a reduce per level), MemoryX's link.
            up = [csx, *reversed(tree), mx[owner[u]]]
            done = _send(up, nbytes[u], t, lat, chunk_bytes)
            last_out = max(last_out, csx.free)
            grads_at_memoryx = max(grads_at_memoryx, done)
        # The norm: every MemoryX tells the coordinator, which answers (two small messages).
        update_start = grads_at_memoryx + 2 * lat
        update = max(memoryx_update_seconds(b, hw) for b in owned) if owned else 0.0
        start = update_start + update
    step = start - starts[-1]
    total = sum(nbytes)
    return StepTime(
        step_s=step, samples_per_s=num_csx * samples_per_csx / step, compute_s=sum(fwd) + sum(bwd),
        stream_s=3 * total / csx.rate, exposed_stream_s=waited, reduce_tail_s=grads_at_memoryx - last_out,
        optimizer_s=update, tree_depth=depth, num_csx=num_csx,
        detail={"weight_bytes": total, "units": len(nbytes), "micro_batches": n_micro,
                "memoryx_bytes": owned, "io_gbps": hw.io_gbps, "precision": hw.precision})


def lower_bounds(model, *, num_csx, samples_per_csx, seq_len=None, hw=None):
    """What no step can beat: its weights twice and its gradients over one CS-2's I/O, and its
    multiply-adds at the wafer's peak."""
    hw = hw or Hardware()
    total = sum(model.unit_bytes(itemsize=hw.bytes_per_value))
    macs = 0
    for u in model.units:
        w = unit_work(u, samples_per_csx, seq_len)
        macs += 3 * sum(M * K * N for M, K, N in w.gemms) + 3 * w.other_macs
    return {"io_s": 3 * total / hw.io_bytes_per_s, "flops_s": 2 * macs / hw.peak_flops}
