"""The rank plan: which MPI rank plays which role, which MemoryX owns which layers, the SwarmX tree.

Ranks, in order: 0 the coordinator; then ``num_wgt_servers`` MemoryX ranks; then the SwarmX
nodes, root first, level by level; then the ``num_csx`` CS-2 ranks; then ``num_workers_per_csx``
input workers per CS-2, grouped by CS-2. Streaming units are split into contiguous runs, one per
MemoryX, balanced by bytes (the largest run is as small as it can be); a parameter shared by two
units (a tied embedding) belongs to the MemoryX of the first unit that uses it. The SwarmX tree
groups consecutive CS-2s ``swarmx_fanout`` at a time, then consecutive nodes, up to one root.
"""
from dataclasses import asdict, dataclass, field

from wse_core.perf.step import balance


class PlanError(ValueError):
    """The cluster asked for cannot be built (the message names the runconfig key)."""


@dataclass
class RankPlan:
    num_csx: int
    num_wgt_servers: int
    num_workers_per_csx: int
    swarmx_fanout: int
    coordinator: int = 0
    memoryx: list = field(default_factory=list)        # rank of MemoryX k
    swarmx: list = field(default_factory=list)         # SwarmX ranks, root first
    csx: list = field(default_factory=list)            # rank of CS-2 c
    workers: list = field(default_factory=list)        # workers[c] = ranks of CS-2 c's input workers
    children: dict = field(default_factory=dict)       # SwarmX rank -> ordered child ranks (SwarmX or CS-2)
    parent: dict = field(default_factory=dict)         # SwarmX or CS-2 rank -> parent SwarmX rank (root: None)
    unit_owner: list = field(default_factory=list)     # unit index -> MemoryX index
    unit_bytes: list = field(default_factory=list)
    pipeline: bool = False  # one CS-2 rank that also keeps every weight and updates it (docs/design.md s. 9)

    @property
    def world_size(self):
        return 1 + len(set(self.memoryx) | set(self.csx)) + len(self.swarmx) + sum(map(len, self.workers))

    @property
    def swarmx_root(self):
        return self.swarmx[0]

    def roles(self):
        """(role, index within the role) of every rank, in rank order. One pass over the plan: asking
        each rank's role by searching the lists took minutes for a plan of 100,000 ranks."""
        found = {}
        for c, ranks in enumerate(self.workers):
            for i, r in enumerate(ranks):
                found[r] = ("worker", c * self.num_workers_per_csx + i)
        # a rank with two roles keeps the one written last: a pipelined CS-2 is also the MemoryX
        for role, ranks in (("csx", self.csx), ("swarmx", self.swarmx), ("memoryx", self.memoryx)):
            found.update((r, (role, i)) for i, r in enumerate(ranks))
        if self.pipeline:
            found.update((r, ("pipeline", 0)) for r in self.csx)
        found[self.coordinator] = ("coordinator", 0)
        return [found[r] for r in range(self.world_size)]

    def role_of(self, rank):
        """(role, index within the role) of a rank."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank}: not in a plan of {self.world_size} ranks")
        return self.roles()[rank]

    def summary(self):
        """The ranks in a few words: "7 MPI ranks (coordinator, 1 MemoryX, 1 SwarmX, 2 CS-2s, ...)"."""
        counts = [(1, "coordinator", "")]
        if self.pipeline:
            counts.append((len(self.csx), "pipelined CS-2", "s"))
        else:
            counts += [(len(self.memoryx), "MemoryX", ""), (len(self.swarmx), "SwarmX", ""),
                       (len(self.csx), "CS-2", "s")]
        counts.append((sum(map(len, self.workers)), "input worker", "s"))
        parts = [name if name == "coordinator" else f"{n} {name}{plural if n != 1 else ''}"
                 for n, name, plural in counts if n]
        return f"{self.world_size} MPI ranks ({', '.join(parts)})"

    def to_json(self):
        d = asdict(self)
        d["children"] = {str(k): v for k, v in self.children.items()}
        d["parent"] = {str(k): v for k, v in self.parent.items()}
        d["world_size"] = self.world_size
        d["roles"] = [role for role, _ in self.roles()]
        return d


def param_owners(unit_params, unit_owner):
    """The MemoryX index that owns each parameter: the owner of the first unit that uses it (a tied
    parameter belongs to its first unit's server)."""
    owner = {}
    for u, names in enumerate(unit_params):
        for n in names:
            owner.setdefault(n, unit_owner[u])
    return owner


def partition_by_bytes(sizes, parts):
    """Split ``sizes`` into ``parts`` contiguous non-empty runs minimising the largest run's sum; owner per item."""
    if parts > len(sizes):
        raise PlanError(f"runconfig.num_wgt_servers: {parts} MemoryX servers for {len(sizes)} streaming "
                        "units; each server needs at least one")
    return balance(sizes, parts)  # the simulated-time walk shares it (wse_core.perf.step)


def make_plan(*, num_csx, num_wgt_servers, num_workers_per_csx, swarmx_fanout, unit_bytes, pipeline=False):
    """Lay out the ranks of a weight-streaming cluster, or of a pipelined run: the coordinator, one
    CS-2 that is also the only weight store (rank 1), its input workers."""
    if pipeline:
        return RankPlan(1, 1, num_workers_per_csx, swarmx_fanout, memoryx=[1], csx=[1],
                        workers=[list(range(2, 2 + num_workers_per_csx))], unit_owner=[0] * len(unit_bytes),
                        unit_bytes=list(unit_bytes), pipeline=True)
    plan = RankPlan(num_csx, num_wgt_servers, num_workers_per_csx, swarmx_fanout,
                    unit_bytes=list(unit_bytes))
    plan.unit_owner = partition_by_bytes(list(unit_bytes), num_wgt_servers)
    plan.memoryx = list(range(1, 1 + num_wgt_servers))
    # Build the SwarmX tree bottom-up as nested groups, then number it root first.
    level = [("csx", c) for c in range(num_csx)]
    levels = []
    while True:
        groups = [level[i:i + swarmx_fanout] for i in range(0, len(level), swarmx_fanout)]
        levels.append(groups)
        if len(groups) == 1:
            break
        level = [("node", len(levels) - 1, g) for g in range(len(groups))]
    next_rank = 1 + num_wgt_servers
    node_rank = {}
    for depth, groups in enumerate(reversed(levels)):
        lvl = len(levels) - 1 - depth
        for g in range(len(groups)):
            node_rank[(lvl, g)] = next_rank
            plan.swarmx.append(next_rank)
            next_rank += 1
    plan.csx = list(range(next_rank, next_rank + num_csx))
    next_rank += num_csx
    for c in range(num_csx):
        plan.workers.append(list(range(next_rank, next_rank + num_workers_per_csx)))
        next_rank += num_workers_per_csx
    for lvl, groups in enumerate(levels):
        for g, members in enumerate(groups):
            me = node_rank[(lvl, g)]
            kids = [plan.csx[m[1]] if m[0] == "csx" else node_rank[(m[1], m[2])] for m in members]
            plan.children[me] = kids
            for k in kids:
                plan.parent[k] = me
    plan.parent[plan.swarmx_root] = None
    return plan


def plan_for(params):
    """(plan, model) of a validated params dict: the one place that turns params into a rank plan."""
    from wse_core.nn import build_model

    r = params.runconfig
    model = build_model(params.model)
    plan = make_plan(num_csx=r.num_csx, num_wgt_servers=r.num_wgt_servers,
                     num_workers_per_csx=r.num_workers_per_csx, swarmx_fanout=r.swarmx_fanout,
                     unit_bytes=model.unit_bytes(),
                     pipeline=strategy(params, model)[0] == "pipeline")
    return plan, model


def optimizer_states(o):
    """Arrays of optimizer state per parameter (``optimizer`` section): 2 for Adam, 1 or 0 for SGD."""
    import numpy as np

    from wse_core.optim import make_optimizer

    if o.optimizer_type.lower() == "sgd" and o.momentum == 0:
        return 0
    return len(make_optimizer(o.optimizer_type).init_state(np.zeros(1, np.float32)))


def strategy(params, model):
    """(execution strategy, one line saying why, the pipelined Placement): ``runconfig.execution_strategy``,
    with ``auto`` resolved by the model (``wse_core.perf.pipeline.choose``) on one CS-2. Weight
    streaming is refused when a micro-batch does not fit a CS-2's wafer (``perf.memory.streaming_wafer``),
    as pipelined mode is when the model does not fit."""
    from wse_core.perf import Hardware
    from wse_core.perf.pipeline import choose

    r, t = params.runconfig, params.train_input
    hw = Hardware.for_model(model, r.hardware)
    seq = params.model.get("max_position_embeddings")
    chosen, why, placement, _ = choose(model, batch_size=t.batch_size, micro_batch_size=t.micro_batch_size,
                                       seq_len=seq, n_states=optimizer_states(params.optimizer), hw=hw)
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
    """Refuse, in one line saying what would fit, a micro-batch whose weight streaming does not fit a
    CS-2's wafer (docs/design.md section 8, "Wafer memory")."""
    from wse_core.nn import micro_batch_sizes
    from wse_core.perf.memory import largest_micro_batch, streaming_wafer

    w = streaming_wafer(model, micro_batch_size, seq_len, hw)
    if w.fits:
        return w
    best = largest_micro_batch(model, micro_batch_sizes(batch_size, num_csx), seq_len, hw)
    per_csx = -(-batch_size // num_csx)
    fix = (f"the largest that fits and deals the {per_csx} samples each CS-2 gets evenly is {best} "
           f"(or micro_batch_size: auto)" if best else "not even one sample fits: use more CS-2s or a smaller model")
    raise PlanError(f"train_input.micro_batch_size: {micro_batch_size} samples do not fit a CS-2's wafer in weight "
                    f"streaming: {w.need / 1e9:.1f} GB ({(w.checkpoints + w.segment) / 1e9:.1f} GB of activations, "
                    f"{(w.weights + w.gradients) / 1e9:.2f} GB of weights and gradients in flight) of its "
                    f"{w.capacity / 1e9:.1f} GB usable SRAM; {fix}")


def micro_batch_table(params, model):
    """Every micro-batch size that deals the batch evenly, with its wafer need and simulated samples/s
    (``micro_batch_size: explore``)."""
    from wse_core.nn import micro_batch_sizes
    from wse_core.perf import Hardware
    from wse_core.perf.memory import streaming_wafer
    from wse_core.perf.step import walk_step

    r, t = params.runconfig, params.train_input
    hw = Hardware.for_model(model, r.hardware)
    seq = params.model.get("max_position_embeddings")
    per_csx = -(-t.batch_size // r.num_csx)
    rows = []
    for b in micro_batch_sizes(t.batch_size, r.num_csx):
        w = streaming_wafer(model, b, seq, hw)
        sim = walk_step(model, num_csx=r.num_csx, samples_per_csx=per_csx, micro_batch_size=b, seq_len=seq,
                        num_wgt_servers=r.num_wgt_servers, swarmx_fanout=r.swarmx_fanout, hw=hw,
                        batch_size=t.batch_size) if w.fits else None
        rows.append({"micro_batch_size": b, "need_bytes": w.need, "fits": w.fits,
                     "samples_per_s": sim.samples_per_s if sim else None, "chosen": b == t.micro_batch_size})
    return rows


def rank_memory(params, plan, model):
    """{rank: bytes} of host memory each rank of ``plan`` holds (``perf.memory.rank_memory_bytes``)."""
    import numpy as np

    from wse_core.perf.memory import rank_memory_bytes

    seq = params.model.get("max_position_embeddings")
    example = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in model.example_layout(1, seq))
    return rank_memory_bytes(plan, model, n_states=optimizer_states(params.optimizer), seq_len=seq,
                             micro_batch_size=params.train_input.micro_batch_size, example_bytes=example)


def check_host_memory(params, plan, *, hostfile=None, total=None):
    """Refuse, in one line, a run whose ranks would hold more than this machine's memory (``total``
    bytes; default: its physical memory) when they all run here (no hostfile): they would each die of
    a MemoryError once started (a batch of 2^20 samples took its micro-batch as the wafer's largest,
    415 GB of activations a CS-2 rank)."""
    import os

    from wse_core.nn import build_model

    if hostfile is not None:
        return
    total = total or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    memory = rank_memory(params, plan, build_model(params.model))
    need = sum(memory.values())
    if need <= total:
        return
    rank = max(memory, key=memory.get)
    role, index = plan.role_of(rank)
    by_batch = role in ("csx", "worker")  # what the largest rank holds grows with the micro-batch, else the model
    what = (f"train_input.micro_batch_size: {params.train_input.micro_batch_size:,} samples a micro-batch"
            if by_batch else "model")
    raise PlanError(f"{what}: the ranks would hold {need / 1e9:,.1f} GB (rank {rank}, {role} {index}: "
                    f"{memory[rank] / 1e9:,.1f} GB), more than this machine's {total / 1e9:,.1f} GB; use "
                    f"{'a smaller micro-batch' if by_batch else 'a smaller model'}, or spread the ranks over several "
                    "machines with --hostfile")


def describe(params):
    """The plan of a validated params dict, with per-rank memory estimates: what `wse compile` prints."""
    from wse_core.perf import Hardware
    from wse_core.perf.memory import streaming_wafer
    from wse_core.perf.step import walk_step
    from wse_core.tree import cluster_sums_as_one

    run, train = params.runconfig, params.train_input
    plan, model = plan_for(params)
    unit_bytes = plan.unit_bytes
    per_csx = -(-train.batch_size // run.num_csx)
    rounds = -(-per_csx // train.micro_batch_size)
    seq = params.model.get("max_position_embeddings")
    memory = rank_memory(params, plan, model)
    hw = Hardware.for_model(model, run.hardware)

    exact = cluster_sums_as_one(run.num_csx, rounds, run.swarmx_fanout)
    mode, why, placement = strategy(params, model)
    return {
        "plan": plan.to_json(),
        "model": {"name": model.config["name"], "parameters": model.num_params(),
                  "units": [u.name for u in model.units],
                  "unit_bytes": unit_bytes},
        "memory_bytes": {str(r): int(memory[r]) for r in range(plan.world_size)},
        "micro_batches_per_csx": rounds,
        "wafer_bytes": streaming_wafer(model, train.micro_batch_size, seq, hw).to_dict(),
        "simulated": walk_step(model, num_csx=run.num_csx, samples_per_csx=per_csx,
                               micro_batch_size=train.micro_batch_size, seq_len=seq,
                               num_wgt_servers=run.num_wgt_servers, swarmx_fanout=run.swarmx_fanout,
                               hw=hw, batch_size=train.batch_size).to_dict(),
        "bit_identical_to_reference": exact,
        "execution_strategy": mode, "why": why, "pipeline": placement.to_dict(),
    }
