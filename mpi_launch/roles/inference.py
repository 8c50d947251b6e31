"""The roles of an inference job (docs/design/inference.md "Inference on the cluster"): the
generation ``Engine`` on the coordinator, its forward passes on the CS-2s, the weights from MemoryX
through the SwarmX tree. ``mpi_launch.inference`` plans and starts the job and talks to its
coordinator. The machines have training's names with ``Inference`` before them
(``InferenceCoordinator``, ``InferenceMemoryX``, ``InferenceSwarmX``, ``InferenceCS2``), and share
training's base (``roles.base.BaseRole``).

Two placements, chosen by ``wse_core.perf.inference`` when the job is planned:

* **resident**: the weights cross from MemoryX once, at the start; CS-2 c keeps its run of units
  (``spec["wafers"]``, balanced by bytes with their KV caches) and the caches of every sequence in
  those units. A pass runs through the CS-2s in order: the first gets the token ids from the
  coordinator, each hands its last unit's output to the next, the last sends the logits back
  (pipelined across layers and wafers, as Cerebras serves models).
* **streamed**: every pass, every MemoryX streams its units again through the tree to every CS-2.
  Each sequence lives on one CS-2 (the least loaded when it joins), which runs every unit on its
  sequences' rows and keeps their caches.

A sequence's logits do not depend on the other rows of its pass (``wse_core.nn.kv``), so the tokens
are those of ``wse_core.nn.generate.Local`` for any ``num_csx`` and either placement. Ranks other
than the coordinator wait for its next message without a deadline (a server may stay idle for
hours; the watchdog still ends the job if any rank dies), never spinning (``messaging.poll``).

Messages: the table ``mpi_launch.protocol.INFER``.
"""
import dataclasses
import math
import time
from multiprocessing.connection import Client

import numpy as np

from mpi_launch import messaging as msg
from mpi_launch.protocol import CONTROL, DATA, FWD_WEIGHTS, LOGITS, REPORT, Pass, Rows, Stop
from mpi_launch.roles.base import BaseRole


class InferenceRole(BaseRole):
    """What every rank of an inference job shares besides ``BaseRole``: the job's spec
    (``mpi_launch.inference.spec``), its placement, and the pace of its passes."""

    def __init__(self, comm, plan, spec, run_dir, index, model):
        super().__init__(comm, plan, model, run_dir, index)
        self.spec = spec
        self.streamed = spec["placement"] == "streamed"
        layout = self.layout(1)
        # Until a pass has set the pace, a wait may hold the job's start-up (MemoryX reading the
        # weights, their crossing the tree), as a training job's first step does (roles.base).
        peer, start = spec["peer_timeout"], spec["startup_timeout"]
        self.link = msg.Link(comm, layout, start + peer, f"--peer_timeout {peer:g} s + the start-up's {start:g} s, "
                                                         "until a pass has set the pace")
        self._began, self._uncounted, self._longest, self._per_token = None, True, None, 0.0

    def pace(self, tokens=0):
        """Before a pass of ``tokens`` tokens (0: not known to this rank): how long this rank's waits in it
        may last. Training's rule (``roles.base.Role.step_done``; docs/design/ranks.md "Peer timeouts"), a pass
        for a step: ``--peer_timeout`` plus twice what the passes so far say this one takes, since a
        wait may span a peer's whole pass (the coordinator waits out the CS-2s' forward for the logits).
        Passes differ in size as steps do not (a 2,000-token prompt is prefilled in one; a decode
        step is a token a sequence), so what they say is the longest pass so far or, if longer, this
        pass's tokens at the slowest rate per token seen. The first pass holds the start-up and sets
        no pace."""
        self._began = time.monotonic()
        if self._longest is None:
            return
        peer, expect = self.spec["peer_timeout"], max(self._longest, self._per_token * tokens)
        why = (f"{tokens:,} tokens at the slowest rate so far, {1e3 * self._per_token:.1f} ms a token"
               if expect > self._longest else f"the longest pass so far, {self._longest:.1f} s")
        self.link.set_timeout(peer + 2 * expect, f"--peer_timeout {peer:g} s + twice {why}")

    def paced(self, tokens=0):
        """After the pass ``pace`` began: its length counts toward the next passes' allowance."""
        took = time.monotonic() - self._began
        if self._uncounted:
            self._uncounted = False
            return
        self._longest = max(self._longest or 0.0, took)
        if tokens:
            self._per_token = max(self._per_token, took / tokens)

    def next_order(self, source, tag, what):
        """The next message from ``source``, waited for as long as it takes (never spinning)."""
        return self.link.recv_object(source, tag, what, timeout=math.inf)

    def stream_passes(self, stream):
        """Run ``stream``, what a MemoryX or SwarmX node does with the weights: once (resident), or at
        each of the coordinator's passes (streamed); either way until the coordinator's Stop."""
        if not self.streamed:
            stream()
        while not isinstance(self.next_order(self.plan.coordinator, self.link.tag(CONTROL),
                                             "the coordinator (next pass)"), Stop):
            self.pace()
            stream()
            self.paced()


class InferenceCoordinator(InferenceRole):
    """Runs the Engine (sampling, continuous batching, ends of sequences) for the process that started
    the job, over a Unix socket (``multiprocessing.connection``): ("add", prompt, max_new_tokens,
    sampling, stop_ids) answers the sequence's id or a ValueError's line; ("cancel", id); ("step",)
    answers the step's [(id, token or None)]; ("close",), or the socket closing, ends the job."""

    def run(self):
        from wse_core.nn.generate import Engine

        engine = Engine(self.model, runner=_ClusterRunner(self))
        conn = Client(self.spec["socket"], family="AF_UNIX")
        try:
            while True:
                try:
                    order = conn.recv()  # blocks in the kernel: an idle server costs nothing
                except EOFError:
                    break
                if order[0] == "add":
                    try:
                        conn.send(("ok", engine.add(*order[1:])))
                    except ValueError as exc:
                        conn.send(("error", str(exc)))
                elif order[0] == "cancel":
                    engine.cancel(order[1])
                elif order[0] == "step":
                    conn.send(("ok", engine.step()))
                else:
                    break
        finally:
            conn.close()
        self._stop()

    def _stop(self):
        """End every rank: MemoryX and SwarmX wait for the coordinator in both placements, the CS-2s
        for their rows (resident: the first, which hands the end on)."""
        tag = self.link.tag(CONTROL)
        for rank in self.plan.memoryx + self.plan.swarmx:
            self.comm.send(Stop(), dest=rank, tag=tag)  # INFER["pass"]
        for rank in self.plan.csx if self.streamed else self.plan.csx[:1]:
            self.comm.send(Stop(), dest=rank, tag=tag)  # INFER["rows"]


class _ClusterRunner:
    """The Engine's runner (``wse_core.nn.generate.Local``'s interface) on the coordinator: sequences
    are given to CS-2s, each forward pass is sent to them and their logits gathered."""

    def __init__(self, role):
        self.role, self.next_id = role, 0
        self.home = {}                                  # sequence -> CS-2 index (streamed)
        self.added, self.removed = [], []               # since the last pass: (sequence, CS-2)
        self.capacity, self.vocab_size = role.model.config["max_position_embeddings"], role.model.config["vocab_size"]

    def add(self):
        i, self.next_id = self.next_id, self.next_id + 1
        load = [0] * self.role.plan.num_csx
        for c in self.home.values():
            load[c] += 1
        c = load.index(min(load)) if self.role.streamed else 0
        self.home[i] = c
        self.added.append((i, c))
        return i

    def remove(self, i):
        c = self.home.pop(i)
        if (i, c) in self.added:  # ended before any pass (max_new_tokens 0, or cancelled): the CS-2s never knew it
            self.added.remove((i, c))
        else:
            self.removed.append((i, c))

    def forward(self, ids, active):
        role, link = self.role, self.role.link
        tag = link.tag
        t = ids.shape[1]
        role.pace(ids.size)
        logits = np.empty((len(active), self.vocab_size), np.float32)
        if role.streamed:
            for rank in role.plan.memoryx + role.plan.swarmx:
                role.comm.send(Pass(), dest=rank, tag=tag(CONTROL))  # INFER["pass"]
            rows = {c: [k for k, i in enumerate(active) if self.home[i] == c] for c in range(role.plan.num_csx)}
            for c, rank in enumerate(role.plan.csx):
                role.comm.send(Rows(x=ids[rows[c]], active=[active[k] for k in rows[c]], t=t,  # INFER["rows"]
                                    added=[i for i, h in self.added if h == c],
                                    removed=[i for i, h in self.removed if h == c]), dest=rank, tag=tag(CONTROL))
            for c, rank in enumerate(role.plan.csx):
                got = link.recv_object(rank, tag(REPORT, 0, LOGITS), f"CS-2 rank {rank} (logits)")  # INFER["logits"]
                if rows[c]:
                    logits[rows[c]] = got
        else:
            role.comm.send(Rows(x=ids, active=list(active), t=t, added=[i for i, _ in self.added],
                                removed=[i for i, _ in self.removed]), dest=role.plan.csx[0], tag=tag(CONTROL))
            last = role.plan.csx[-1]
            logits[:] = link.recv_object(last, tag(REPORT, 0, LOGITS), f"CS-2 rank {last} (logits)")
        self.added, self.removed = [], []
        role.paced(ids.size)
        return logits


class InferenceMemoryX(InferenceRole):
    """A MemoryX server: loads the weights it owns from the job's source and streams them down the
    tree, once (resident) or for every pass (streamed), in the model's precision."""

    def run(self):
        owned = [n for n in self.model.param_names if self.param_owner[n] == self.index]
        wire = {n: self.model.precision.to_wire(w) for n, w in _load(self.spec, owned).items()}
        uses = [(u, i, n) for u, names in enumerate(self.unit_params) for i, n in enumerate(names)
                if self.param_owner[n] == self.index]
        root = self.plan.swarmx_root

        def send():
            reqs = []
            for u, i, n in uses:
                reqs += self.link.isend_arrays([wire[n]], root, FWD_WEIGHTS, u, index=i)  # INFER["weights"]
            self.link.wait_all(reqs, f"SwarmX root rank {root} (weights)")

        self.stream_passes(send)


class InferenceSwarmX(InferenceRole):
    """A SwarmX node: relays every unit's weights to its children, chunk by chunk, as they land."""

    def run(self):
        me = self.plan.swarmx[self.index]
        kids, parent = self.plan.children[me], self.plan.parent[me]

        def relay():
            sends, keep = [], []
            for u in range(len(self.units)):
                sources = ([parent] * len(self.unit_params[u]) if parent is not None else
                           [self.plan.memoryx[self.param_owner[n]] for n in self.unit_params[u]])
                arrays, more = self.link.relay(self.unit_layout(u), sources, kids, FWD_WEIGHTS, u,
                                               f"weights of {self.units[u].name}")
                sends += more
                keep.append(arrays)
            self.link.wait_all(sends, f"children {kids} of SwarmX rank {me} (weights)")

        self.stream_passes(relay)


class InferenceCS2(InferenceRole):
    """A CS-2 of an inference job: its units' weights (resident: kept from the start; streamed: taken
    again every pass) and its sequences' KV caches; runs its units on each pass's rows."""

    def run(self):
        from wse_core.nn.kv import KVCache

        c, csx = self.index, self.plan.csx
        mine = [u for u, w in enumerate(self.spec["wafers"]) if w == c] if not self.streamed else range(len(self.units))
        first, end = min(mine), max(mine) + 1
        kv = KVCache(self.model.config["max_position_embeddings"])
        coordinator = self.plan.coordinator
        source, tag_in = (coordinator, CONTROL) if self.streamed or c == 0 else (csx[c - 1], DATA)
        last = self.streamed or c + 1 == len(csx)
        weights = None if self.streamed else self._weights(first, end)
        self.log(f"units {first}..{end - 1} ({self.spec['placement']})")
        while True:
            order = self.next_order(source, self.link.tag(tag_in), f"rank {source} (the next pass)")
            if isinstance(order, Stop):
                if not last:
                    self.comm.send(order, dest=csx[c + 1], tag=self.link.tag(DATA))
                return
            tokens = math.prod(order.x.shape[:2])  # ids (rows, t), or the activations of them
            self.pace(tokens)
            if self.streamed:
                weights = self._weights(first, end)
            for i in order.removed:
                kv.remove(i)
            for i in order.added:
                kv.add(i)
            x = order.x
            if order.active:
                x = self.model.infer_units(weights, x, kv, order.active, first, end, order.t)
            if last:
                self.comm.send(np.ascontiguousarray(x[:, -1]) if order.active else None,  # INFER["logits"]
                               dest=coordinator, tag=self.link.tag(REPORT, 0, LOGITS))
            else:
                self.comm.send(dataclasses.replace(order, x=x), dest=csx[c + 1],  # INFER["activations"]
                               tag=self.link.tag(DATA))
            self.paced(tokens)

    def _weights(self, first, end):
        """Every unit's weights from the tree (a pass streams them all to every CS-2); those of units
        ``first`` .. ``end`` - 1, in the precision the CS-2s compute in."""
        parent = self.plan.parent[self.plan.csx[self.index]]
        arrays, reqs = [], []
        for u in range(len(self.units)):
            a, r = self.link.irecv_arrays(self.unit_layout(u), parent, FWD_WEIGHTS, u)
            arrays.append(a)
            reqs += r
        self.link.wait_all(reqs, f"SwarmX rank {parent} (weights)")
        from_wire = self.model.precision.from_wire
        return {n: from_wire(a) for u in range(first, end) for n, a in zip(self.unit_params[u], arrays[u])}


def _load(spec, names):
    """The float32 master weights ``names`` of the job's source: a checkpoint, or a Hugging Face directory."""
    if spec["format"] == "hf":
        from data_tools.hf import read_hf

        weights = read_hf(spec["source"])[1]
        return {n: weights[n] for n in names}
    from data_tools.checkpoint import Checkpoint

    ckpt = Checkpoint(spec["source"])
    return ckpt.dense(ckpt.load(names)[0])


ROLES = {"coordinator": InferenceCoordinator, "memoryx": InferenceMemoryX, "swarmx": InferenceSwarmX,
         "csx": InferenceCS2}
