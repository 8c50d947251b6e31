"""Memory: what each emulated rank holds (host memory of this emulator's processes, what
``wse compile`` prints per rank) and what a CS-2's wafer would hold. See docs/design.md section 8."""
from wse_core.perf.hardware import Hardware


def rank_memory_bytes(plan, model, *, n_states, per_csx, seq_len, micro_batch_size, example_bytes):
    """{rank: bytes} for a rank plan (``mpi_launch.plan.Plan``) of ``model``: MemoryX holds its units'
    weights, gradient sums and ``n_states`` optimizer states; a SwarmX node a unit in flight and one
    partial sum per child; a CS-2 two units of weights (the next streams in while this one
    computes), one unit's gradients and its slice's activations; an input worker its prefetch."""
    unit_bytes = plan.unit_bytes
    biggest = max(unit_bytes)
    memory = {plan.coordinator: 0}
    for k, rank in enumerate(plan.memoryx):
        owned = sum(b for u, b in enumerate(unit_bytes) if plan.unit_owner[u] == k)
        memory[rank] = owned * (2 + n_states)
    for rank in plan.swarmx:
        memory[rank] = biggest * (1 + len(plan.children[rank]))
    for rank in plan.csx:  # a pipelined CS-2 is also the MemoryX: both add up
        memory[rank] = memory.get(rank, 0) + 3 * biggest + 4 * model.activation_floats(per_csx, seq_len)
    for ranks in plan.workers:
        for rank in ranks:
            memory[rank] = 4 * micro_batch_size * example_bytes
    return memory


def wafer_bytes(model, samples, seq_len, hw=None):
    """{"activations", "weights_in_flight", "capacity"}: a CS-2's activations for ``samples`` kept
    from forward to backward, two units of weights streaming through, and the wafer's SRAM."""
    hw = hw or Hardware.for_model(model)
    biggest = max(model.unit_bytes(itemsize=hw.bytes_per_value))
    return {"activations": hw.bytes_per_value * model.activation_floats(samples, seq_len),
            "weights_in_flight": 2 * biggest, "capacity": hw.pes * hw.pe_memory_bytes}
