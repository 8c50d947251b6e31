"""A run resolved once: the facts every floor derives from a validated spec (docs/design.md section 3).

``resolve(spec)`` builds the model, lays out the rank plan, chooses the execution strategy (refusing a
micro-batch that does not fit a wafer: the wafer-fit rule, ``check_wafer``, lives here alone) and
deals the batch to micro-batches (``wse_core.microbatch.MicroBatches``). The launcher resolves a run
once and writes ``ResolvedRun.to_json()`` into run.json; each rank reads it back
(``ResolvedRun.from_json``), building only its own model, so the ranks obey the launcher's plan
instead of deriving their own. `wse compile` (``describe``), the host-memory check and the appliance
read the same object.
"""
import functools
import math
import os
from dataclasses import asdict, dataclass

import numpy as np

from mpi_launch.plan import RankPlan, make_plan
from mpi_launch.spec import RunSpec
from wse_core.errors import PlanError
from wse_core.microbatch import MicroBatches, share
from wse_core.models import build_model
from wse_core.nn import Model
from wse_core.perf import Hardware
from wse_core.perf.memory import largest_micro_batch, rank_memory_bytes, streaming_wafer
from wse_core.perf.pipeline import Placement, choose
from wse_core.perf.step import walk_step


@dataclass(frozen=True)
class ResolvedRun:
    """A validated spec and what follows from it: its model (built once in a process), rank plan,
    execution strategy with the line that says why, the pipelined placement the strategy weighed
    (its times are a pipelined run's clock) and the step's micro-batches."""
    spec: RunSpec
    model: Model
    plan: RankPlan
    strategy: str
    why: str
    placement: Placement
    batches: MicroBatches

    @functools.cached_property
    def hardware(self):
        """The hardware the run is timed on (``runconfig.hardware`` at the model's precision)."""
        return Hardware.for_model(self.model, self.spec.runconfig.hardware)

    @property
    def seq_len(self):
        return self.spec.model.get("max_position_embeddings")

    def to_json(self):
        """What run.json keeps of it, as JSON gives it back (the spec is beside it, under "params"; the
        model is rebuilt): lists for tuples, and null for the times of a placement that does not fit
        (NaN, which strict JSON has no word for)."""
        return _as_json({"plan": self.plan.to_json(), "strategy": self.strategy, "why": self.why,
                         "placement": self.placement.to_dict(), "micro_batches": asdict(self.batches)})

    @classmethod
    def from_json(cls, d, spec, model=None):
        """The run the launcher resolved (``to_json``), with ``model`` (built from the spec if not given)."""
        model = build_model(spec.model) if model is None else model
        return cls(spec, model, RankPlan.from_json(d["plan"]), d["strategy"], d["why"],
                   Placement.from_dict(d["placement"]), MicroBatches(**d["micro_batches"]))


def _as_json(x):
    if isinstance(x, dict):
        return {k: _as_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_as_json(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def resolve(spec, model=None):
    """The ``ResolvedRun`` of a validated ``spec`` (``mpi_launch.spec.RunSpec``); ``model``: the spec's
    model when the caller built it already (params validation does)."""
    model = build_model(spec.model) if model is None else model
    r, t = spec.runconfig, spec.train_input
    chosen, why, placement = _strategy(spec, model)
    plan = make_plan(num_csx=r.num_csx, num_wgt_servers=r.num_wgt_servers, num_workers_per_csx=r.num_workers_per_csx,
                     swarmx_fanout=r.swarmx_fanout, unit_bytes=model.unit_bytes(), pipeline=chosen == "pipeline")
    return ResolvedRun(spec, model, plan, chosen, why, placement, MicroBatches(t.batch_size, t.micro_batch_size,
                                                                              r.num_csx))


def optimizer_states(o):
    """Arrays of optimizer state per parameter (``optimizer`` section): 2 for Adam, 1 or 0 for SGD."""
    from wse_core.optim import make_optimizer

    if o.optimizer_type.lower() == "sgd" and o.momentum == 0:
        return 0
    return len(make_optimizer(o.optimizer_type).init_state(np.zeros(1, np.float32)))


def _strategy(spec, model):
    """(execution strategy, one line saying why, the pipelined Placement): ``runconfig.execution_strategy``,
    with ``auto`` resolved by the model (``wse_core.perf.pipeline.choose``) on one CS-2. Weight
    streaming is refused when a micro-batch does not fit a CS-2's wafer (``check_wafer``), as pipelined
    mode is when the model does not fit."""
    r, t = spec.runconfig, spec.train_input
    hw = Hardware.for_model(model, r.hardware)
    seq = spec.model.get("max_position_embeddings")
    chosen, why, placement, _ = choose(model, batch_size=t.batch_size, micro_batch_size=t.micro_batch_size,
                                       seq_len=seq, n_states=optimizer_states(spec.optimizer), hw=hw)
    if r.execution_strategy == "pipeline" and not placement.fits:
        raise PlanError(f"runconfig.execution_strategy: pipeline: the model {placement.why}")
    if r.execution_strategy != "auto":
        chosen, why = r.execution_strategy, f"{r.execution_strategy} (runconfig.execution_strategy)"
    elif r.num_csx != 1:
        chosen, why = "weight_streaming", f"weight streaming: pipelined runs on one CS-2, this run has {r.num_csx}"
    if chosen == "weight_streaming":
        check_wafer(model, t.batch_size, r.num_csx, t.micro_batch_size, seq, hw)
    return chosen, why, placement


def check_wafer(model, batch_size, num_csx, micro_batch_size, seq_len, hw):
    """The wafer-fit rule: refuse, in one line saying what would fit, a micro-batch whose weight
    streaming does not fit a CS-2's wafer (docs/design/time-model.md "Wafer memory"); ``micro_batch_size``
    None asks for the largest that fits (``micro_batch_size: auto``), refused when not even one sample
    does. The micro-batch size that is taken."""
    w = streaming_wafer(model, micro_batch_size or 1, seq_len, hw)
    if micro_batch_size is not None and w.fits:
        return micro_batch_size
    sizes = MicroBatches.even_sizes(batch_size, num_csx)
    # On a power of two of CS-2s, auto prefers the sizes whose micro-batches are halvings of the batch
    # (MicroBatches.aligned): their bits are every other such size's (docs/design.md section 5, (a)).
    # Another num_csx sums in an order of its own whatever the size: the largest that fits.
    halvings = ([b for b in sizes if MicroBatches(batch_size, b, num_csx).aligned]
                if num_csx & (num_csx - 1) == 0 else [])
    best = largest_micro_batch(model, halvings, seq_len, hw) or largest_micro_batch(model, sizes, seq_len, hw)
    if micro_batch_size is None:
        if best is not None:
            return best
        given, fix = "auto: not even one sample fits", "use more CS-2s or a smaller model"
    else:
        given = f"{micro_batch_size} samples do not fit"
        fix = (f"the largest that fits and deals the {share(batch_size, num_csx)} samples each CS-2 gets evenly is "
               f"{best} (or micro_batch_size: auto)" if best else "not even one sample fits: use more CS-2s or a "
               "smaller model")
    activations, in_flight = (w.checkpoints + w.segment) / 1e9, (w.weights + w.gradients) / 1e9
    raise PlanError(f"train_input.micro_batch_size: {given} a CS-2's wafer in weight streaming: {w.need / 1e9:.1f} GB "
                    f"({activations:.1f} GB of activations, {in_flight:.2f} GB of weights and gradients in flight) "
                    f"of its {w.capacity / 1e9:.1f} GB usable SRAM; {fix}")


def explore_sizes(run):
    """Every micro-batch size that deals the batch evenly, with its wafer need and simulated samples/s
    (``micro_batch_size: explore``)."""
    r, t = run.spec.runconfig, run.spec.train_input
    hw, seq = run.hardware, run.seq_len
    rows = []
    for b in MicroBatches.even_sizes(t.batch_size, r.num_csx):
        w = streaming_wafer(run.model, b, seq, hw)
        sim = walk_step(run.model, num_csx=r.num_csx, samples_per_csx=run.batches.per_csx, micro_batch_size=b,
                        seq_len=seq, num_wgt_servers=r.num_wgt_servers, swarmx_fanout=r.swarmx_fanout, hw=hw,
                        batch_size=t.batch_size) if w.fits else None
        rows.append({"micro_batch_size": b, "need_bytes": w.need, "fits": w.fits,
                     "samples_per_s": sim.samples_per_s if sim else None, "chosen": b == t.micro_batch_size})
    return rows


def rank_memory(run):
    """{rank: bytes} of host memory each rank of the run's plan holds (``perf.memory.rank_memory_bytes``)."""
    example = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
                  for shape, dtype in run.model.example_layout(1, run.seq_len))
    return rank_memory_bytes(run.plan, run.model, n_states=optimizer_states(run.spec.optimizer),
                             seq_len=run.seq_len, micro_batch_size=run.batches.size, example_bytes=example)


def check_host_memory(run, *, hostfile=None, total=None):
    """Refuse, in one line, a run whose ranks would hold more than this machine's memory (``total``
    bytes; default: its physical memory) when they all run here (no hostfile): they would each die of
    a MemoryError once started (a batch of 2^20 samples took its micro-batch as the wafer's largest,
    415 GB of activations a CS-2 rank)."""
    if hostfile is not None:
        return
    total = total or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    memory = rank_memory(run)
    need = sum(memory.values())
    if need <= total:
        return
    rank = max(memory, key=memory.get)
    role, index = run.plan.role_of(rank)
    by_batch = role in ("csx", "worker")  # what the largest rank holds grows with the micro-batch, else the model
    what = f"train_input.micro_batch_size: {run.batches.size:,} samples a micro-batch" if by_batch else "model"
    raise PlanError(f"{what}: the ranks would hold {need / 1e9:,.1f} GB (rank {rank}, {role} {index}: "
                    f"{memory[rank] / 1e9:,.1f} GB), more than this machine's {total / 1e9:,.1f} GB; use "
                    f"{'a smaller micro-batch' if by_batch else 'a smaller model'}, or spread the ranks over several "
                    "machines with --hostfile")


def describe(run):
    """The plan of a resolved run, with per-rank memory estimates: what `wse compile` prints and plan.json holds."""
    r, model, hw = run.spec.runconfig, run.model, run.hardware
    memory = rank_memory(run)
    return {
        "plan": run.plan.to_json(),
        "model": {"name": model.config["name"], "parameters": model.num_params(),
                  "units": [u.name for u in model.units], "unit_bytes": run.plan.unit_bytes},
        "memory_bytes": {str(k): int(memory[k]) for k in range(run.plan.world_size)},
        "micro_batches_per_csx": run.batches.rounds,
        "wafer_bytes": streaming_wafer(model, run.batches.size, run.seq_len, hw).to_dict(),
        "simulated": walk_step(model, num_csx=r.num_csx, samples_per_csx=run.batches.per_csx,
                               micro_batch_size=run.batches.size, seq_len=run.seq_len,
                               num_wgt_servers=r.num_wgt_servers, swarmx_fanout=r.swarmx_fanout,
                               hw=hw, batch_size=run.batches.batch_size).to_dict(),
        "bit_identical_to_reference": run.batches.sums_as_one(r.swarmx_fanout),
        "batch_invariant": model.batch_dependent is None and run.batches.sample_tree(r.swarmx_fanout),
        "micro_batch_size": run.batches.size, "batch_dependent": model.batch_dependent,
        "lowering": model.lowering() if hasattr(model, "lowering") else None,
        "execution_strategy": run.strategy, "why": run.why, "pipeline": run.placement.to_dict(),
    }

