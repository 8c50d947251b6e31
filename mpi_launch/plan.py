"""The rank plan: which MPI rank plays which role, which MemoryX owns which layers, the SwarmX tree.

Ranks, in order: 0 the coordinator; then ``num_wgt_servers`` MemoryX ranks; then the SwarmX
nodes, root first, level by level; then the ``num_csx`` CS-2 ranks; then ``num_workers_per_csx``
input workers per CS-2, grouped by CS-2. Streaming units are split into contiguous runs, one per
MemoryX, balanced by bytes (the largest run is as small as it can be); a parameter shared by two
units (a tied embedding) belongs to the MemoryX of the first unit that uses it. The SwarmX tree
groups consecutive CS-2s ``swarmx_fanout`` at a time, then consecutive nodes, up to one root.
"""
from dataclasses import asdict, dataclass, field

# PlanError: the cluster asked for cannot be built (the message names the runconfig key). The project's
# plan kind, re-exported: ``mpi_launch.plan.PlanError`` is the name callers know.
from wse_core.errors import PlanError
from wse_core.perf.step import balance


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
    pipeline: bool = False  # one CS-2 rank that also keeps every weight and updates it (docs/design.md section 3)

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

    @classmethod
    def from_json(cls, d):
        """The plan ``to_json`` wrote (its derived keys, world_size and roles, left out)."""
        d = {k: v for k, v in d.items() if k not in ("world_size", "roles")}
        return cls(**dict(d, children={int(k): v for k, v in d["children"].items()},
                          parent={int(k): v for k, v in d["parent"].items()}))


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
