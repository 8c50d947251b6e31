"""Memory: what each emulated rank holds (host memory of this emulator's processes, what
``wse compile`` prints per rank) and what a CS-2's wafer would hold. See docs/design/time-model.md "Wafer memory"."""
from dataclasses import asdict, dataclass

from wse_core.microbatch import checkpoint_interval
from wse_core.perf.hardware import Hardware


def rank_memory_bytes(plan, model, *, n_states, seq_len, micro_batch_size, example_bytes):
    """{rank: bytes} for a rank plan (``mpi_launch.plan.Plan``) of ``model``: MemoryX holds its units'
    weights, gradient sums and ``n_states`` optimizer states; a SwarmX node a unit in flight and one
    partial sum per child; a CS-2 two units of weights (the next streams in while this one
    computes), one unit's gradients and one micro-batch's activations; an input worker its prefetch."""
    unit_bytes = plan.unit_bytes
    biggest = max(unit_bytes)
    memory = {plan.coordinator: 0}
    for k, rank in enumerate(plan.memoryx):
        owned = sum(b for u, b in enumerate(unit_bytes) if plan.unit_owner[u] == k)
        memory[rank] = owned * (2 + n_states)
    for rank in plan.swarmx:
        memory[rank] = biggest * (1 + len(plan.children[rank]))
    for rank in plan.csx:  # a pipelined CS-2 is also the MemoryX: both add up
        memory[rank] = memory.get(rank, 0) + 3 * biggest + 4 * model.activation_floats(micro_batch_size, seq_len)
    for ranks in plan.workers:
        for rank in ranks:
            memory[rank] = 4 * micro_batch_size * example_bytes
    return memory


def unit_activation_floats(model, unit, samples, seq_len):
    """Floats a unit keeps for its backward per ``samples`` (attention probabilities recomputed): what
    a pipelined stage holds per micro-batch in flight. A unit that knows its own (a compiled PyTorch
    unit) says it."""
    if hasattr(unit, "activation_floats"):
        return unit.activation_floats(samples, seq_len)
    from wse_core.nn.layers import Dense, Embedding, LMHead, TransformerBlock
    from wse_core.nn.llama import LlamaBlock, RMSHead

    if isinstance(unit, Dense):
        return samples * (unit.in_features + unit.out_features)
    t = samples * seq_len
    if isinstance(unit, Embedding):
        return t * unit.hidden
    if isinstance(unit, (LMHead, RMSHead)):
        return t * 2 * unit.hidden
    if isinstance(unit, (TransformerBlock, LlamaBlock)):
        return t * model._block_floats_per_token(unit.hidden, unit.filter)
    raise TypeError(f"no activation model for {type(unit).__name__}")


def unit_output_floats(unit, samples, seq_len):
    """Floats a unit hands the next one for ``samples``: the activations at a unit boundary."""
    if hasattr(unit, "activation_floats"):  # a compiled unit: the values it hands on
        return unit.activation_floats(samples, seq_len)
    from wse_core.nn.layers import Dense

    if isinstance(unit, Dense):
        return samples * unit.out_features
    return samples * seq_len * unit.hidden


@dataclass
class WaferNeed:
    """What one CS-2's wafer holds at once in weight streaming, bytes (docs/design/time-model.md
    "Wafer memory"), against its usable SRAM."""
    micro_batch_size: int
    checkpoints: int            # boundary activations kept from forward to backward
    segment: int                # the boundaries of the segment being recomputed in the backward pass
    weights: int                # two units of weights in flight
    gradients: int              # one unit's gradients on their way out
    capacity: int               # usable SRAM
    interval: int               # units per segment

    @property
    def need(self):
        return self.checkpoints + self.segment + self.weights + self.gradients

    @property
    def fits(self):
        return self.need <= self.capacity

    def to_dict(self):
        return dict(asdict(self), need=self.need, fits=self.fits)


def streaming_wafer(model, micro_batch_size, seq_len=None, hw=None):
    """The ``WaferNeed`` of ``model`` in weight streaming for micro-batches of ``micro_batch_size``:
    one micro-batch's forward and backward at a time; its activations kept only at the input of every
    k-th unit (k = ``checkpoint_interval``), each segment's forward recomputed from its checkpoint in
    the backward pass (holding that segment's boundaries); a unit's inner values (attention scores,
    the filter-wide values of its MLP) formed chunk by chunk, as the GEMM mapping forms them
    (``perf.model``), never whole. Both are **assumptions** (nothing public says how the wafer keeps
    activations), made because Cerebras' published micro-batch sizes need them: GPT-3 13B runs at 90
    (Model Zoo's config) to 99 (Cerebras' table) sequences of 2,048 per CS-2, and every layer's input
    alone would take 83 GB of the wafer's 44."""
    hw = hw or Hardware.for_model(model)
    units = model.units
    k = checkpoint_interval(len(units))
    # boundary[u]: unit u's input (unit 0's, the data, is the input path's)
    boundary = [0] + [hw.bytes_per_value * unit_output_floats(u, micro_batch_size, seq_len) for u in units[:-1]]
    kept = sum(boundary[u] for u in range(k, len(units), k))
    segment = max(sum(boundary[lo:lo + k]) for lo in range(0, len(units), k))
    biggest = max(model.unit_bytes(itemsize=hw.bytes_per_value))
    return WaferNeed(micro_batch_size, kept, segment, 2 * biggest, biggest, hw.usable_sram_bytes, k)


def largest_micro_batch(model, sizes, seq_len=None, hw=None):
    """The largest of ``sizes`` whose ``streaming_wafer`` fits, or None."""
    fitting = [b for b in sizes if streaming_wafer(model, b, seq_len, hw).fits]
    return max(fitting) if fitting else None
