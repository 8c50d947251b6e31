"""The roles of the weight-streaming cluster, one class each with a ``run()``.

One training step (docs/design.md section 2), for streaming units u = 0..U-1:

* input workers send each CS-2 its micro-batches of the global batch (stream positions
  [t*B, (t+1)*B) of ``GlobalStream``; CS-2 c owns a contiguous run of them);
* forward: each MemoryX sends the weights it owns of unit u to the SwarmX root, which relays them
  down the tree; every CS-2 runs unit u on all its micro-batches while unit u+1 is already arriving;
* loss: each CS-2 reports its loss sum and token count to the coordinator;
* backward: weights stream down again, in reverse; each CS-2 tree-sums its micro-batch gradients
  and sends them up; each SwarmX node tree-sums its children's sums in order and passes the result
  up, the root to the MemoryX that owns the parameter;
* update: MemoryX ranks send the coordinator each parameter's sum of squares; the coordinator
  computes the global norm (in parameter order, as the reference does), the clip factor and the
  learning rate, and tells MemoryX to apply the fused optimizer update.

All sends are non-blocking and all waits go through ``messaging.wait_all`` (sleeps, never spins).
Every sum follows ``wse_core.tree``, so the weights are bit-identical to the single-process
reference step for num_csx = 1, 2, 4, ... (power-of-two fan-out).
"""
import json
import math
import time

import numpy as np

from mpi_launch import messaging as msg
from mpi_launch.rundir import LineLog, RunDir
from wse_core.tree import tree_sum


class Role:
    """What every role shares: the communicator, the plan, the params, the model and a log file."""

    def __init__(self, comm, plan, params, run, index):
        from wse_core.nn import build_model

        self.comm, self.plan, self.params, self.run_info, self.index = comm, plan, params, run, index
        self.rank = comm.rank
        self.model = build_model(params["model"])
        self.units = self.model.units
        self.unit_params = self.model.unit_params
        self.run_dir = RunDir(params["runconfig"]["model_dir"])
        self.model_dir = self.run_dir.path
        self.max_steps = params["runconfig"]["max_steps"]
        self.start_step = run["start_step"]
        t = params["train_input"]
        self.batch_size, self.mbs = t["batch_size"], t["micro_batch_size"]
        self.per_csx = self.batch_size // plan.num_csx
        self.n_micro = self.per_csx // self.mbs
        # The MemoryX that owns each parameter: the owner of the first unit that uses it.
        self.param_owner = {}
        for u, names in enumerate(self.unit_params):
            for n in names:
                self.param_owner.setdefault(n, plan.unit_owner[u])
        self.shapes = {n: s.shape for n, s in self.model.param_specs.items()}
        self.log_file = LineLog(self.run_dir.rank_log(self.rank))
        self._timing_file = None

    def step_done(self, step):
        """After the first step every rank is past its imports: from now on a silent peer is a lost one."""
        if step == self.start_step:
            msg.set_timeout(self.params["runconfig"]["peer_timeout"])

    def log(self, text):
        self.log_file.write(f"{time.strftime('%H:%M:%S')} {text}\n")

    def timing(self, step, **fields):
        """One JSON line per step in ``logs/timing_rank_<r>.jsonl``: where this rank's time went.

        Durations are seconds; ``at_*`` fields are ``time.monotonic()`` stamps, comparable across the
        ranks of one machine (``wse bench stream`` lines them up into a step breakdown).
        """
        if self._timing_file is None:
            self._timing_file = LineLog(self.run_dir.timing_log(self.rank))
        self._timing_file.write(json.dumps({"step": step + 1, **fields}) + "\n")

    def unit_layout(self, u):
        return [(self.shapes[n], np.float32) for n in self.unit_params[u]]


class InputWorker(Role):
    """Reads its CS-2's micro-batches from the global stream and sends them ahead."""

    def run(self):
        from data_tools.dataset import GlobalStream

        w = self.plan.num_workers_per_csx
        csx, j = divmod(self.index, w)
        t_in = self.params["train_input"]
        stream = GlobalStream(t_in["data_dir"], shuffle=t_in["shuffle"], seed=t_in["shuffle_seed"])
        dest = self.plan.csx[csx]
        try:
            for step in range(self.start_step, self.max_steps):
                base = step * self.batch_size + csx * self.per_csx
                reqs, keep = [], []
                for m in range(j, self.n_micro, w):
                    batch = stream.read(base + m * self.mbs, self.mbs)
                    parts = [batch] if isinstance(batch, np.ndarray) else list(batch)
                    keep.append(parts)
                    reqs += [self.comm.Isend(a, dest=dest, tag=msg.tag(msg.DATA, m, i)) for i, a in enumerate(parts)]
                msg.wait_all(reqs, f"CS-2 {csx} to take the micro-batches of step {step}")
                self.step_done(step)
        finally:
            stream.close()


class CS2(Role):
    """Runs every unit on its micro-batches as the weights stream through; sends gradient sums up."""

    def run(self):
        parent = self.plan.parent[self.plan.csx[self.index]]
        w = self.plan.num_workers_per_csx
        workers = self.plan.workers[self.index]
        lm = self.model.kind == "gpt2"
        for step in range(self.start_step, self.max_steps):
            t0 = time.perf_counter()
            # Data for this step, and unit 0's weights, arrive while nothing else happens yet.
            data_reqs, raw = [], []
            for m in range(self.n_micro):
                src = workers[m % w]
                if lm:
                    a = [np.empty((self.mbs, 3, self.seq_len()), np.int32)]
                else:
                    a = [np.empty((self.mbs, self.params["model"]["input_size"]), np.float32),
                         np.empty(self.mbs, np.int32)]
                raw.append(a)
                data_reqs += [self.comm.Irecv(x, source=src, tag=msg.tag(msg.DATA, m, i)) for i, x in enumerate(a)]
            weights, wreqs = msg.irecv_arrays(self.comm, self.unit_layout(0), parent, msg.FWD_WEIGHTS, 0)
            msg.wait_all(data_reqs, f"input workers {workers} (micro-batches of step {step})")
            t_data = time.perf_counter() - t0
            batches = [self._batch(a, lm) for a in raw]
            xs = [self.model.first_input(b, np.float32) for b in batches]
            saved = [[None] * self.n_micro for _ in self.units]
            t_wait = 0.0
            for u, unit in enumerate(self.units):
                tw = time.perf_counter()
                msg.wait_all(wreqs, f"SwarmX rank {parent} (forward weights of {unit.name})")
                t_wait += time.perf_counter() - tw
                params = dict(zip(self.unit_params[u], weights))
                if u + 1 < len(self.units):  # the next unit streams in while this one computes
                    weights, wreqs = msg.irecv_arrays(self.comm, self.unit_layout(u + 1), parent, msg.FWD_WEIGHTS, u + 1)
                for m in range(self.n_micro):
                    xs[m], saved[u][m] = unit.forward(xs[m], params)
            losses = [self.model.loss(xs[m], batches[m]) for m in range(self.n_micro)]
            loss_sum = tree_sum([x[0] for x in losses])
            n_tokens = sum(x[1] for x in losses)
            report = self.comm.isend((loss_sum, n_tokens), dest=self.plan.coordinator, tag=msg.tag(msg.REPORT))
            dys = [x[2] for x in losses]
            last = len(self.units) - 1
            weights, wreqs = msg.irecv_arrays(self.comm, self.unit_layout(last), parent, msg.BWD_WEIGHTS, last)
            grad_reqs, keep = [], []
            for u in reversed(range(len(self.units))):
                unit = self.units[u]
                tw = time.perf_counter()
                msg.wait_all(wreqs, f"SwarmX rank {parent} (backward weights of {unit.name})")
                t_wait += time.perf_counter() - tw
                params = dict(zip(self.unit_params[u], weights))
                if u > 0:
                    weights, wreqs = msg.irecv_arrays(self.comm, self.unit_layout(u - 1), parent, msg.BWD_WEIGHTS, u - 1)
                grads = []
                for m in range(self.n_micro):
                    dys[m], g = unit.backward(dys[m], saved[u][m], params)
                    saved[u][m] = None
                    grads.append(g)
                total = tree_sum(grads, add=lambda a, b: {k: a[k] + b[k] for k in a})
                arrays = [total[n] for n in self.unit_params[u]]
                keep.append(arrays)
                grad_reqs += msg.isend_arrays(self.comm, arrays, parent, msg.GRADS, u)
            at_backward_end = time.monotonic()
            tg = time.perf_counter()
            msg.wait_all(grad_reqs + [report], f"SwarmX rank {parent} (gradients of step {step})")
            t_end = time.perf_counter()
            self.timing(step, seconds=t_end - t0, data_wait=t_data, weight_wait=t_wait,
                        compute=tg - t0 - t_data - t_wait, grad_send_wait=t_end - tg, at_backward_end=at_backward_end)
            self.log(f"step {step}: loss_sum {loss_sum:.6f} tokens {n_tokens} "
                     f"time {t_end - t0:.3f}s waiting {t_wait + t_data + t_end - tg:.3f}s")
            self.step_done(step)

    def seq_len(self):
        from data_tools.dataset import Dataset

        if not hasattr(self, "_seq"):
            self._seq = int(Dataset(self.params["train_input"]["data_dir"]).example_shape[-1])
        return self._seq

    @staticmethod
    def _batch(arrays, lm):
        if lm:
            a = arrays[0]
            return {"input_ids": np.ascontiguousarray(a[:, 0]), "loss_mask": np.ascontiguousarray(a[:, 1]),
                    "labels": np.ascontiguousarray(a[:, 2])}
        return {"features": arrays[0], "labels": arrays[1]}


class SwarmX(Role):
    """Broadcasts weights down its subtree and sums gradients on their way up."""

    def run(self):
        me = self.plan.swarmx[self.index]
        kids = self.plan.children[me]
        parent = self.plan.parent[me]
        n_units = len(self.units)
        for step in range(self.start_step, self.max_steps):
            self._pending, self._keep = [], []  # requests in flight, and the buffers they use
            for u in range(n_units):
                self._relay(u, msg.FWD_WEIGHTS, parent, kids, step)
            self._relay(n_units - 1, msg.BWD_WEIGHTS, parent, kids, step)
            for u in reversed(range(n_units)):
                if u > 0:  # weights of the next unit go down before this unit's gradients come up
                    self._relay(u - 1, msg.BWD_WEIGHTS, parent, kids, step)
                self._reduce(u, parent, kids, step)
            msg.wait_all(self._pending, f"children {kids} and parent of SwarmX rank {me} (step {step})")
            self.step_done(step)

    def _sources(self, u, parent):
        if parent is not None:
            return [parent] * len(self.unit_params[u])
        return [self.plan.memoryx[self.param_owner[n]] for n in self.unit_params[u]]

    def _relay(self, u, phase, parent, kids, step):
        sources = self._sources(u, parent)
        arrays, sends = msg.relay(self.comm, self.unit_layout(u), sources, kids, phase, u,
                                  f"weights of {self.units[u].name} from rank(s) {sorted(set(sources))}")
        self._pending += sends
        self._keep.append(arrays)

    def _reduce(self, u, parent, kids, step):
        dests = self._sources(u, parent)  # up the tree, or from the root to each parameter's MemoryX
        sums, sends = msg.reduce(self.comm, self.unit_layout(u), kids, dests, msg.GRADS, u,
                                 f"gradients of {self.units[u].name} from children {kids}")
        self._pending += sends
        self._keep.append(sums)


class MemoryX(Role):
    """Holds weights and optimizer state of its units, streams them out, applies the update."""

    def run(self):
        from data_tools.checkpoint import Checkpoint, CheckpointWriter
        from wse_core.optim import make_optimizer, sum_of_squares

        o = self.params["optimizer"]
        kwargs = {"lr": 0.0, "weight_decay": o["weight_decay"]}
        if o["optimizer_type"].lower() == "sgd":
            kwargs.update(momentum=o["momentum"], nesterov=o["nesterov"])
        else:
            kwargs.update(betas=tuple(o["betas"]), eps=o["eps"])
        self.optimizer = make_optimizer(o["optimizer_type"], **kwargs)
        owned = [n for n in self.model.param_names if self.param_owner[n] == self.index]
        if self.run_info["checkpoint"]:
            self.weights, self.state = Checkpoint(self.run_info["checkpoint"]).load(owned)
            self.log(f"loaded {len(owned)} parameters from {self.run_info['checkpoint']}")
        else:
            self.weights = self.model.init_params(self.params["runconfig"]["seed"], names=owned)
            self.state = {n: self.optimizer.init_state(self.weights[n]) for n in owned}
        self.owned = owned
        # The CSR pattern of owned sparse weights, saved with every checkpoint beside their values.
        self.sparse = {n: {"indptr": st.indptr, "indices": st.indices, "shape": np.array(st.shape, np.int64)}
                       for n, st in self.model.structures.items() if n in owned}
        root = self.plan.swarmx_root
        # (unit, index) of every use of an owned parameter: a tied parameter is used twice.
        uses = [(u, i, n) for u, names in enumerate(self.unit_params) for i, n in enumerate(names)
                if self.param_owner[n] == self.index]
        coordinator = self.plan.coordinator
        for step in range(self.start_step - 1, self.max_steps):
            if step >= self.start_step:
                sends = []
                for phase in (msg.FWD_WEIGHTS, msg.BWD_WEIGHTS):
                    for u, i, n in uses:
                        sends += msg.isend_arrays(self.comm, [self.weights[n]], root, phase, u, index=i)
                grads, greqs = {}, []
                for u, i, n in uses:
                    g = np.empty(self.shapes[n], np.float32)
                    greqs += msg.irecv_into(self.comm, [g], root, msg.GRADS, u, index=i)
                    grads.setdefault(n, []).append(g)
                msg.wait_all(sends + greqs, f"SwarmX root rank {root} (weights out, gradients in, step {step})")
                at_grads_in = time.monotonic()
                # A tied parameter's uses are added in unit order, as Model.combine_unit_grads does.
                total = {n: (gs[0] if len(gs) == 1 else gs[0] + gs[1]) for n, gs in grads.items()}
                sumsq = [(n, sum_of_squares(total[n])) for n in owned]
                self.comm.send(sumsq, dest=coordinator, tag=msg.tag(msg.REPORT, 1))
            control = msg.recv_object(self.comm, coordinator, msg.tag(msg.CONTROL), f"the coordinator (step {step})")
            if step >= self.start_step:
                t_opt = time.perf_counter()
                for n in owned:
                    self.optimizer.update(self.weights[n], total[n], self.state[n], step=step + 1,
                                          lr=control["lr"], grad_scale=control["grad_scale"], name=n)
                self.timing(step, optimizer=time.perf_counter() - t_opt, at_grads_in=at_grads_in,
                            bytes_out=2 * sum(self.weights[n].nbytes for _, _, n in uses),
                            bytes_in=sum(self.weights[n].nbytes for _, _, n in uses))
            if control["checkpoint"] is not None:
                writer = CheckpointWriter(self.model_dir, control["checkpoint"])
                table = writer.write_shard(self.index, self.weights, self.state, sparse=self.sparse)
                self.comm.send(table, dest=coordinator, tag=msg.tag(msg.REPORT, 2))
            if step >= self.start_step:
                self.step_done(step)


class Coordinator(Role):
    """Drives the steps: gathers losses and norms, sets lr and clipping, logs, orders checkpoints."""

    def run(self):
        import yaml

        from data_tools.checkpoint import CheckpointWriter
        from wse_core.optim import clip_coefficient, make_schedule

        o, r = self.params["optimizer"], self.params["runconfig"]
        schedule = make_schedule(o["learning_rate"], key="optimizer.learning_rate")
        names = self.model.param_names
        metrics = LineLog(self.run_dir.metrics)
        try:  # TensorBoard event files when a writer package is installed
            from tensorboardX import SummaryWriter

            # On a resume, TensorBoard drops what earlier runs logged after the start step.
            board = SummaryWriter(str(self.model_dir), purge_step=self.start_step + 1 if self.start_step else None)
        except ImportError:
            board = None
            if self.start_step < self.max_steps:
                print("TensorBoard: tensorboardX is not installed (pip install tensorboardx); "
                      "metrics are in metrics.jsonl", flush=True)
        params_yaml = yaml.safe_dump(self.params, sort_keys=False)
        t_start = time.perf_counter()

        def control(lr, grad_scale, save_step):
            """Send MemoryX the update to apply, and whether to write a checkpoint after it."""
            writer = CheckpointWriter(self.model_dir, save_step).prepare() if save_step is not None else None
            for rank in self.plan.memoryx:
                self.comm.send({"lr": lr, "grad_scale": grad_scale, "checkpoint": save_step}, dest=rank,
                               tag=msg.tag(msg.CONTROL))
            if writer is None:
                return
            tables = [msg.recv_object(self.comm, rank, msg.tag(msg.REPORT, 2),
                                      f"MemoryX rank {rank} (checkpoint shard of step {save_step})")
                      for rank in self.plan.memoryx]
            path = writer.commit(tables, params_yaml=params_yaml,
                                 loader_state={"step": save_step, "stream_position": save_step * self.batch_size},
                                 rng_state={"seed": r["seed"], "shuffle_seed": self.params["train_input"]["shuffle_seed"]})
            print(f"saved checkpoint {path}", flush=True)

        initial = self.start_step == 0 and r["save_initial_checkpoint"]
        control(0.0, 0.0, 0 if initial else None)
        t0 = time.perf_counter()
        for step in range(self.start_step, self.max_steps):
            reports = [msg.recv_object(self.comm, rank, msg.tag(msg.REPORT), f"CS-2 rank {rank} (loss of step {step})")
                       for rank in self.plan.csx]
            loss_sum = tree_sum([x[0] for x in reports])
            n_tokens = sum(x[1] for x in reports)
            if n_tokens < 1:
                raise ValueError(f"step {step}: the loss mask of the global batch selects no token")
            sumsq = {}
            for rank in self.plan.memoryx:
                sumsq.update(msg.recv_object(self.comm, rank, msg.tag(msg.REPORT, 1),
                                             f"MemoryX rank {rank} (gradient norms of step {step})"))
            total = 0.0
            for n in names:  # parameter order, exactly as global_norm adds them
                total += sumsq[n]
            norm = math.sqrt(total) / n_tokens
            coef = 1.0 if o["max_gradient_norm"] is None else clip_coefficient(norm, o["max_gradient_norm"])
            lr = schedule(step)
            last = step + 1 == self.max_steps
            save = bool(r["checkpoint_steps"] and (step + 1) % r["checkpoint_steps"] == 0) or last
            dt = time.perf_counter() - t0  # since the previous step's update was ordered: one step period
            record = {"step": step + 1, "loss": loss_sum / n_tokens, "tokens": n_tokens, "grad_norm": norm,
                      "lr": lr, "step_seconds": dt, "samples_per_s": self.batch_size / dt,
                      "elapsed_seconds": time.perf_counter() - t_start}
            metrics.write(json.dumps(record) + "\n")
            if board is not None:
                for key in ("loss", "grad_norm", "lr", "samples_per_s"):
                    board.add_scalar(f"train/{key}", record[key], step + 1)
            if (step + 1) % r["log_steps"] == 0 or last or step == self.start_step:
                print(f"step {step + 1:>5}/{self.max_steps}  loss {record['loss']:.4f}  "
                      f"grad_norm {norm:.3f}  lr {lr:.2e}  {record['samples_per_s']:.1f} samples/s", flush=True)
            control(lr, coef / n_tokens, step + 1 if save else None)
            t0 = time.perf_counter()
            self.step_done(step)
        metrics.close()
        if board is not None:
            board.close()


ROLES = {"coordinator": Coordinator, "memoryx": MemoryX, "swarmx": SwarmX, "csx": CS2, "worker": InputWorker}
