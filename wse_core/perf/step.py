"""The analytical walk of one weight-streaming training step: the time the emulated cluster takes,
for any model, batch and number of CS-2s, without running anything (docs/design/time-model.md "The walk").

It walks the step protocol the ranks run: the table ``mpi_launch.protocol.STEP`` (sender, receiver,
tag, payload and simulated-clock rule of every message), whose rows it cites by name.
It does not import it: ``wse_core`` sits below ``mpi_launch``, and the walk needs the table's clock
rules, which it follows through ``perf.clock.Port.carry`` as the ranks do, not its tags or payloads.
What the walk adds to the table:

* A step is its micro-batches one after another, each through ``wse_core.microbatch.micro_batch_schedule``: forward,
  then segment by segment a recompute and the backward (docs/design/time-model.md "Micro-batching").
* Ports serialise what crosses them (each is busy until its last byte has left), in the order the
  ranks' programs send: the weights of each item of the schedule (STEP["forward weights"],
  STEP["recompute weights"], STEP["backward weights"]), the next item's before the
  STEP["gradients"] of a backward one. The SwarmX root
  keeps one port per MemoryX server, every lower link of the tree one (a node sends to all its
  children at once, one port per child, so one path stands for all), a CS-2 its I/O (one budget of
  ``Hardware.io_gbps`` for weights in and gradients out: the reading this model takes of the
  published 1.2 Tb/s). An item's weights may cross a CS-2's port from when the item before it
  starts computing; the step's first from when it starts.
* A CS-2 computes each item on one micro-batch (``model.unit_seconds``: a recompute costs the
  unit's forward).
* STEP["loss"] and STEP["norms"] reach the coordinator one hop after they leave; its
  STEP["control"] marks the step and reaches MemoryX one hop later, whose update
  (``memoryx_update_seconds`` of the bytes it owns) starts once every gradient is in; then the
  next step's weights leave. STEP["data"] carries no time (taken as there when a step starts).
* All CS-2s do the same work at the same times (data parallel, one tree depth), so the walk follows
  one path from MemoryX to a CS-2 and back.
"""
import math
from dataclasses import asdict, dataclass, field

from wse_core.microbatch import micro_batch_schedule, share
from wse_core.perf.clock import Port
from wse_core.perf.hardware import Hardware
from wse_core.perf.model import memoryx_update_seconds, unit_seconds, unit_work

#: Values per message of a tensor through the tree: the ranks' chunk (mpi_launch.messaging.CHUNK_FLOATS
#: elements of the wire's dtype), so a chunk is 512 KiB in a mixed-precision run, 1 MiB in float32.
CHUNK_VALUES = 1 << 18


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


def stream_bytes(model, itemsize):
    """Bytes streamed for each unit: every parameter it uses (a tied one with each unit that uses it)."""
    return model.stream_bytes(itemsize)


def step_bytes(model, itemsize):
    """Bytes one micro-batch moves across a CS-2's I/O: every item's weights in, every unit's gradients out."""
    nbytes = stream_bytes(model, itemsize)
    return sum(nbytes[u] * (2 if kind == "backward" else 1) for kind, u in micro_batch_schedule(len(nbytes)))


@dataclass
class StepTime:
    """One step of the emulated cluster, seconds; ``parts`` says where the time went."""
    step_s: float
    samples_per_s: float
    compute_s: float          # every micro-batch's forward, recompute and backward on one CS-2
    stream_s: float           # every micro-batch's weights and gradients over one CS-2's I/O: the I/O-bound time
    exposed_stream_s: float   # time the CS-2 waited for weights (the stream not hidden by compute)
    reduce_tail_s: float      # from the CS-2's last gradient out to the last gradient at MemoryX
    optimizer_s: float        # MemoryX's update
    tree_depth: int
    num_csx: int
    detail: dict = field(default_factory=dict)

    def to_dict(self):
        return asdict(self)


def update_seconds(model, owner, hw):
    """Seconds each MemoryX server's update takes: the bytes of the units it owns (``owner``: the
    server of each unit, as the plan gives them)."""
    nbytes = model.unit_bytes(itemsize=hw.bytes_per_value)
    return [memoryx_update_seconds(sum(b for b, o in zip(nbytes, owner) if o == k), hw)
            for k in range(max(owner) + 1)]


def io_seconds(model, hw, micro_batches=1):
    """Every micro-batch's weights in and gradients out over one CS-2's I/O: the I/O-bound time of a step."""
    return micro_batches * step_bytes(model, hw.bytes_per_value) / hw.io_bytes_per_s


def walk_step(model, *, num_csx, samples_per_csx, micro_batch_size, seq_len=None, num_wgt_servers=1,
              swarmx_fanout=None, hw=None, steps=3, batch_size=None):
    """The simulated time of a training step of ``model`` (a ``wse_core.nn`` Model) on ``num_csx``
    CS-2s, each with ``samples_per_csx`` samples in micro-batches of ``micro_batch_size`` (a last,
    smaller one padded to it, as the compiled program's shape): the period of the last of ``steps``
    steps walked back to back (the first is a start-up). ``batch_size``: the global batch, when the
    CS-2s' shares are not all ``samples_per_csx`` (the largest). ``hw``: ``Hardware.for_model(model)``
    when not given, as a run of the model is timed.

    Each micro-batch runs ``micro_batch_schedule`` to its end before the next begins. Each port
    serves what crosses it in the order its rank's program does (mpi_launch.roles): the items'
    weights in schedule order, each crossing a CS-2's port from when the item before it starts
    computing (two units of weights on the wafer), and before the gradients of that item; the ranks'
    clocks keep the same order, so they and the walk agree."""
    hw = hw or Hardware.for_model(model)
    fanout = swarmx_fanout or hw.swarmx_fanout
    depth = tree_depth(num_csx, fanout)
    n_micro = share(samples_per_csx, micro_batch_size)
    cost = [unit_seconds(unit_work(u, micro_batch_size, seq_len), hw) for u in model.units]
    schedule = micro_batch_schedule(len(cost))
    items = [(m, kind, u) for m in range(n_micro) for kind, u in schedule]
    seconds = [cost[u]["backward" if kind == "backward" else "forward"] for _, kind, u in items]
    last_forward = max(i for i, (m, kind, _) in enumerate(items) if m == n_micro - 1 and kind == "forward")
    nbytes = stream_bytes(model, hw.bytes_per_value)
    owner = balance(model.unit_bytes(), num_wgt_servers)
    update = update_seconds(model, owner, hw)
    lat = hw.swarmx_hop_latency_s
    link = min(hw.swarmx_port_gbps * hw.swarmx_ports_per_child, hw.io_gbps)
    port = dict(latency_s=lat, chunk_bytes=CHUNK_VALUES * hw.bytes_per_value)
    mx = [Port(hw.memoryx_gbps, **port) for _ in range(num_wgt_servers)]   # kept by the SwarmX root
    tree = [Port(link, **port) for _ in range(depth - 1)]                  # kept by each lower node
    csx = Port(hw.io_gbps, **port)                                         # the CS-2's own I/O

    def weights(u, ready, accept):  # STEP["forward weights"], STEP["recompute weights"], STEP["backward weights"]
        header = (ready[owner[u]], None)
        for p in (mx[owner[u]], *tree):
            header, _ = p.carry(nbytes[u], header)
        return csx.carry(nbytes[u], header, accept)[1]

    def gradients(u, ready):  # STEP["gradients"]
        header = (ready, None)
        for p in (csx, *reversed(tree), mx[owner[u]]):
            header, end = p.carry(nbytes[u], header)
        return end

    t, control = 0.0, [0.0]              # the coordinator's first control message, at 0
    ready = [lat] * num_wgt_servers      # when each MemoryX starts streaming the step
    for _ in range(steps):
        waited, at_memoryx, last_out = 0.0, [0.0] * num_wgt_servers, 0.0
        arrive = weights(items[0][2], ready, t)
        for i, (_, kind, u) in enumerate(items):
            begin = max(t, arrive)
            waited += begin - t
            if i + 1 < len(items):
                arrive = weights(items[i + 1][2], ready, begin)
            t = begin + seconds[i]
            if i == last_forward:
                loss_at = t  # STEP["loss"]: the losses of every micro-batch, after the last forward pass
            if kind == "backward":
                done = gradients(u, t)
                last_out = max(last_out, csx.free)
                at_memoryx[owner[u]] = max(at_memoryx[owner[u]], done)
        # STEP["norms"] to the coordinator, its STEP["control"] back; then each MemoryX updates.
        coordinator = max(loss_at, *at_memoryx) + lat
        control.append(coordinator)
        ready = [max(at_memoryx[k], coordinator + lat) + update[k] for k in range(num_wgt_servers)]
    step = control[-1] - control[-2]
    return StepTime(
        step_s=step, samples_per_s=(batch_size or num_csx * samples_per_csx) / step, compute_s=sum(seconds),
        stream_s=io_seconds(model, hw, n_micro), exposed_stream_s=waited, reduce_tail_s=max(at_memoryx) - last_out,
        optimizer_s=max(update), tree_depth=depth, num_csx=num_csx,
        detail={"weight_bytes": sum(nbytes), "units": len(nbytes), "micro_batches": n_micro,
                "recomputed_units": sum(kind == "recompute" for kind, _ in schedule),
                "io_gbps": hw.io_gbps, "precision": hw.precision, "system": hw.system})


def lower_bounds(model, *, samples_per_csx, micro_batch_size=None, seq_len=None, hw=None):
    """What no step can beat: every micro-batch's weights and gradients over one CS-2's I/O, and its
    multiply-adds (forward, recompute, backward) at the wafer's peak."""
    hw = hw or Hardware.for_model(model)
    micro_batch_size = micro_batch_size or samples_per_csx
    passes = {"forward": 1, "recompute": 1, "backward": 2}
    macs = 0
    for kind, u in micro_batch_schedule(len(model.units)):
        w = unit_work(model.units[u], samples_per_csx, seq_len)
        macs += passes[kind] * (sum(M * K * N for M, K, N in w.gemms) + w.other_macs)
    return {"io_s": io_seconds(model, hw, samples_per_csx // micro_batch_size), "flops_s": 2 * macs / hw.peak_flops}
