"""One DataExecutor's run: the traced step captured, its batches as a dataset, the job that trains.

On the traced step's first call the run captures it (``wse_core.compiler``: the model, the loss
and what the step hands Python as one graph, cut into streaming units) and writes, under
``artifact_dir/run_<n>/``: ``program.pt2`` (the units and the model's initial weights), ``data/``
(the tensors the step reads of the executor's batches, in order, as a dataset of the project's
``tensors`` layout), ``params.yaml`` (the model
family ``torch`` and its precision, the optimizer's and scheduler's settings, the backend's
cluster) and ``model/`` (the run's model_dir: metrics, checkpoints, logs). A CSX backend then runs
the job (``pyapi.Job.fit``, MPI ranks) in a thread of this process, whose output goes to ``run.log``, or
queues it on a running appliance (``backend(..., appliance=SOCKET)``: ``Job.submit``) and waits
for it in that thread; a CPU
backend runs the reference's steps (``wse_core.nn.reference``) in this process, one per call: the
bits the cluster gives. Each call returns what its step returns once the step is done; the model
gets the trained weights, and the optimizer the cluster's state, at checkpoints and at the end.

Resuming: an optimizer given a saved state (``load_state_dict``) whose ``step`` is k starts the
run at step k + 1 (the model holds the saved weights, the program takes them): the run's
``model/`` gets a checkpoint of step k made from them, which the job resumes from as from any
checkpoint, and the dataset is written rotated by k batches (the cluster reads step k + i's batch
at position (k + i) x batch size): the executor's i-th batch is still step k + i's. Schedules and
dropout follow the global step, and a GradScaler given a saved state resumes its dynamic loss
scale, so a run stopped at a checkpoint and resumed gives the bits of one that never stopped.
"""
import contextlib
import json
import os
import sys
import threading

import numpy as np
import torch
import yaml

from data_tools.checkpoint import Checkpoint, CheckpointWriter
from data_tools.files import write_text
from data_tools.lmdata import DATA_PARAMS, write_tensors_file
from pyapi.cstorch.backends import flagged_micro_batch_size
from pyapi.cstorch.call import Call, traced_module
from pyapi.cstorch.cpu import InProcess
from pyapi.cstorch.errors import JobError, not_built
from pyapi.cstorch.step import handed, names_closures, ops_of, record, run_closures, with_values
from pyapi.job import Job
from pyapi.params import validate
from wse_core.checks import plural
from wse_core.compiler import CompileError, capture, partition
from wse_core.errors import ConfigError, DataError
from wse_core.numerics import environment
# Imported where used: the kernels (wse_core.compiler.model, wse_core.models, wse_core.optim,
# mpi_launch.resolved), which importing the package does not load; tensorboardX (optional).

#: Seconds between looks at the job's metrics while a step is awaited (a sleep, not a spin: the
#: ranks need the cores).
POLL_S = 0.05


def _op_text(ops, i):
    """Op i of an ``ops_of`` list, as a message shows it: its name, output shape and numbers."""
    if i >= len(ops):
        return "the end"
    name, shape, numbers = ops[i]
    return f"{name} {list(shape)}" + (f" of {', '.join(map(repr, numbers))}" if numbers else "")


@contextlib.contextmanager
def _buffers_kept(model):
    """The model's buffers as they were before the block: running the step's Python to capture or
    check it (BatchNorm's ``num_batches_tracked += 1``) must not change the model's state, which the
    cluster's steps alone move."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


class Run:
    def __init__(self, backend, executor, batches):
        self.backend, self.executor, self.batches = backend, executor, batches
        root = backend.artifact_dir
        root.mkdir(parents=True, exist_ok=True)
        n = 0
        while True:  # the first free run_<n>; mkdir decides, so two scripts never share one
            try:
                (root / f"run_{n}").mkdir()
                break
            except FileExistsError:
                n += 1
        self.dir = root / f"run_{n}"
        self.started, self.thread, self.failure, self.cpu, self.handle, self.fn = False, None, None, None, None, None
        self.start = 0  # the step the run resumes from (the optimizer's loaded state's)
        self.spec = None  # a training run's params (``_params``), validated once
        self.model_dir = self.dir / "model"
        self.losses = {}
        self._metrics = (None, 0)  # (inode, bytes read) of the job's metrics.jsonl
        self.board = None  # summarize_scalar's TensorBoard writer, made when first needed
        self.evaluator = None  # the compiled model an evaluation loop runs (``_start_eval``)
        self.scaler = None  # the GradScaler the traced step steps with, which keeps the cluster's loss scale
        self.batch_norms = ()  # the model's BatchNorms in training (``capture.Graph.batch_norms``)
        self.loss_scaler = None  # a replica of the cluster's loss scaler, moved by each step's skip
        self.stop = threading.Event()  # set when the loop is left early: the job of this process ends

    # -- the first call: capture, data, params, start ---------------------------------------------

    def step(self, fn, args, kwargs, step):
        batch = self.batches[step - 1]
        if not self.started:
            self.call = Call(fn.__name__, args, kwargs, batch)
            self._start(fn)
            self.fn = fn
            with _buffers_kept(self.user_model):
                self.ops, rec, out = ops_of(fn, *self.call.arguments(self.call.graph_inputs(batch)))
            self.template = rec, out
            # its closures take each step's Python values, on whichever steps it calls them
            self.every_step = bool(rec.closures) or names_closures(fn)
        elif fn is not self.fn:
            raise not_built(f"{fn.__name__}: a second traced function in one DataExecutor loop",
                            f"one traced step, {self.fn.__name__}")
        else:
            call = self.call.check(args, kwargs, batch, step)
            if self.every_step or (step - 1) & (step - 2) == 0 or step == self.executor.num_steps \
                    or not call.same_values(self.call):
                # steps 2, 3, 5, 9, 17, ... and the last; every step when the step calls closures, and
                # a step given other Python values than step 1's (the graph holds step 1's)
                rec, out = self._check_same_graph(fn, call, step)
            else:
                rec, out = self.template
        if not self.backend.is_e2e_execution:  # nothing ran: NaN (or 0) values, no closure
            return with_values(out, {id(t): torch.full(t.shape, float("nan"), dtype=t.dtype) if t.is_floating_point()
                                     else torch.zeros(t.shape, dtype=t.dtype)
                                     for t in [rec.loss, *handed(rec, out)] if t is not None})
        loss, values, micro_batches, skipped = self._values(self.start + step)
        if self.evaluator is None:
            self._schedule_seen(self.start + step)
        if self.loss_scaler is not None:  # the scaler's state after this step, as the coordinator's
            self.loss_scaler.update(float("inf") if skipped else 0.0)
            self.scaler.cluster_state = self.loss_scaler.state()
        if self.batch_norms:  # their statistics come last: the model's running statistics take them
            values, stats = values[:-2 * len(self.batch_norms)], values[-2 * len(self.batch_norms):]
            self._update_batch_norms(stats, micro_batches)
        tensors = handed(rec, out)
        if len(tensors) != len(values):
            raise not_built(f"{fn.__name__}: at step {step} it hands Python {len(tensors)} tensors (returned, or "
                            f"given to step closures and summaries), at step 1 {len(values)}",
                            "the same tensors on every step: return them, and give closures what it returns")
        real = {id(t): torch.as_tensor(v, dtype=t.dtype) for t, v in zip(tensors, values)}
        if rec.loss is not None:
            real[id(rec.loss)] = torch.tensor(loss, dtype=torch.float32)
        # Closures run on the steps whose values are fetched (activation_steps); a metric's every step.
        run_closures([c for c in rec.closures if self.executor.on_activation_step
                      or getattr(c[0], "_every_step", False)], real)
        return with_values(out, real)

    def _schedule_seen(self, step):
        """The optimizer and its scheduler after global step ``step``, as torch's: each group's ``lr`` the
        next step's rate (what the cluster will use), ``get_last_lr`` too. (``last_epoch``, which a
        state dict holds, moves with the optimizer's state: at checkpoints and the loop's end.)"""
        sched = self.optimizer.lr_scheduler
        if sched is not None:
            sched.seen = step
            for group, rate in zip(self.optimizer.param_groups, sched.get_last_lr()):
                group["lr"] = rate

    def _update_batch_norms(self, stats, micro_batches):
        """The model's BatchNorms' running statistics after a step of ``micro_batches``: r = (1 - m)^M r
        + the step's combined statistics (``loss.combination``'s "ema"), as M updates of eager
        PyTorch; ``num_batches_tracked`` counts the micro-batches."""
        with torch.no_grad():
            for (path, momentum, _, _), mean, var in zip(self.batch_norms, stats[0::2], stats[1::2]):
                bn = self.user_model.get_submodule(path.removeprefix("model.model."))
                decay = (1 - momentum) ** micro_batches
                for buffer, value in ((bn.running_mean, mean), (bn.running_var, var)):
                    buffer.mul_(decay).add_(torch.as_tensor(value, dtype=buffer.dtype))
                bn.num_batches_tracked.add_(micro_batches)

    def _check_same_graph(self, fn, call, step):
        """The step's Python runs the ops it ran when captured (its graph is the cluster's on every
        step): a step that takes another path (a Python decision on the step count, a flag) is one
        line. Checked on fake tensors, at steps 2, 3, 5, 9, ... (2^k + 1) and the last: a check costs
        about a tenth of an eager forward pass. Returns its recording (its closures, its loss) and
        its return value."""
        with _buffers_kept(self.user_model):
            ops, rec, out = ops_of(fn, *call.arguments(call.graph_inputs(self.batches[step - 1])))
        if ops != self.ops:
            i = next((i for i, (a, b) in enumerate(zip(ops, self.ops)) if a != b), min(len(ops), len(self.ops)))
            now, was = (_op_text(o, i) for o in (ops, self.ops))
            raise not_built(f"{fn.__name__}: the step's graph changed at step {step} (its op {i + 1} is {now}; "
                            f"captured: {was})", "a step that runs the same ops on every step")
        return rec, out

    def _start(self, fn):
        from wse_core.compiler.model import save_program

        if not self.backend.models:
            raise RuntimeError("cstorch.compile(model, backend) first: the traced step trains the compiled model")
        model = self.backend.models[0]
        for k in self.call.inputs:
            if self.batches[0].leaves[k].dtype == torch.bfloat16:
                raise not_built(f"DataLoader: the batch's {self.batches[0].paths[k]} is bfloat16",
                                "batches of float32, float16 and integer tensors (cast in the traced step)")
        inputs = tuple(self.call.graph_inputs(self.batches[0]))
        if not inputs:
            raise not_built(f"{fn.__name__}: a traced step given none of the batch's tensors",
                            "a step of the executor's batch")
        print(f"cstorch: capturing {fn.__name__} (torch.export) and cutting it into streaming units", file=sys.stderr,
              flush=True)
        with record(fn) as rec, _buffers_kept(model):
            try:
                graph = capture(traced_module(fn, model, self.call), inputs)
            except CompileError as exc:  # its module paths start at the traced step: "model.model.net.1"
                raise CompileError(str(exc).replace("model.model.", "model.").replace("model.model:", "model:")) \
                    from None
        self.user_model = model
        self._fp16_type = rec.fp16_type
        others = {p.data_ptr(): name for m in self.backend.models[1:] for name, p in m.named_parameters()}
        for value in graph.program.constants.values():  # a tensor the step reads from outside the model
            if isinstance(value, torch.Tensor) and value.data_ptr() in others:
                raise not_built(f"{fn.__name__}: it reads the weights of another compiled model "
                                f"({others[value.data_ptr()]}, {list(value.shape)})",
                                "one model a step, the last cstorch.compile'd")
        if not rec.optimizers and not rec.backward:
            if not self.backend.is_e2e_execution:
                self.started = True
                self._dry(graph)
            else:
                self._start_eval(graph)
            return
        if len(rec.optimizers) != 1:
            raise ConfigError(f"the traced step called optimizer.step() on {len(rec.optimizers)} optimizers; "
                              "it trains with one")
        if rec.loss is None:
            raise ConfigError(f"{fn.__name__}: calls optimizer.step() but no loss.backward() (or "
                              "cstorch.amp.optimizer_step): nothing to train")
        optimizer = rec.optimizers[0]
        _check_trained(model, optimizer)
        self.batch_norms = graph.batch_norms
        program = self.dir / "program.pt2"
        by_tensor = optimizer.groups()
        save_program(graph, partition(graph), program, layout="tensors",
                     groups={name: by_tensor[id(p)] for name, p in graph.params.items()})
        self.optimizer, self.param_of = optimizer, dict(graph.params)
        self.start = _resumed_step(optimizer, self.executor.checkpoint_steps)
        params = self._params(str(program), rec)
        write_text(self.dir / "params.yaml", yaml.safe_dump(params, sort_keys=False))
        self.spec = validate(params)
        self.started = True
        self._say_bits()
        if not self.backend.is_e2e_execution:
            self._dry(graph)
            return
        resumed = self._resumed_state() if self.start else None
        self.scaler = rec.scaler
        scale = self.scaler.resumed_state() if self.start and self.scaler is not None else None
        if self.scaler is not None:  # follows the cluster's loss scaler step by step (``step``)
            from wse_core.optim.loss_scale import LossScaler

            self.loss_scaler = LossScaler.from_params(self.spec.optimizer, rec.fp16_type)
            self.loss_scaler.load(scale)
            self.scaler.cluster_state = self.loss_scaler.state()
        if self.backend.is_csx:
            if resumed is not None:
                _write_checkpoint(self.model_dir, self.start, *resumed, scale)
            self._start_job()
        else:
            self.cpu = InProcess(self.spec, self.start, resumed, scale)

    def _params(self, program, rec):
        optimizer = rec.optimizers[0].spec()
        optimizer.update(rec.settings)
        model = {"name": "torch", "program": program}
        if rec.fp16_type is not None:  # cstorch.amp: a half dtype set, or autocast() in the step
            if rec.fp16_type == "cbfloat16" and optimizer.get("loss_scaling_factor") != "dynamic":
                raise ConfigError("cstorch.amp: the half dtype cbfloat16 needs dynamic loss scaling (as in Model Zoo): "
                                  "step with cstorch.amp.GradScaler(loss_scale='dynamic')")
            model.update(mixed_precision=True, fp16_type=rec.fp16_type)
        data = self.dir / "data"
        data.mkdir()
        k = self.start % len(self.batches)  # rotated: position (start + i) x batch holds the i-th batch
        _write_dataset(data, self.batches[-k:] + self.batches[:-k] if k else self.batches, self.call)
        b = len(self.batches[0].leaves[0])
        mbs = self.executor.micro_batch_size or self.backend.micro_batch_size or flagged_micro_batch_size()
        runconfig = {"max_steps": self.start + self.executor.num_steps, "model_dir": str(self.model_dir),
                     "checkpoint_steps": self.executor.checkpoint_steps or 0, **self.backend.run_config()}
        train = {"data_dir": str(data), "batch_size": b, "shuffle": False}
        if mbs is not None:
            train["micro_batch_size"] = mbs
        return {"train_input": train, "model": model, "optimizer": optimizer, "runconfig": runconfig}

    def _start_job(self):
        job = Job(self.spec)
        target = self.backend.appliance
        # Queued on the appliance here, in this thread: a refusal (no appliance, a bad request) is the
        # loop's error at once; the thread then waits for the job's end, as it waits for a job of its own.
        handle = self.handle = job.submit(socket=None if target is True else target, name="cstorch") if target else None

        def run():
            with open(self.dir / "run.log", "w") as file:
                log = _StartSaid(file)
                try:
                    if handle is None:
                        job.fit(stream=log, stop=self.stop)
                    else:
                        log.write(f"queued on the appliance as job {handle.id}\n")
                        try:
                            handle.wait()
                        finally:  # a failed job's log says why
                            log.write(handle.logs())
                except Exception as exc:  # the job's one line, said to the user's loop (JobError) and in the log
                    self.failure = str(exc)
                    file.write(f"{exc}\n")  # not through log: the loop's error says it, once

        self.thread = threading.Thread(target=run, name="wse-cstorch-job", daemon=True)
        self.thread.start()

    def _say_bits(self):
        """One line when the step's bits depend on the micro-batch size: an op left to torch sums over
        the micro-batch (docs/design/compiler.md "Lowering")."""
        from wse_core.models import build_model  # loads the kernels: not when the package is imported

        why = build_model(self.spec.model).batch_dependent
        if why:
            print(f"cstorch: the same bits on every backend at micro_batch_size {self.spec.train_input.micro_batch_size} "
                  f"only: {why}", flush=True)

    def _dry(self, graph):
        """A compile (the plan and its checks, ``wse compile``'s) or a validation (the capture): said in a
        line; nothing runs."""
        if self.spec is None:  # an evaluation step: nothing to plan
            print(f"cstorch: {'compiled' if self.backend.compile_only else 'validated'}: the evaluation step captured "
                  f"as {len(graph.outputs)} output(s); nothing ran", flush=True)
        elif self.backend.compile_only:
            from mpi_launch.resolved import describe, resolve

            d = describe(resolve(self.spec))
            sim, plan = d["simulated"], d["plan"]
            print(f"cstorch: compiled: {plural(len(d['model']['units']), 'streaming unit')}, "
                  f"{plural(plan['num_csx'], 'CS-2')}, "
                  f"{plan['world_size']} MPI ranks; simulated step {sim['step_s'] * 1e3:.3f} ms "
                  f"(`wse compile {self.dir / 'params.yaml'}` prints the whole plan); nothing ran", flush=True)
        else:
            print(f"cstorch: validated: the step captured as {len(graph.outputs)} output(s); nothing ran",
                  flush=True)

    def _start_eval(self, graph):
        """An evaluation loop: the program of the model as it is now (its weights, its mode: call
        ``eval()`` first, as for eager PyTorch), each step's values (its loss, its metrics) its
        forward pass over the step's batch in this process, as the cluster's own evaluations run on
        the host (``Job.validate``, the coordinator's ``Evaluations``): the same units, the same
        numerics."""
        from wse_core.compiler.model import save_program
        from wse_core.models import build_model

        for path, m in self.user_model.named_modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats:
                raise not_built(f"an evaluation step with model.{path} ({type(m).__name__}) in training mode (it "
                                "would update its running statistics)", "call model.eval() before the evaluation loop")
        program = self.dir / "program.pt2"
        save_program(graph, partition(graph, training=False), program, layout="tensors")
        model = {"name": "torch", "program": str(program)}
        if self._fp16_type is not None:  # the run's precision, as for training
            model.update(mixed_precision=True, fp16_type=self._fp16_type)
        self.evaluator = build_model(model)
        self.evaluator.check_evaluable()
        self.model_dir.mkdir(parents=True)
        self.started = True

    # -- each step ------------------------------------------------------------------------------

    def _values(self, step):
        """(the loss, or None for an evaluation; the values of the tensors the step hands Python, then
        its BatchNorms' statistics; the micro-batches they were combined over) of global step
        ``step``, once the cluster (or this process) has computed them."""
        if self.evaluator is not None:
            return None, self._evaluate(step), 1, False
        if self.cpu is not None:
            self._advance_cpu(step)
        else:
            self._await(lambda: step in self._read_losses(), f"step {step}")
        return self.losses[step]

    def _evaluate(self, step):
        """Step ``step``'s values: the forward pass over its whole batch (one micro-batch, as eager
        PyTorch's) in this process; a scalar among them is written to the run's ``metrics.jsonl``."""
        m = self.evaluator
        batch = m.batch_of([t.detach().cpu().numpy() for t in self.call.graph_inputs(self.batches[step - 1])])
        values = m.evaluation_values(m.initial, batch)
        scalars = [float(v) for v in values if np.ndim(v) == 0]
        with open(self.model_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "eval_values": scalars}) + "\n")
        return values

    def _read_losses(self):
        """The steps the job has finished, from the lines of its metrics.jsonl written since the last
        read (a line being written is read next time; a file replaced, as a resume's start rewrites
        it, is read again from its start)."""
        path = self.model_dir / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._metrics[0] or st.st_size < self._metrics[1]:
                    self._metrics = (st.st_ino, 0)
                f.seek(self._metrics[1])
                text = f.read()
        except FileNotFoundError:
            return self.losses
        done = text[:text.rfind(b"\n") + 1]
        self._metrics = (self._metrics[0], self._metrics[1] + len(done))
        for line in done.decode().splitlines():
            r = json.loads(line)
            if "loss" in r:
                self.losses[r["step"]] = (r["loss"], r.get("values", []), r.get("micro_batches", 1),
                                          r.get("skipped", False))
        return self.losses

    def _await(self, ready, what):
        """Until ``ready()``: waiting on the job's thread (it returns at once when the job ends), never spinning."""
        while not ready():
            self.thread.join(POLL_S)
            if not self.thread.is_alive() and not ready():
                if self.failure is not None:
                    raise JobError(self.failure, self.dir / "run.log")
                raise JobError(f"the cluster's job ended before {what} (log: {self.dir / 'run.log'})",
                               self.dir / "run.log")

    def _advance_cpu(self, step):
        while self.cpu.step < step:
            r = self.cpu.advance()
            self.losses[self.cpu.step] = r.loss, r.values, r.micro_batches, r.skipped

    def sync_weights(self, step):
        """The user's model holds the weights of the executor's ``step`` (a checkpoint step, or the
        last), and its optimizer the cluster's state."""
        if not self.started:
            raise RuntimeError(f"step {step}: no weights yet; call the traced step before the checkpoint closure")
        step += self.start
        if self.cpu is not None:
            self._advance_cpu(step)
            weights, state = self.cpu.params, self.cpu.state
        else:
            path = self.model_dir / f"checkpoint_{step}"
            self._await(lambda: (path / "index.h5").exists(), f"the checkpoint of step {step}")
            weights, state = Checkpoint(path).load()
        _load_into(self.user_model, weights)
        self.optimizer.state = {self.param_of[n]: {"step": torch.tensor(float(step)),
                                                   **{k: torch.from_numpy(np.array(v)) for k, v in st.items()}}
                                for n, st in state.items()}
        if self.optimizer.lr_scheduler is not None:
            self.optimizer.lr_scheduler.last_epoch = step

    def _resumed_state(self):
        """(weights, optimizer state) by name of the step the run resumes from: the model's and the
        optimizer's loaded ones."""
        from wse_core.compiler.model import load_program

        names = self.spec.optimizer.optimizer().state_names
        weights = {n: w.numpy() for n, w in load_program(self.spec.model["program"])["weights"].items()}
        state = {}
        for n, p in self.param_of.items():
            st = self.optimizer.state.get(p, {})
            missing = [k for k in names if k not in st]
            if missing:
                raise DataError(f"optimizer.load_state_dict: the state of model.{n.removeprefix('model.')} has no "
                                f"{missing[0]!r} (a {self.spec.optimizer.optimizer_type} resumes from one)")
            state[n] = {k: np.ascontiguousarray(st[k].detach().cpu().numpy(), dtype=np.float32) for k in names}
        return weights, state

    def summarize(self, name, value, step):
        """A scalar in TensorBoard, beside the run's own (model_dir/train), when tensorboardX is installed;
        always in ``summaries.jsonl``."""
        with open(self.dir / "summaries.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "name": name, "value": value}) + "\n")
        if self.board is None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                self.board = False
            else:
                self.board = SummaryWriter(str(self.model_dir / "train"), filename_suffix=".cstorch")
        if self.board:
            self.board.add_scalar(name, value, step)
            self.board.flush()

    def finish(self):
        if not self.started or self.evaluator is not None or not self.backend.is_e2e_execution:
            return  # an evaluation changes no weight; a compile runs nothing
        if self.thread is not None:
            self.thread.join()
            if self.failure is not None:
                raise JobError(self.failure, self.dir / "run.log")
        self.sync_weights(self.executor.num_steps)

    def close(self):
        """After the loop, however it ended. A job not done is ended: cancelled on the appliance, or
        stopped (its ranks ended by the launcher, as for a fault) when it is this process's own; the
        checkpoints it wrote stay."""
        if self.thread is not None and self.thread.is_alive():
            if self.handle is not None:
                self.handle.cancel()
            else:
                self.stop.set()
        if self.thread is not None:
            self.thread.join()
        if self.cpu is not None:
            self.cpu.stream.close()
        if self.board:
            self.board.close()


def _resumed_step(optimizer, checkpoint_steps):
    """The step a run starts from: the optimizer's loaded state's (0 for a fresh one); its scheduler's
    ``last_epoch``, when loaded, must agree."""
    steps = {int(st["step"]) for st in optimizer.state.values() if "step" in st}
    if len(steps) > 1:
        raise DataError(f"optimizer.load_state_dict: the parameters' states are of steps {sorted(steps)}; a run "
                        "resumes from one step")
    start = steps.pop() if steps else 0
    sched = optimizer.lr_scheduler
    if sched is not None and sched.last_epoch not in (0, start):
        raise DataError(f"lr_scheduler.load_state_dict: last_epoch {sched.last_epoch}, the optimizer's state is of "
                        f"step {start}: load both from one checkpoint")
    if start and checkpoint_steps and start % checkpoint_steps:
        raise not_built(f"DataExecutor(checkpoint_steps={checkpoint_steps}) resuming from step {start}",
                        "checkpoint_steps that divide the step resumed from (the cluster checkpoints at its "
                        "multiples)")
    return start


def _write_checkpoint(model_dir, step, weights, state, loss_scale=None):
    """The run's first checkpoint, of the step it resumes from: the job resumes from ``latest``."""
    model_dir.mkdir(parents=True, exist_ok=True)
    writer = CheckpointWriter(model_dir, step).prepare()
    writer.commit([writer.write_shard(0, weights, state)], numerics=environment(), loss_scale=loss_scale)


def _check_trained(model, optimizer):
    """The optimizer trains the model's parameters, all of them: MemoryX updates every one it holds."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            raise not_built(f"model.{name}: a frozen parameter (requires_grad=False)", "every parameter trains")
        if id(p) not in held:
            raise not_built(f"model.{name}: a parameter the optimizer does not hold",
                            "the optimizer takes model.parameters()")


def _load_into(model, weights):
    """Copy the run's weights (named "model.<name>", by owner) into the user's module."""
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in weights.items():
            own[name[len("model."):]].copy_(torch.from_numpy(np.asarray(w)))


def _write_dataset(data, batches, call):
    """The batches' tensors the step reads (``Call.graph_inputs``), in order, as one file of the
    project's ``tensors`` layout, with its data_params.json."""
    rows = [call.graph_inputs(b) for b in batches]
    columns = [np.concatenate([r[i].detach().cpu().numpy() for r in rows]) for i in range(len(call.inputs))]
    write_tensors_file(data / "data-00000.h5", columns)
    n = len(columns[0])
    meta = {"format": "tensors", "n_examples": n, "files": [{"name": "data-00000.h5", "n_examples": n}],
            "columns": [{"dtype": c.dtype.str, "shape": list(c.shape[1:])} for c in columns]}
    write_text(data / DATA_PARAMS, json.dumps(meta))


class _StartSaid:
    """The job's output stream (``run.log``) that also says its lines before the first step on stderr:
    the ranks starting and ready, a start-up of seconds that was a silence of the user's loop."""

    def __init__(self, log):
        self.log, self.starting = log, True
        self.where = f" (log: {os.path.relpath(log.name)})"  # said once, on the first line

    def write(self, text):
        self.log.write(text)
        if self.starting:
            for line in text.splitlines():
                if line.startswith("step "):
                    self.starting = False
                    break
                if line.strip():
                    print(f"cstorch: {line}{self.where}", file=sys.stderr, flush=True)
                    self.where = ""
                # an appliance's job: its lines come at its end, in the log
                self.starting = not line.startswith("queued ")

    def flush(self):
        self.log.flush()
