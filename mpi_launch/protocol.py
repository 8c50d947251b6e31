"""The step protocol in one table: every message of a training step, who sends it to whom, under
which tag, what it holds, and the simulated time it carries; the tag layout that names them; the
messages as values (one frozen dataclass each) and the events a rank reports (``RankEvent``).

``STEP`` is the table (in the order a step sends them). The roles (``mpi_launch.roles``) send and
receive these messages and cite their rows as ``STEP["name"]``; the analytical walk
(``wse_core.perf.step``) follows the same clock rules on one path and cites the same rows, without
importing this module (``wse_core`` sits below ``mpi_launch``, and the walk reads no field of the
table: it needs its rules, not its tags). ``tests/test_messaging.py`` checks that every citation
names a row, that every row is cited by a role, and every row that carries time by the walk.

Kinds (the ``phase`` of a tag): weights forward and backward, gradient sums, input data, the
coordinator's control, reports to the coordinator, headers, and weights for a recomputed forward. A tag is
``(phase * slots + unit) * indices + index``: ``unit`` a streaming unit (or a micro-batch, for
data), ``index`` an array of it. The layout is sized for the job (``Layout.for_job``: the model's
units and micro-batches, its largest unit's arrays) and checked against MPI's ``TAG_UB`` before
anything is sent; a tag outside it raises ``ProtocolError`` (a fixed layout of 256 units silently
mixed messages up beyond that). A rank holds its layout in its ``messaging.Link``.

Simulated time (docs/design/time-model.md "The clock"): every tensor of weights or gradients a rank sends is
preceded by a *header* to the same peer, ``{"first", "last", ...}`` (``wse_core.perf.clock``): the
receiving end keeps the link's port, carries the tensor across it (``Port.carry``) and forwards the
next header. Control messages and reports carry their sender's clock as ``t``; input data and
the reports of checkpoints and evaluations carry none.

This module imports nothing of ``mpi_launch``: ``messaging`` builds on it, never the reverse.
"""
import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

from wse_core.errors import JobError

FWD_WEIGHTS, BWD_WEIGHTS, GRADS, DATA, CONTROL, REPORT, HEADER, RCP_WEIGHTS = range(8)
NUM_PHASES = 8
#: Report indices (``tag(REPORT, 0, i)``): losses, gradient norms, checkpoint shards, step times,
#: weights for an evaluation; an inference job's logits.
LOSS, NORMS, SHARD, STEP_TIME, EVAL_WEIGHTS, LOGITS = range(6)
#: The phase of the weights of each kind of item of ``wse_core.perf.step.micro_batch_schedule``.
WEIGHTS_PHASE = MappingProxyType({"forward": FWD_WEIGHTS, "recompute": RCP_WEIGHTS, "backward": BWD_WEIGHTS})


@dataclass(frozen=True)
class Message:
    """One row of the step protocol: ``tag`` as (phase, unit, index), ``payload`` what travels
    (buffers are numpy arrays in chunks, the dataclasses below are pickled), ``clock`` its simulated-time rule."""
    name: str
    sender: str
    receiver: str
    tag: str
    payload: str
    clock: str


#: The messages of one training step, in the order a step sends them (read-only). ``u`` is a
#: streaming unit, ``i`` an array of it, ``m`` a micro-batch (a round: CS-2 c's round m is the
#: global batch's micro-batch ``wse_core.microbatch.MicroBatches.index(m, c)``); "header" is
#: ``(HEADER, u, phase)`` before a tensor. The weights and gradients messages repeat for every round,
#: in the order of ``wse_core.perf.step.micro_batch_schedule``, under the same tags (MPI keeps the
#: order of messages between two ranks under one tag).
STEP = MappingProxyType({m.name: m for m in (
    Message("data", "input worker", "its CS-2 (a pipelined run's too)", "(DATA, m, i)",
            "round m's micro-batch's arrays (Issend: a worker is at most two steps ahead)",
            "none: input is taken as there when a step starts (prefetched, small beside the weights)"),
    Message("forward weights", "MemoryX owning unit u", "SwarmX root, relayed down the tree to every CS-2",
            "(FWD_WEIGHTS, u, i), after its header",
            "unit u's weights on the wire (16-bit patterns in a mixed-precision run), chunked",
            "header (first, last): MemoryX sends every round's at its clock (its update done); the lower "
            "end of each link carries the tensor across its port (Port.carry) and sends the next header "
            "on; a CS-2 accepts an item's weights from when the item before it starts computing and "
            "waits for their last byte"),
    Message("loss scale", "coordinator", "every CS-2, a pipelined run's too (dynamic loss scaling only)",
            "(CONTROL, 0, 0)", "LossScale(scale): the scale of the step to come", "none"),
    Message("loss", "CS-2 (a pipelined run's too)", "coordinator", "(REPORT, 0, LOSS)",
            "LossReport(loss_sums: one per round, tokens, values, t)",
            "t: the CS-2's clock after its last round's forward pass; the coordinator receives it one hop later"),
    Message("recompute weights", "MemoryX owning unit u", "SwarmX root, relayed down the tree to every CS-2",
            "(HEADER, u, RCP_WEIGHTS): the header alone",
            "none: the CS-2 rank keeps the segment's activations, so the weights of its recomputed "
            "forward would not be read (roles.csx)",
            "as forward weights: the header carries the weights across each port, as if they came"),
    Message("backward weights", "MemoryX owning unit u", "SwarmX root, relayed down the tree to every CS-2",
            "(BWD_WEIGHTS, u, i), after its header", "unit u's weights again, units in reverse order",
            "as forward weights; a CS-2 carries the next item's weights across its port before this "
            "unit's gradients (program order = port order)"),
    Message("gradients", "CS-2", "SwarmX parent, summed up the tree in child order; the root to the "
            "parameter's MemoryX", "(GRADS, u, i), after its header",
            "unit u's gradients of the round's micro-batch, on the wire, chunked; MemoryX adds the rounds' "
            "sums (TreeAccumulator)",
            "header (first, last, left): leaves the CS-2 when unit u's backward ends; each node carries "
            "the sum up its link from the latest of its children's headers; MemoryX's clock receives "
            "the last round's last; left: when the last gradient left a CS-2"),
    Message("norms", "MemoryX (a pipelined run's CS-2)", "coordinator", "(REPORT, 0, NORMS)",
            "Norms(sumsq: [(name, sum of squares)], t, left)",
            "t: when the last gradient reached MemoryX; the coordinator receives it one hop later; "
            "t - left is the reduce tail"),
    Message("step time", "CS-2 (a pipelined run's too)", "coordinator", "(REPORT, 0, STEP_TIME)",
            "StepTime(compute, waited)",
            "none: the step's simulated compute and the time it waited for weights, for metrics"),
    Message("control", "coordinator", "every MemoryX (a pipelined run's CS-2)", "(CONTROL, 0, 0)",
            "Control(lr, grad_scale, checkpoint, t, skip, evaluate)",
            "t: the coordinator's clock, which marks the step; MemoryX receives it one hop later, then "
            "its update takes update_seconds and the next step's weights leave"),
    Message("shard", "MemoryX", "coordinator", "(REPORT, 0, SHARD)",
            "Shard(table): the table of the checkpoint shard it wrote (when control asks)", "none"),
    Message("eval weights", "MemoryX", "coordinator", "(REPORT, 0, EVAL_WEIGHTS)",
            "EvalWeights({name: weights} it owns) (when control asks for an evaluation)",
            "none: evaluation is off the clock"),
)})


#: The messages of a forward pass of an inference job (``mpi_launch.roles.inference``;
#: docs/design/inference.md "Inference on the cluster"), in the order a pass sends them. No simulated time rides on
#: them: an inference job's latency is ``wse_core.perf.inference``'s model.
INFER = MappingProxyType({m.name: m for m in (
    Message("pass", "coordinator", "every MemoryX and SwarmX node (weights streamed), or none (resident)",
            "(CONTROL, 0, 0)", "Pass(): stream the weights once more, or Stop(): end", "none"),
    Message("weights", "MemoryX owning unit u", "SwarmX root, relayed down the tree to every CS-2",
            "(FWD_WEIGHTS, u, i)", "unit u's weights on the wire, chunked: once when resident, every pass "
                                   "when streamed", "none"),
    Message("rows", "coordinator", "every CS-2 (streamed: its own sequences), or the first (resident)",
            "(CONTROL, 0, 0)", "Rows(x: token ids [b, t], active, t, added, removed), or Stop()", "none"),
    Message("activations", "CS-2 c (resident)", "CS-2 c + 1, which holds the next units", "(DATA, 0, 0)",
            "the Rows with x the output of CS-2 c's last unit, or the Stop", "none"),
    Message("logits", "CS-2 (streamed), the last CS-2 (resident)", "coordinator", "(REPORT, 0, LOGITS)",
            "the last position's logits [b, vocab] of its rows", "none"),
)})


# The pickled messages of the two tables as values: one frozen dataclass each, named for what it
# says, so a receiver reads fields (and a misspelt one is an AttributeError, not a None) and tells
# messages under one tag apart by type. They pickle through mpi4py's lower-case calls as the dicts
# they replace did; bulk tensors still move as buffers. ``t`` is the sender's simulated clock.

@dataclass(frozen=True)
class LossScale:
    """STEP["loss scale"]: the dynamic loss scale of the step to come."""
    scale: float


@dataclass(frozen=True)
class LossReport:
    """STEP["loss"]: a CS-2's loss sum of each round (in round order), the tokens they count, what else
    a compiled model's step hands its script (one per round, None for a built-in model), and ``t``."""
    loss_sums: list
    tokens: int
    values: list
    t: float


@dataclass(frozen=True)
class Norms:
    """STEP["norms"]: [(name, sum of squares)] of the gradients of the parameters a MemoryX owns;
    ``t`` when the last gradient reached it, ``left`` when it left a CS-2."""
    sumsq: list
    t: float
    left: float


@dataclass(frozen=True)
class StepTime:
    """STEP["step time"]: a CS-2's simulated compute in the step and the time it waited for weights."""
    compute: float
    waited: float


@dataclass(frozen=True)
class Control:
    """STEP["control"]: the update to apply (learning rate, gradient scale), or to skip (its 16-bit
    gradients overflowed); the step whose checkpoint to write after it (None: none); whether to send
    the weights for an evaluation; ``t``, the coordinator's clock, which marks the step."""
    lr: float
    grad_scale: float
    checkpoint: Optional[int]
    t: float
    skip: bool = False
    evaluate: bool = False


@dataclass(frozen=True)
class Shard:
    """STEP["shard"]: the table of the checkpoint shard a MemoryX wrote (``CheckpointWriter.write_shard``)."""
    table: Any


@dataclass(frozen=True)
class EvalWeights:
    """STEP["eval weights"]: {name: weights} a MemoryX owns, for an evaluation."""
    weights: dict


@dataclass(frozen=True)
class Pass:
    """INFER["pass"]: stream the weights once more."""


@dataclass(frozen=True)
class Stop:
    """INFER["pass"] or INFER["rows"]: the job is over (a CS-2 that is not the last hands it on)."""


@dataclass(frozen=True)
class Rows:
    """INFER["rows"] (and INFER["activations"], ``x`` then the output of the sender's last unit): the
    token ids [b, t] of the pass, the sequences of its rows (``active``), the positions ``t`` each row
    adds, and the sequences added and removed since the last pass."""
    x: Any
    active: list
    t: int
    added: list
    removed: list


class RankEvent(str, enum.Enum):
    """What a rank tells the launcher's watchdog through its supervisor (``mpi_launch.supervisor``,
    docs/design/faults.md "Supervisors"): the ``event`` field of the report's JSON line, which is the
    member's value (a str enum: JSON writes it as its value)."""
    HELLO = "hello"            # the supervisor's first line: pid, host, the job's token
    MPI_UP = "mpi_up"          # MPI_Init done: the host's shared-memory segments are mapped
    READY = "ready"            # the role is built
    DONE = "done"              # the role finished its work
    ERROR = "error"            # the one-line error the rank raised (kind: cause or peer)
    STOPPED = "stopped"        # SIGSTOP, a debugger
    CONTINUED = "continued"
    PROXY_LOST = "proxy_lost"  # the MPI proxy that started the supervisor died
    EXIT = "exit"              # the exit code, or the signal that killed the rank

    def __str__(self):  # the value, in messages and f-strings
        return self.value


class ProtocolError(JobError):
    """A message that the tag layout cannot name (a model or batch too large for MPI's tags). A JobError:
    a rank raises it, and the job fails with its line (a RuntimeError, as before)."""


@dataclass(frozen=True)
class Layout:
    """How tags are laid out: ``slots`` units (or micro-batches) per phase, ``indices`` arrays per unit."""
    slots: int = 256
    indices: int = 32

    @classmethod
    def for_job(cls, *, units, micro_batches, arrays_per_unit, tag_ub=None):
        """The layout sized for a job; raise ProtocolError if MPI's tags cannot hold it."""
        slots = max(units, micro_batches, 1)
        indices = max(arrays_per_unit, 4, NUM_PHASES)
        top = NUM_PHASES * slots * indices - 1
        if tag_ub is None:
            from mpi4py import MPI

            tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        if top > tag_ub:
            raise ProtocolError(f"{units} units, {micro_batches} micro-batches and {arrays_per_unit} arrays per "
                                f"unit need MPI tags up to {top:,}; this MPI allows {tag_ub:,}")
        return cls(slots=slots, indices=indices)

    def tag(self, phase, unit=0, index=0):
        """The MPI tag of message ``index`` of ``unit`` in ``phase``."""
        slots, indices = self.slots, self.indices
        if not (0 <= phase < NUM_PHASES and 0 <= unit < slots and 0 <= index < indices):
            raise ProtocolError(f"message (phase {phase}, unit {unit}, index {index}) is outside the tag layout "
                                f"({slots} units, {indices} arrays per unit)")
        return (phase * slots + unit) * indices + index
