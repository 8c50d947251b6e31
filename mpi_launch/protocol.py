"""The messages of a training step: their kinds, the tag layout, and the simulated time they carry.

Kinds (the ``phase`` of a tag): weights forward and backward, gradient sums, input data, the
coordinator's control, reports to the coordinator, and headers. A tag is
``(phase * slots + unit) * indices + index``: ``unit`` a streaming unit (or a micro-batch, for
data), ``index`` an array of it. The layout is sized for the job (``configure``: the model's units
and micro-batches, its largest unit's arrays) and checked against MPI's ``TAG_UB`` before anything
is sent; a tag outside it raises ``ProtocolError`` (a fixed layout of 256 units silently mixed
messages up beyond that).

Simulated time (docs/design.md section 8): every tensor of weights or gradients a rank sends is
preceded by a *header* to the same peer, ``{"first", "last", ...}`` (``wse_core.perf.clock``): the
receiving end keeps the link's port, carries the tensor across it and forwards the next header.
Control messages and reports carry their sender's clock as ``"t"``.
"""
from mpi4py import MPI

FWD_WEIGHTS, BWD_WEIGHTS, GRADS, DATA, CONTROL, REPORT, HEADER = range(7)
NUM_PHASES = 7
#: Report indices (``tag(REPORT, 0, i)``): losses, gradient norms, checkpoint shards, step times,
#: weights for an evaluation.
LOSS, NORMS, SHARD, STEP_TIME, EVAL_WEIGHTS = range(5)


class ProtocolError(RuntimeError):
    """A message that the tag layout cannot name (a model or batch too large for MPI's tags)."""


_layout = {"slots": 256, "indices": 32}


def configure(*, units, micro_batches, arrays_per_unit, tag_ub=None):
    """Size the tag layout for a job; raise ProtocolError if MPI's tags cannot hold it."""
    slots = max(units, micro_batches, 1)
    indices = max(arrays_per_unit, 4, NUM_PHASES)
    top = NUM_PHASES * slots * indices - 1
    tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) if tag_ub is None else tag_ub
    if top > tag_ub:
        raise ProtocolError(f"{units} units, {micro_batches} micro-batches and {arrays_per_unit} arrays per "
                            f"unit need MPI tags up to {top:,}; this MPI allows {tag_ub:,}")
    _layout.update(slots=slots, indices=indices)


def tag(phase, unit=0, index=0):
    """The MPI tag of message ``index`` of ``unit`` in ``phase``."""
    slots, indices = _layout["slots"], _layout["indices"]
    if not (0 <= phase < NUM_PHASES and 0 <= unit < slots and 0 <= index < indices):
        raise ProtocolError(f"message (phase {phase}, unit {unit}, index {index}) is outside the tag layout "
                            f"({slots} units, {indices} arrays per unit)")
    return (phase * slots + unit) * indices + index


def send_header(comm, dest, phase, unit, header, **extra):
    """Post the header of a tensor (``(first, last)`` plus any extra times); returns the request."""
    first, last = header
    return comm.isend({"first": first, "last": last, **extra}, dest=dest, tag=tag(HEADER, unit, phase))


def recv_header(comm, source, phase, unit, what):
    """The header of a tensor from ``source`` (waits without spinning)."""
    from mpi_launch.messaging import recv_object

    return recv_object(comm, source, tag(HEADER, unit, phase), f"{what} (its header)")
