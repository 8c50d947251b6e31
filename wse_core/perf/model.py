"""Cost functions of the emulated hardware: what a streaming unit's compute, a transfer and a
MemoryX update take, in seconds of the system we emulate (docs/design/time-model.md "Cost functions").

Compute: every GEMM of a unit runs as ``stream_gemm`` maps it, scaled to the wafer: the contraction
(K) split over the program rectangle's rows, the tokens (M) over its columns (column 0 is the edge
where the weights arrive), the output columns (N) in chunks small enough that a PE's tile of X,
one weight row and its partial outputs fit its memory; the cycles are the calibrated formula's
(``calibration``) summed over chunks and token passes, its FMAC term divided by the FMAC lanes and
its fabric terms by the values per wavelet of the precision. Work that is not a weight GEMM
(attention's two activation products, layer norms, softmax, GELU, residuals) runs at the
efficiency of the unit's first weight GEMM (an **assumption**: nothing calibrates it yet).
Backward is the two GEMMs per forward one (dX with the weights streamed again, dW) plus twice the
elementwise work.

Transfers: ``perf.clock.Port``. MemoryX: weight bytes over its update rate. All of it is a model; the constants and their sources are in ``hardware``.
"""
import math
from dataclasses import dataclass

from wse_core.perf.calibration import GEMM_COEF
from wse_core.perf.hardware import Hardware

#: Elementwise operations per activation element of a GPT-2 block, forward (two layer norms of ~8,
#: GELU ~8, two residual adds, biases): an **assumption** from the layer code, not calibrated.
ELEMENTWISE_PER_TOKEN_HIDDEN = 24
ELEMENTWISE_PER_TOKEN_FILTER = 10
#: Softmax (max, subtract, exp, sum, divide) and the causal mask, per attention score.
ELEMENTWISE_PER_SCORE = 6


def gemm_cycles(M, K, N, hw=None, coef=GEMM_COEF):
    """PE cycles of Y[M, N] = X[M, K] W[K, N] with W streaming in, on ``hw``'s program rectangle."""
    hw = hw or Hardware()
    a1, a2, b, c, d = coef
    rows = min(hw.program_height, K)
    kb = math.ceil(K / rows)
    rows = math.ceil(K / kb)
    values = hw.pe_memory_bytes // hw.bytes_per_value
    cols = min(hw.program_width - 1, M)
    # Tokens per PE: as many as leave room for 64 output columns (the tile of X, a weight row and
    # the partial outputs: mb kb + n + 2 mb n values); more tokens run as further passes.
    mb = max(1, min(math.ceil(M / cols), (values - 64) // (kb + 128)))
    passes = math.ceil(M / (cols * mb))
    cols = math.ceil(M / (passes * mb)) if passes == 1 else cols
    n = max(1, min(N, (values - mb * kb) // (1 + 2 * mb)))
    chunks = math.ceil(N / n)
    per_chunk = (a1 * kb * n * mb / hw.fmac_lanes + (a2 * kb * n + b * mb * n) / hw.values_per_wavelet
                 + c * (cols + 1 + rows) + d)
    return passes * chunks * per_chunk


def gemm_seconds(M, K, N, hw=None):
    hw = hw or Hardware()
    return gemm_cycles(M, K, N, hw) / hw.clock_hz


@dataclass
class UnitWork:
    """What a streaming unit computes for a batch: its weight GEMMs (M, K, N) and other work."""
    gemms: list            # forward weight GEMMs
    other_macs: int = 0    # multiply-adds that are not weight GEMMs (attention's activation products)
    elementwise: int = 0   # other element operations, forward


def unit_work(unit, samples, seq_len=None):
    """The work of one of ``wse_core.nn``'s units for ``samples`` samples of ``seq_len`` tokens; a unit
    that knows its own work (a compiled PyTorch unit: ``wse_core.compiler.model``) says it."""
    if hasattr(unit, "work"):
        return unit.work(samples, seq_len)
    from wse_core.nn.layers import Dense, Embedding, LMHead, TransformerBlock
    from wse_core.nn.llama import LlamaBlock, RMSHead

    if isinstance(unit, Dense):
        return UnitWork([(samples, unit.in_features, unit.out_features)], elementwise=2 * samples * unit.out_features)
    tokens = samples * seq_len
    if isinstance(unit, Embedding):
        return UnitWork([], elementwise=2 * tokens * unit.hidden)
    if isinstance(unit, (LMHead, RMSHead)):
        return UnitWork([(tokens, unit.hidden, unit.vocab_size)],
                        elementwise=tokens * (8 * unit.hidden + 4 * unit.vocab_size))
    if isinstance(unit, TransformerBlock):
        h, f = unit.hidden, unit.filter
        scores = samples * unit.heads * seq_len * seq_len
        return UnitWork([(tokens, h, 3 * h), (tokens, h, h), (tokens, h, f), (tokens, f, h)],
                        other_macs=2 * scores * unit.head_dim,
                        elementwise=tokens * (ELEMENTWISE_PER_TOKEN_HIDDEN * h + ELEMENTWISE_PER_TOKEN_FILTER * f)
                        + ELEMENTWISE_PER_SCORE * scores)
    if isinstance(unit, LlamaBlock):  # per-element counts: the GPT block's (an assumption, not fitted here)
        h, f, kv = unit.hidden, unit.filter, unit.kv_heads * unit.head_dim
        scores = samples * unit.heads * seq_len * seq_len
        return UnitWork([(tokens, h, h), (tokens, h, kv), (tokens, h, kv), (tokens, h, h), (tokens, h, f),
                         (tokens, h, f), (tokens, f, h)], other_macs=2 * scores * unit.head_dim,
                        elementwise=tokens * (ELEMENTWISE_PER_TOKEN_HIDDEN * h + ELEMENTWISE_PER_TOKEN_FILTER * f)
                        + ELEMENTWISE_PER_SCORE * scores)
    raise TypeError(f"unit_work: no cost model for {type(unit).__name__}")


def unit_seconds(work, hw=None):
    """{"forward": s, "backward": s} of a unit's work on one CS-2's wafer (weights assumed there:
    the stream's own time is the clock's business)."""
    hw = hw or Hardware()
    pes = hw.program_width * hw.program_height
    fwd = sum(gemm_cycles(M, K, N, hw) for M, K, N in work.gemms)
    bwd = sum(gemm_cycles(M, N, K, hw) + gemm_cycles(K, M, N, hw) for M, K, N in work.gemms)
    if work.gemms:
        M, K, N = work.gemms[0]
        efficiency = M * K * N / (gemm_cycles(M, K, N, hw) * pes * hw.fmac_lanes)
    else:
        efficiency = 1.0
    other = work.other_macs / (pes * hw.fmac_lanes * efficiency) + work.elementwise / (pes * hw.fmac_lanes)
    return {"forward": (fwd + other) / hw.clock_hz, "backward": (bwd + 2 * other) / hw.clock_hz}


def memoryx_update_seconds(weight_bytes, hw=None):
    hw = hw or Hardware()
    return weight_bytes / hw.memoryx_update_bytes_per_s
