"""Serving a language model on the emulated hardware: time to first token, time per output token and
tokens/s per user and for the batch (docs/design/time-model.md "Inference latency"). A model, like
the rest of ``perf``; the tokens themselves come from ``wse_core.nn.generate``.

Memory. A sequence's KV cache holds 2 x layers x kv heads x head size x positions values (the
prompt's and the new tokens', all counted from the start); it stays on the wafer, in the usable
SRAM (``pe_memory_usable`` of every PE of the program rectangle, as pipelined training counts
it). Activations of a decode step (a vector per sequence) are left out: small beside the caches
(**assumption** for prefill, whose prompt-long activations are not counted either).

Two placements:

* **Resident**, when the weights and every sequence's cache fit the ``num_csx`` wafers: each unit
  (the embedding, each block, the head) keeps its weights and its caches on a region of PEs sized
  by those bytes, the units in order over the wafers (``step.balance`` by bytes), a token running
  through the regions in turn: pipelined across layers, as Cerebras serves models. A unit that
  shares a tied table with another holds its own copy (**assumption**: the regions are apart).
* **Streamed**, when they do not: MemoryX streams every unit's weights to each CS-2 for every
  decode step, through the SwarmX tree and the CS-2's I/O as training's weight streaming does
  (``perf.clock.Port``; a CS-2 accepts a unit's weights once the unit before it starts),
  each CS-2 decoding its share of the batch with only its caches and two units of weights on the
  wafer. Bound by the stream: every step moves all the weights, whatever the batch.

Decode on a resident region. Each weight product of the unit's ``unit_work`` for m sequences,
Y[m, N] = X[m, K] W[K, N], runs as ``fabric.programs.gemv`` does on a W x H region, W's tiles
resident (b = ceil(N / H) rows, c = ceil(K / W) columns a PE): x's tiles reach their columns as
``broadcast`` carries them over W + H hops (from column 0, where the product before left its
result: **assumption**, the turn from a column to the rows counted as hops), then the calibrated
``gemv`` cycles, its FMAC and reduce terms paid once per sequence (**assumption**: the program
runs one vector; m vectors run through the same tiles one after another). FMAC terms are divided
by the FMAC lanes and fabric terms by the values per wavelet, as ``model.gemm_cycles`` does. Each
product has its own broadcast (q, k and v too: a layout that fused them would share one).
Attention over the cache is two GEMVs a kv head with the cache as the matrix: each kv head's keys
and values on a band of H / kv heads rows (positions over its rows, the head size over its
columns), the band's query vectors (group x m: a kv head serves ``group`` query heads) through
them as for the weights: scores = K q as ``gemv`` (with q's broadcast), the softmax's maximum and
sum an ``allreduce`` of 2 values a vector over the band's column 0, and out = V^T p as ``gemv``
turned a quarter (the sum runs down the band's rows, **assumption**: the formula with W and H
swapped). A block's two norms, and the head's norm and argmax, are each an allreduce of 2 values
a sequence over the region; other elementwise work (the softmax's exponentials with it) runs at
the lanes' rate. A region gets PEs in proportion to its bytes, then halved while that shortens its
decode step (fewer FMACs a PE against more hops), never below what its bytes need; regions are
near-square blocks of their PE count (**assumption**: how they tile the rectangle is not
modelled). The next token goes back to the embedding across the wafer (program
width + height hops); between wafers a hop of ``swarmx_hop_latency_s`` and the activations over
the CS-2's I/O (**assumption**: wafers chained through one switch).

Batching. B sequences decode as g micro-batches of m = ceil(B / g) sequences, g at most the number
of stages: a sequence's token passes every stage in turn (the latency, the sum of the stages), and
a stage serves g micro-batches per token, so a token takes max(latency, g x the slowest stage),
with the m that makes it shortest. Up to a micro-batch per stage the batch rides in the pipeline's
idle stages for free; beyond, stages take more sequences at once, and the fixed part of each
product (hops, start-up) is shared.

Prefill: the prompt's forward pass by training's cost model (``model.unit_seconds``), the head
computing the last position only (as ``LanguageModel.infer`` does): on each region (resident, the
whole prompt as one micro-batch) or on the whole wafer with the weights streamed (streamed). Time
to first token is that of a prompt that arrives alone. Resident, it is an upper bound: training's
GEMM pays the receive of each weight row (``GEMM_COEF``'s a2), which resident weights do not.
Time per output token is taken at the mean cache length, prompt + new / 2 (attention's work grows
linearly with it).
"""
import math
from dataclasses import asdict, dataclass, field, replace

from wse_core.checks import plural
from wse_core.errors import ConfigError, PlanError
from wse_core.microbatch import share
from wse_core.perf.calibration import ALLREDUCE_COEF, BROADCAST_COEF, GEMV_COEF
from wse_core.perf.clock import Port
from wse_core.perf.hardware import Hardware
from wse_core.perf.model import ELEMENTWISE_PER_SCORE, unit_seconds, unit_work
from wse_core.perf.step import CHUNK_VALUES, balance, tree_depth


@dataclass
class Latency:
    """What serving a batch takes on the emulated hardware (seconds, bytes); ``why``: one line."""
    placement: str               # "resident" or "streamed"
    batch: int
    prompt_tokens: int
    new_tokens: int
    num_csx: int
    ttft_s: float                # time to first token: a prompt's prefill, arriving alone
    tpot_s: float                # time per output token of every sequence of the batch
    tokens_per_s_user: float
    tokens_per_s_batch: float
    weight_bytes: int            # what the placement keeps on the wafers (resident) or streams per step
    kv_bytes_per_sequence: int
    capacity_bytes: int          # usable SRAM of the wafers
    max_batch: dict              # sequences of these positions that fit each placement
    why: str
    detail: dict = field(default_factory=dict)

    def to_dict(self):
        return asdict(self)


def kv_bytes_per_sequence(model, positions, hw):
    """2 x layers x kv heads x head size x positions x bytes: one sequence's KV cache."""
    return sum(unit_kv_bytes(u, positions, hw) for u in model.units)


def unit_kv_bytes(unit, positions, hw):
    """One sequence's keys and values of ``positions`` positions in an attention unit (0 in others)."""
    if not hasattr(unit, "heads"):
        return 0
    return 2 * getattr(unit, "kv_heads", unit.heads) * unit.head_dim * positions * hw.bytes_per_value


def decode_work(unit, sequences, cache_len):
    """A unit's ``UnitWork`` for one decode step of ``sequences`` sequences whose caches hold
    ``cache_len`` positions: training's for one token each, but attention over the cache."""
    work = unit_work(unit, sequences, 1)
    if hasattr(unit, "heads"):
        work.other_macs = 2 * sequences * unit.heads * cache_len * unit.head_dim
        work.elementwise += ELEMENTWISE_PER_SCORE * sequences * unit.heads * (cache_len - 1)
    return work


def region_decode_cycles(unit, sequences, cache_len, width, height, hw):
    """PE cycles of a decode step of ``sequences`` sequences on a ``width`` x ``height`` region holding
    the unit's weights and caches (the module's docstring says how)."""
    work = decode_work(unit, sequences, cache_len)
    cycles = work.elementwise / (width * height * hw.fmac_lanes)
    for M, K, N in work.gemms:
        cycles += _broadcast(M * math.ceil(K / width), width + height, hw)
        cycles += _gemv(M, math.ceil(N / height), math.ceil(K / width), width, height, hw)
    if hasattr(unit, "heads"):
        kv_heads = getattr(unit, "kv_heads", unit.heads)
        band = max(1, height // kv_heads)
        rounds = math.ceil(kv_heads / height)   # more kv heads than rows: a band holds several in turn
        v = sequences * unit.heads // kv_heads  # query vectors a kv head serves
        positions, d = math.ceil(cache_len / band), math.ceil(unit.head_dim / width)
        cycles += rounds * (_broadcast(v * d, width + band, hw) + _gemv(v, positions, d, width, band, hw)
                            + _allreduce(2 * v, 1, band, hw) + _gemv(v, d, positions, band, width, hw))
    if work.gemms:  # a block's two norms; the head's norm and argmax
        cycles += 2 * _allreduce(2 * sequences, width, height, hw)
    return cycles


def _gemv(vectors, b, c, width, height, hw):
    """``gemv``'s calibrated cycles for ``vectors`` vectors through [b, c] tiles on width x height PEs:
    its FMAC and reduce terms once a vector, FMACs on the lanes, reduced values by the wavelet."""
    p1, p2, p3, p4, p5 = GEMV_COEF
    return p1 * vectors * b * c / hw.fmac_lanes + p2 * vectors * b / hw.values_per_wavelet + p3 * width \
        + p4 * height + p5


def _broadcast(values, hops, hw):
    q1, q2, q3 = BROADCAST_COEF
    return q1 * math.ceil(values / hw.values_per_wavelet) + q2 * hops + q3


def _allreduce(values, width, height, hw):
    e, f, g = ALLREDUCE_COEF
    return e * math.ceil(values / hw.values_per_wavelet) + f * (width + height) + g


def _shape(pes, hw):
    """A near-square region of ``pes`` PEs within the program rectangle, at least 2 columns wide
    (the GEMM model keeps column 0 for its inputs' edge)."""
    w = min(hw.program_width, max(2, math.isqrt(pes)))
    return w, min(hw.program_height, max(1, -(-pes // w)))  # rounded up: never fewer PEs than asked


def _region(unit, floor, share, sequences, cache_len, hw):
    """The shape of a unit's region: at least the ``floor`` PEs its bytes need, at most its ``share``
    of the wafer, halving from the share while that shortens its decode step (a larger region has
    less to multiply a PE but more hops to cross)."""
    best, pes = None, max(share, floor)
    while True:
        shape = _shape(max(4, pes), hw)
        cycles = region_decode_cycles(unit, sequences, cache_len, *shape, hw)
        if best is not None and cycles >= best[0]:
            return best[1]
        best = (cycles, shape)
        if pes <= floor:
            return shape
        pes = max(floor, pes // 2)


def _check(model, batch, prompt_tokens, new_tokens):
    if not getattr(model, "is_lm", False):
        raise ConfigError(f"inference: model {model.config.get('name')} is not a language model: it generates no "
                          "tokens")
    for name, value in (("batch", batch), ("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}: expected a whole number >= 1, got {value!r}")
    most = model.config["max_position_embeddings"]
    if prompt_tokens + new_tokens > most:
        raise ConfigError(f"prompt_tokens {prompt_tokens} + new_tokens {new_tokens}: {prompt_tokens + new_tokens} "
                          f"positions exceed the model's {most} (model.max_position_embeddings)")


def serve(model, *, batch, prompt_tokens, new_tokens, num_csx=1, hw=None, placement=None):
    """The ``Latency`` of ``batch`` sequences of ``prompt_tokens`` + ``new_tokens`` positions of ``model``
    (a ``wse_core.nn`` language model) on ``num_csx`` CS-2s. ``placement``: "resident" when the
    weights and caches fit, else "streamed" (None); or either, forced. A batch that no placement
    holds is refused in one line saying how many sequences fit."""
    hw = hw or Hardware.for_model(model)
    _check(model, batch, prompt_tokens, new_tokens)
    positions = prompt_tokens + new_tokens
    kv = kv_bytes_per_sequence(model, positions, hw)
    weights = model.stream_bytes(hw.bytes_per_value)
    unit_kv = [unit_kv_bytes(u, positions, hw) for u in model.units]
    capacity = hw.program_width * hw.program_height * hw.pe_memory_bytes * hw.pe_memory_usable
    fits = {"resident": lambda b: _resident_groups(weights, unit_kv, b, num_csx, capacity) is not None,
            "streamed": lambda b: kv * share(b, num_csx) + 2 * max(weights) <= capacity}
    most = {name: _most(fit) for name, fit in fits.items()}
    where = plural(num_csx, "CS-2")
    total = sum(weights) + batch * kv
    if placement is None:
        placement = "resident" if fits["resident"](batch) else "streamed"
        because = (f"they and the KV caches take {total / 1e9:.3g} GB of the {num_csx * capacity / 1e9:.3g} GB of "
                   f"usable SRAM of {where}") if placement == "resident" else \
            (f"they and the KV caches need {total / 1e9:.3g} GB, more than the {num_csx * capacity / 1e9:.3g} GB of "
             f"usable SRAM of {where}")
    elif placement == "resident" and num_csx > len(model.units):
        raise PlanError(f"placement resident: {num_csx} CS-2s for the model's {len(model.units)} units; each wafer "
                        f"holds at least one: use at most {len(model.units)} CS-2s, or stream the weights")
    elif placement in fits:
        because = f"placement {placement}"
    else:
        raise ConfigError(f"placement: expected resident or streamed, got {placement!r}")
    if not fits[placement](batch):
        raise PlanError(_refusal(placement, batch, positions, kv, sum(weights), max(weights), num_csx * capacity,
                                  where, most))
    cache_len = prompt_tokens + new_tokens / 2
    run = _resident if placement == "resident" else _streamed
    ttft, tpot, how, detail = run(model, weights, unit_kv, batch, prompt_tokens, cache_len, num_csx, capacity, hw)
    why = f"weights {placement} {how} ({because})"
    return Latency(placement, batch, prompt_tokens, new_tokens, num_csx, ttft, tpot, 1 / tpot, batch / tpot,
                   sum(weights), kv, int(num_csx * capacity), most, why,
                   dict(detail, precision=hw.precision, mean_cache_len=cache_len,
                        request_s=ttft + (new_tokens - 1) * tpot))


def _most(fits, limit=1 << 24):
    """The largest batch ``fits`` accepts (0 when none)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _resident_groups(weights, unit_kv, batch, num_csx, capacity):
    """The wafer of each unit, the units in order balanced by bytes, or None when a wafer overflows."""
    need = [w + batch * k for w, k in zip(weights, unit_kv)]
    if num_csx > len(need):
        return None
    owner = balance(need, num_csx)
    per_wafer = [sum(n for n, o in zip(need, owner) if o == k) for k in range(num_csx)]
    return owner if max(per_wafer) <= capacity else None


def _refusal(placement, batch, positions, kv, weights, biggest, capacity, where, most):
    if placement == "resident" and most["resident"] == 0:
        return (f"placement resident: the weights alone need {weights / 1e9:.3g} GB, more than the "
                f"{capacity / 1e9:.3g} GB of usable SRAM of {where}: stream them or add CS-2s")
    held = f"beside the weights resident on {where}" if placement == "resident" else \
        f"beside the two units of weights streaming through each CS-2 ({2 * biggest / 1e9:.3g} GB) on {where}"
    return (f"batch {batch}: {batch} sequences of {positions} positions need {batch * kv / 1e9:.3g} GB of KV cache "
            f"({kv / 1e6:.3g} MB each); {most[placement]} fit {held}")


def _resident(model, weights, unit_kv, batch, prompt_tokens, cache_len, num_csx, capacity, hw):
    units = model.units
    owner = _resident_groups(weights, unit_kv, batch, num_csx, capacity)
    need = [w + batch * k for w, k in zip(weights, unit_kv)]
    pes = hw.program_width * hw.program_height
    per_pe = hw.pe_memory_bytes * hw.pe_memory_usable
    smallest = math.ceil(batch / min(batch, len(units)))  # the micro-batch that fills every stage
    shapes = []
    for k in range(num_csx):
        mine = sum(n for n, o in zip(need, owner) if o == k)
        shapes += [_region(u, math.ceil(n / per_pe), int(pes * n / mine), smallest, cache_len, hw)
                   for u, n, o in zip(units, need, owner) if o == k]
    hidden_bytes = model.config["hidden_size"] * hw.bytes_per_value
    hop = hw.swarmx_hop_latency_s
    crossings = [u for u in range(1, len(units)) if owner[u] != owner[u - 1]]
    # The next token back to the embedding: across the wafer, or over a hop from the last wafer.
    back = hop if num_csx > 1 else BROADCAST_COEF[1] * (hw.program_width + hw.program_height) / hw.clock_hz

    def stages(m):
        t = [region_decode_cycles(u, m, cache_len, w, h, hw) / hw.clock_hz for u, (w, h) in zip(units, shapes)]
        return t + [hop + m * hidden_bytes / hw.io_bytes_per_s for _ in crossings]

    best = None
    for m in sorted({math.ceil(batch / g) for g in range(1, min(batch, len(units)) + 1)}):
        g = math.ceil(batch / m)
        t = stages(m)
        latency = sum(t) + back
        period = max(latency, g * max(t))
        if best is None or period < best[0]:
            best = (period, m, g, latency, max(t))
    tpot, m, g, latency, slowest = best
    last = len(units) - 1
    prefill = [unit_seconds(unit_work(u, 1, 1 if i == last else prompt_tokens),
                            replace(hw, program_width=w, program_height=h))["forward"]
               for i, (u, (w, h)) in enumerate(zip(units, shapes))]
    ttft = sum(prefill) + len(crossings) * (hop + prompt_tokens * hidden_bytes / hw.io_bytes_per_s)
    how = f"on {plural(num_csx, 'CS-2')}, pipelined across layers"
    return ttft, tpot, how, {"wafers": owner, "micro_batch": m, "micro_batches": g,
                             "stages": len(units) + len(crossings),
                             "latency_s": latency, "slowest_stage_s": slowest, "prefill_s": prefill,
                             "regions": shapes}


def _streamed(model, weights, unit_kv, batch, prompt_tokens, cache_len, num_csx, capacity, hw):
    units = model.units
    per_csx = share(batch, num_csx)
    last = len(units) - 1
    decode = [unit_seconds(decode_work(u, per_csx, cache_len), hw)["forward"] for u in units]
    prefill = [unit_seconds(unit_work(u, 1, 1 if i == last else prompt_tokens), hw)["forward"]
               for i, u in enumerate(units)]
    tpot = _stream_passes(weights, decode, num_csx, hw, passes=3)
    ttft = _stream_passes(weights, prefill, num_csx, hw, passes=1)
    rate = min(hw.memoryx_gbps, hw.swarmx_port_gbps * hw.swarmx_ports_per_child, hw.io_gbps) / 8
    how = f"from MemoryX each decode step, {sum(weights) / 1e9:.3g} GB at {rate:g} GB/s"
    return ttft, tpot, how, {"sequences_per_csx": per_csx, "compute_s": sum(decode),
                             "stream_s": sum(weights) / (rate * 1e9), "prefill_compute_s": sum(prefill)}


def _stream_passes(nbytes, compute, num_csx, hw, passes):
    """Duration of the last of ``passes`` forward passes back to back, every unit's weights carried from
    MemoryX through the SwarmX tree and the CS-2's I/O (``perf.clock.Port``, as ``step.walk_step``
    carries them), a unit's weights accepted once the unit before it has started (two units on the
    wafer: the one computing and the next)."""
    depth = tree_depth(num_csx, hw.swarmx_fanout)
    link = min(hw.swarmx_port_gbps * hw.swarmx_ports_per_child, hw.io_gbps)
    port = dict(latency_s=hw.swarmx_hop_latency_s, chunk_bytes=CHUNK_VALUES * hw.bytes_per_value)
    path = [Port(hw.memoryx_gbps, **port), *(Port(link, **port) for _ in range(depth - 1))]
    csx = Port(hw.io_gbps, **port)
    t = accept = 0.0
    ends = [0.0]
    for _ in range(passes):
        for b, c in zip(nbytes, compute):
            header = (0.0, None)
            for p in path:
                header, _ = p.carry(b, header)
            arrive = csx.carry(b, header, accept)[1]
            begin = max(t, arrive)
            accept, t = begin, begin + c
        ends.append(t)
    return ends[-1] - ends[-2]
