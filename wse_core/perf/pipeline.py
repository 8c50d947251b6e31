"""Pipelined execution on one wafer, as a model: where each layer goes, whether the model fits,
and what a training step takes (docs/design/time-model.md "Pipelined mode").

Placement. Every streaming unit (embedding, each block, the head) gets a region of PEs: first
the PEs its memory needs (below), then more in proportion to its work, so that the slowest
stage is as fast as the wafer allows (the largest stage time tau with sum over units of
max(memory PEs, work * PEs / tau) <= the program rectangle), then columns moved from the fastest
stage to the slowest while that helps. Regions are vertical stripes of the program rectangle, in
unit order, samples flowing from west to east.

Memory of a unit's region: its parameters with their training state (``bytes_per_param``: the
16-bit weights the layer computes with, a 32-bit master copy, a 32-bit gradient and each 32-bit
optimizer state; fp32: weights, gradient, states), and the activations it keeps from forward to
backward for each micro-batch in flight: with one forward and one backward in turn per stage
(1F1B), stage i of S holds S - i micro-batches. Only ``Hardware.pe_memory_usable`` of each PE's
SRAM holds them (**assumption**: the rest is code, fabric buffers and stack). Attention
probabilities are taken as recomputed in backward, not kept (**assumption**, as streaming
attention kernels do).

Time. A unit's forward + backward on a micro-batch is ``model.unit_seconds`` with its stripe as
the program rectangle (the calibrated GEMM model: a small layer keeps a small region busy where
it would leave most of the wafer idle). A step of n micro-batches through S
stages takes (n + S - 1) times the slowest stage (fill and drain), then the update, done by
every region at once on its own weights (``UPDATE_OPS_PER_PARAM`` operations per parameter on
each PE's FMAC lanes). The samples stream in over the CS-2's I/O meanwhile.
"""
import math
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from wse_core.microbatch import share
from wse_core.perf.hardware import Hardware
from wse_core.perf.memory import unit_activation_floats
from wse_core.perf.model import unit_seconds, unit_work

#: Operations per parameter of an AdamW update (moments, bias corrections, square root, divide,
#: decay, master-weight cast). **Assumption**, from the fused kernel's arithmetic.
UPDATE_OPS_PER_PARAM = 12


def bytes_per_param(n_states, hw):
    """Bytes a parameter takes on the wafer with its training state (see the module's docstring)."""
    if hw.precision == "fp16":
        return 2 + 4 + 4 + 4 * n_states
    return 4 + 4 + 4 * n_states


@dataclass
class Region:
    name: str
    params: int
    pes: int
    columns: tuple          # [first, last) column of the program rectangle
    stage_s: float          # forward + backward of one micro-batch on this region
    weight_bytes: int       # parameters with their training state
    activation_bytes: int   # activations of the micro-batches in flight
    capacity_bytes: int     # usable SRAM of the region

    @property
    def need_bytes(self):
        return self.weight_bytes + self.activation_bytes


@dataclass
class Placement:
    """A model laid out on one wafer for pipelined training, and what a step takes."""
    fits: bool
    regions: list
    need_bytes: int                 # every region's need
    capacity_bytes: int             # usable SRAM of the program rectangle
    micro_batches: int
    micro_batch_size: int
    step_s: float = math.nan        # NaN when it does not fit
    samples_per_s: float = math.nan
    slowest_stage_s: float = math.nan
    update_s: float = math.nan
    why: str = ""
    detail: dict = field(default_factory=dict)

    def to_dict(self):
        d = asdict(self)
        d["regions"] = [dict(asdict(r), need_bytes=r.need_bytes) for r in self.regions]
        return d

    @classmethod
    def from_dict(cls, d):
        """The placement ``to_dict`` wrote, through JSON too: a region's need_bytes (derived) left out,
        and a time written as null (a NaN) taken back as NaN."""
        regions = [Region(**dict({k: v for k, v in r.items() if k != "need_bytes"}, columns=tuple(r["columns"])))
                   for r in d["regions"]]
        times = {f.name: math.nan for f in fields(cls) if f.type is float and d.get(f.name) is None}
        return cls(**dict(d, regions=regions, **times))


def place(model, *, micro_batch_size, micro_batches, seq_len=None, n_states=2, hw=None):
    """The ``Placement`` of ``model`` for steps of ``micro_batches`` micro-batches of
    ``micro_batch_size`` samples (``seq_len`` tokens each), with ``n_states`` optimizer states
    (``hw``: ``Hardware.for_model(model)`` when not given)."""
    hw = hw or Hardware.for_model(model)
    units = model.units
    S = len(units)
    width, height = hw.program_width, hw.program_height
    pes_total = width * height
    per_pe = int(hw.pe_memory_bytes * hw.pe_memory_usable)
    bpp = bytes_per_param(n_states, hw)
    params = [sum(int(np.prod(model.param_specs[n].shape)) for n in names) for names in model.unit_params]
    weight = [p * bpp for p in params]
    in_flight = [min(micro_batches, S - i) for i in range(S)]
    act = [hw.bytes_per_value * in_flight[i] * unit_activation_floats(model, u, micro_batch_size, seq_len)
           for i, u in enumerate(units)]
    floor = [max(1, math.ceil((w + a) / per_pe)) for w, a in zip(weight, act)]
    full = [sum(unit_seconds(unit_work(u, micro_batch_size, seq_len), hw).values()) for u in units]
    need, capacity = sum(weight) + sum(act), hw.usable_sram_bytes
    if sum(floor) > pes_total:
        regions = [Region(u.name, p, f, (0, 0), math.nan, w, a, f * per_pe)
                   for u, p, f, w, a in zip(units, params, floor, weight, act)]
        worst = max(regions, key=lambda r: r.need_bytes)
        return Placement(False, regions, need, capacity, micro_batches, micro_batch_size, why=(
            f"does not fit one wafer: needs {need / 1e9:.1f} GB ({sum(weight) / 1e9:.1f} GB of parameters with "
            f"their training state, {sum(act) / 1e9:.1f} GB of activations in flight) of its {capacity / 1e9:.1f} "
            f"GB usable SRAM, {(need - capacity) / 1e9:+.1f} GB; the largest layer, {worst.name}, alone needs "
            f"{worst.need_bytes / 1e9:.2f} GB: use weight streaming"))
    # Columns by work (each stage's time taken as linear in its PEs), then moved one at a time from
    # the fastest stage to the slowest while that shortens the slowest, with each stage timed on
    # its own stripe by the calibrated GEMM model (a small layer runs better on a small region).
    lo, hi = max(full), max(full) * pes_total
    for _ in range(100):  # the largest tau with sum(max(memory PEs, t * PEs / tau)) within the rectangle
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if sum(max(f, math.ceil(t * pes_total / mid)) for f, t in zip(floor, full)) > pes_total \
            else (lo, mid)
    # Whole columns: at least the memory's, and two (the GEMM model keeps column 0 for the inputs' edge).
    min_cols = [max(2, math.ceil(f / height)) for f in floor]
    if sum(min_cols) > width:
        return Placement(False, [], need, capacity, micro_batches, micro_batch_size, why=(
            f"does not fit one wafer: its {S} layers need {sum(min_cols)} of the {width} columns for their memory"))
    cols = _columns([max(f, math.ceil(t * pes_total / hi)) for f, t in zip(floor, full)], min_cols, width, height)
    stage = [_stage_seconds(u, c, micro_batch_size, seq_len, hw) for u, c in zip(units, cols)]
    for _ in range(4 * width):
        i = int(np.argmax(stage))
        donors = [j for j in range(S) if j != i and cols[j] > min_cols[j]]
        if not donors:
            break
        j = min(donors, key=lambda k: _stage_seconds(units[k], cols[k] - 1, micro_batch_size, seq_len, hw))
        ti, tj = (_stage_seconds(units[i], cols[i] + 1, micro_batch_size, seq_len, hw),
                  _stage_seconds(units[j], cols[j] - 1, micro_batch_size, seq_len, hw))
        if max(ti, tj) >= stage[i]:
            break
        cols[i], cols[j], stage[i], stage[j] = cols[i] + 1, cols[j] - 1, ti, tj
    edges = np.concatenate([[0], np.cumsum(cols)]).tolist()
    regions = [Region(u.name, p, c * height, (edges[k], edges[k + 1]), stage[k], w, a, c * height * per_pe)
               for k, (u, p, c, w, a) in enumerate(zip(units, params, cols, weight, act))]
    slowest = max(r.stage_s for r in regions)
    update = max(r.params / r.pes * UPDATE_OPS_PER_PARAM / hw.fmac_lanes for r in regions) / hw.clock_hz
    example_bytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in model.example_layout(1, seq_len))
    feed = micro_batches * micro_batch_size * example_bytes / hw.io_bytes_per_s
    step = max((micro_batches + S - 1) * slowest, feed) + update
    return Placement(True, regions, need, capacity, micro_batches, micro_batch_size, step_s=step,
                     samples_per_s=micro_batches * micro_batch_size / step, slowest_stage_s=slowest, update_s=update,
                     why=f"fits one wafer: {need / 1e9:.2f} GB of its {capacity / 1e9:.1f} GB usable SRAM",
                     detail={"stages": S, "feed_s": feed, "bytes_per_param": bpp, "precision": hw.precision})


def _columns(pes, min_cols, width, height):
    """Columns of each unit's stripe: about pes / height, at least ``min_cols``, width in all."""
    cols = [max(m, round(p / height)) for p, m in zip(pes, min_cols)]
    while sum(cols) > width:  # take back from the widest that can spare one
        spare = [c - m for c, m in zip(cols, min_cols)]
        cols[int(np.argmax(spare))] -= 1
    while sum(cols) < width:
        cols[int(np.argmax([p / c for p, c in zip(pes, cols)]))] += 1
    return cols


def _stage_seconds(unit, columns, micro_batch_size, seq_len, hw):
    """Forward + backward of one micro-batch on a stripe of ``columns`` of the program rectangle."""
    return sum(unit_seconds(unit_work(unit, micro_batch_size, seq_len), replace(hw, program_width=columns)).values())


def choose(model, *, batch_size, micro_batch_size, seq_len=None, n_states=2, hw=None):
    """("pipeline" | "weight_streaming", one line saying why) for one CS-2: pipelined when the
    model fits the wafer and the model says its step is faster."""
    from wse_core.perf.step import walk_step

    hw = hw or Hardware.for_model(model)
    p = place(model, micro_batch_size=micro_batch_size, micro_batches=share(batch_size, micro_batch_size),
              seq_len=seq_len, n_states=n_states, hw=hw)
    ws = walk_step(model, num_csx=1, samples_per_csx=batch_size, micro_batch_size=micro_batch_size,
                   seq_len=seq_len, hw=hw)
    if not p.fits:
        return "weight_streaming", f"weight streaming: the model {p.why.split(': use')[0]}", p, ws
    if p.step_s < ws.step_s:
        return "pipeline", (f"pipelined: the model fits ({p.need_bytes / 1e9:.2f} of {p.capacity_bytes / 1e9:.1f} GB) "
                            f"and its step is {p.step_s * 1e3:.3g} ms against {ws.step_s * 1e3:.3g} ms streaming "
                            f"the weights"), p, ws
    return "weight_streaming", (f"weight streaming: the model fits, but its pipelined step ({p.step_s * 1e3:.3g} ms, "
                                f"{len(p.regions)} stages for {p.micro_batches} micro-batches) is slower than "
                                f"streaming ({ws.step_s * 1e3:.3g} ms)"), p, ws
