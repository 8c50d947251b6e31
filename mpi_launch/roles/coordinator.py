"""The coordinator: drives the steps, gathers losses and norms, sets lr and clipping, logs, orders checkpoints.

Simulated time: its clock follows the losses and gradient norms it receives; it sends each step's
control message at that time, so the gap between two control messages is a step of the emulated
hardware (``sim_step_s`` in metrics.jsonl, with its parts; docs/design/time-model.md "The clock").

Its messages (``mpi_launch.protocol``): it sends STEP["control"] and STEP["loss scale"], and
receives STEP["loss"], STEP["norms"], STEP["step time"], STEP["shard"] and STEP["eval weights"]."""
import json
import math
import statistics
import time

from mpi_launch.protocol import CONTROL, EVAL_WEIGHTS, LOSS, NORMS, REPORT, SHARD, STEP_TIME, Control, LossScale
from mpi_launch.roles.base import Role
from mpi_launch.rundir import LineLog
from wse_core.errors import DataError
from wse_core.microbatch import tree_sum


class Coordinator(Role):
    """Drives the steps from rank 0. A step: the CS-2s' losses and MemoryX's gradient norms in
    (``_losses``, ``_norms``), the update ordered (``_control``), then the step's books (``_books``);
    what the update is to be followed by comes last (``_checkpoint``, ``Evaluations``)."""

    def run(self):
        self.link.off_path()  # it waits a whole step for the CS-2s' reports
        self._prepare()
        initial = self.start_step == 0 and self.params.runconfig.save_initial_checkpoint
        self._overflows = []  # (step, scale before, scale after) of the skipped steps in a row, said in one line
        self._send_loss_scale(self.start_step)
        self._control(0.0, 0.0, 0 if initial else None)()
        self._t0, self._sim_t0 = time.perf_counter(), self.clock.now
        for step in range(self.start_step, self.max_steps):
            self._step(step)
        self._evaluations.finish()
        self._metrics.close()
        if self._board is not None:
            for writer in self._board.values():
                writer.close()

    def _prepare(self):
        """What the steps need: the learning-rate schedule, the books (metrics.jsonl, TensorBoard,
        evaluations), what a checkpoint records besides the weights, the parts of a simulated step
        that do not change, and the loss scaler (a resume's from its checkpoint)."""
        import yaml

        from data_tools.checkpoint import Checkpoint
        from wse_core.numerics import environment
        from wse_core.optim import make_schedule
        from wse_core.optim.loss_scale import LossScaler

        self._schedule = make_schedule(self.params.optimizer.learning_rate, key="optimizer.learning_rate")
        self._metrics = LineLog(self.run_dir.metrics)
        self._board = self._open_board()
        self._evaluations = Evaluations(self, self._metrics, self._board)
        self._params_yaml = yaml.safe_dump(self.params.to_dict(), sort_keys=False)
        self._numerics = environment()  # what the checkpoints' weights were computed in (a resume compares)
        self._stream_s, self._optimizer_s = self._fixed_parts()
        self._t_start = time.perf_counter()
        self._scaler = LossScaler.from_params(self.params.optimizer, self.model.config.get("fp16_type"))
        if self.run_info["checkpoint"]:
            self._scaler.load(Checkpoint(self.run_info["checkpoint"]).loss_scale)

    def _open_board(self):
        """TensorBoard's writers, train/ and eval/ as Model Zoo's, when a writer package is installed;
        None otherwise (said once)."""
        try:
            SummaryWriter = _summary_writer()

            # On a resume, TensorBoard drops what earlier runs logged after the start step.
            purge = self.start_step + 1 if self.start_step else None
            return {name: SummaryWriter(str(self.model_dir / name), purge_step=purge, flush_secs=_BOARD_FLUSH_SECONDS)
                    for name in ("train", "eval")}
        except ImportError:
            if self.start_step < self.max_steps:
                print("TensorBoard: tensorboardX is not installed (pip install 'wse-cluster[tensorboard]'); "
                      "metrics are in metrics.jsonl", flush=True)
            return None

    def _fixed_parts(self):
        """The parts of a simulated step that do not change from step to step (seconds): the weights'
        crossing of the CS-2s' I/O, and the slowest MemoryX's update."""
        from wse_core.perf.step import io_seconds, update_seconds

        if self.plan.pipeline:  # no weights cross the I/O; every region updates its own at once
            return 0.0, self.resolved.placement.update_s
        return (io_seconds(self.model, self.hw, self.n_micro),
                max(update_seconds(self.model, self.plan.unit_owner, self.hw)))

    def _step(self, step):
        """One step: the reports in, the update out (its clipping, scale and learning rate), then the
        step's books; what follows the update (a checkpoint, an evaluation) is taken last."""
        from wse_core.optim import clip_coefficient

        o, r, scaler = self.params.optimizer, self.params.runconfig, self._scaler
        reports, loss_sum, n_tokens = self._losses(step)
        # The CS-2s report once their last gradients have left; MemoryX's norms come a few ms
        # later, and its update waits for the answer to them: that wait is on the step's path.
        times = [self.link.recv_object(rank, self.link.tag(REPORT, 0, STEP_TIME), f"CS-2 rank {rank} (step {step})")
                 for rank in self.plan.csx]
        total, at, left = self._norms(step)
        divisor = self.model.loss_divisor(n_tokens, self.batch_size)  # as the reference step
        loss_scale = scaler.scale
        norm = math.sqrt(total) / divisor / loss_scale
        skipped = scaler.update(norm)
        coef = 1.0 if skipped or o.max_gradient_norm is None else clip_coefficient(norm, o.max_gradient_norm)
        lr = self._schedule(step)
        last = step + 1 == self.max_steps
        save = bool(r.checkpoint_steps and (step + 1) % r.checkpoint_steps == 0) or last
        record = self._record(step, reports, times, loss=loss_sum / divisor, n_tokens=n_tokens, norm=norm, lr=lr,
                              reduce_tail=at - left, loss_scale=loss_scale, skipped=skipped)
        self._send_loss_scale(step + 1)
        evaluate = bool(r.eval_frequency) and ((step + 1) % r.eval_frequency == 0 or last)
        finish = self._control(lr, coef / divisor / loss_scale, step + 1 if save else None, skipped,
                               step + 1 if evaluate else None)
        self._t0, self._sim_t0 = time.perf_counter(), self.clock.now
        self._books(step, record, loss_scale, skipped, last)
        finish()
        self._evaluations.report()
        self.step_done(step)

    def _losses(self, step):
        """Every CS-2's losses of the step; returns them, the global batch's loss sum and its tokens."""
        lat = self.hw.swarmx_hop_latency_s
        reports = [self.link.recv_object(rank, self.link.tag(REPORT, 0, LOSS),
                                         f"CS-2 rank {rank} (loss of step {step})") for rank in self.plan.csx]
        for x in reports:
            self.clock.receive(x.t + lat)
        # Every micro-batch's loss sum in the global batch's order (MicroBatches.index),
        # summed as the reference step sums them.
        loss_sum = tree_sum([x.loss_sums[r] for r in range(len(reports[0].loss_sums)) for x in reports])
        n_tokens = sum(x.tokens for x in reports)
        if n_tokens < 1:
            raise DataError(f"step {step}: the loss mask of the global batch selects no token")
        return reports, loss_sum, n_tokens

    def _norms(self, step):
        """Every MemoryX's gradient norms of the step, waited for on the step's path; returns the sum
        of squares of every gradient, when the last gradient reached MemoryX and when it left a CS-2."""
        lat = self.hw.swarmx_hop_latency_s
        sumsq, at, left = {}, 0.0, 0.0
        with self.link.on_path():
            for rank in self.plan.memoryx:
                norms = self.link.recv_object(rank, self.link.tag(REPORT, 0, NORMS),
                                              f"MemoryX rank {rank} (gradient norms of step {step})")
                sumsq.update(norms.sumsq)
                self.clock.receive(norms.t + lat)
                at, left = max(at, norms.t), max(left, norms.left)
        total = 0.0
        for n in self.model.param_names:  # parameter order, exactly as global_norm adds them
            total += sumsq[n]
        return total, at, left

    def _record(self, step, reports, times, *, loss, n_tokens, norm, lr, reduce_tail, loss_scale, skipped):
        """The step's line of metrics.jsonl: its figures, and its period in real and simulated time."""
        dt = time.perf_counter() - self._t0  # since the previous step's update was ordered: one step period
        sim = self.clock.now - self._sim_t0  # the same period in the emulated hardware's time
        record = {"step": step + 1, "loss": loss, "tokens": n_tokens, "grad_norm": norm,
                  "lr": lr, "step_seconds": dt, "samples_per_s": self.batch_size / dt,
                  "elapsed_seconds": time.perf_counter() - self._t_start,
                  "sim_step_s": sim, "sim_samples_per_s": self.batch_size / sim,
                  "sim_compute_s": statistics.fmean(x.compute for x in times),
                  "sim_exposed_stream_s": statistics.fmean(x.waited for x in times),
                  "sim_stream_s": self._stream_s, "sim_reduce_tail_s": reduce_tail,
                  "sim_optimizer_s": self._optimizer_s}
        if self._scaler.dynamic or loss_scale != 1.0:
            record.update(loss_scale=loss_scale, skipped=skipped)
        # What else a compiled model's step hands its script, each micro-batch's in the global
        # batch's order (as the loss sums), combined by the model (``Model.combine_values``).
        parts = [x.values[r] for r in range(len(reports[0].values)) for x in reports]
        if any(v is not None for v in parts):
            record["values"] = [v.tolist() for v in self.model.combine_values(parts)]
            record["micro_batches"] = len(parts)
        return record

    def _send_loss_scale(self, step):
        """Dynamic loss scaling: the CS-2s learn the scale of ``step`` as soon as it is known."""
        if self._scaler.dynamic and step < self.max_steps:
            for rank in self.plan.csx:
                self.link.send_object(LossScale(self._scaler.scale), rank, self.link.tag(CONTROL))

    def _control(self, lr, grad_scale, save_step, skip=False, eval_step=None):
        """Send MemoryX the update to apply (or to skip), whether to write a checkpoint after it,
        and whether to send its weights for an evaluation. Returns what is left once the step's
        metrics are out (the update is on the step's critical path; the log is not): taking the
        checkpoint's shards, starting the evaluation."""
        from data_tools.checkpoint import CheckpointWriter

        writer = CheckpointWriter(self.model_dir, save_step).prepare() if save_step is not None else None
        for rank in self.plan.memoryx:
            self.link.send_object(Control(lr=lr, grad_scale=grad_scale, checkpoint=save_step, t=self.clock.now,
                                          skip=skip, evaluate=eval_step is not None), rank, self.link.tag(CONTROL))

        def finish():
            if writer is not None:
                self._checkpoint(writer, save_step)
            if eval_step is not None:
                self._evaluations.start(eval_step)
        return finish

    def _checkpoint(self, writer, save_step):
        """Every MemoryX's shard of the checkpoint of ``save_step``, committed with what resumes the run."""
        r = self.params.runconfig
        tables = [self.link.recv_object(rank, self.link.tag(REPORT, 0, SHARD),
                                        f"MemoryX rank {rank} (checkpoint shard of step {save_step})").table
                  for rank in self.plan.memoryx]
        path = writer.commit(tables, params_yaml=self._params_yaml,
                             loader_state={"step": save_step, "stream_position": save_step * self.batch_size},
                             rng_state={"seed": r.seed, "shuffle_seed": self.params.train_input.shuffle_seed},
                             loss_scale=self._scaler.state(), numerics=self._numerics)
        print(f"saved checkpoint {path}", flush=True)

    def _books(self, step, record, loss_scale, skipped, last):
        """The step's line in metrics.jsonl and TensorBoard, its overflow noted, its line printed."""
        scaler, board, overflows = self._scaler, self._board, self._overflows
        self._metrics.write(json.dumps(record) + "\n")
        if board is not None:
            for key in ("loss", "grad_norm", "lr", "samples_per_s", "sim_step_s", "sim_samples_per_s",
                        "loss_scale"):
                if key in record:
                    board["train"].add_scalar(key, record[key], step + 1)
            _flush(board["train"])
        if skipped:
            self.log(f"step {step + 1}: gradients overflowed at loss scale {loss_scale:g}: the update is "
                     f"skipped, the scale is now {scaler.scale:g}")
            overflows.append((step + 1, loss_scale, scaler.scale))
        elif overflows:  # said before this step's line: it is about the steps before it
            _say_overflows(overflows)
        if (step + 1) % self.params.runconfig.log_steps == 0 or last or step == self.start_step:
            # A skipped step's norm is not finite by definition: say what happened instead of nan.
            what = (f"skipped (overflow), loss scale "
                    f"{'halved to' if scaler.scale < loss_scale else 'stays at its minimum,'} {scaler.scale:g}"
                    if skipped else f"grad_norm {record['grad_norm']:.3f}")
            print(f"step {step + 1:>5}/{self.max_steps}  loss {record['loss']:.4f}  "
                  f"{what}  lr {record['lr']:.2e}  {record['samples_per_s']:.1f} samples/s "
                  f"(simulated: {record['sim_samples_per_s']:.1f})", flush=True)
        if last and overflows:
            _say_overflows(overflows)


def _say_overflows(overflows):
    """One line for a run of steps whose 16-bit gradients overflowed (and empty the list): a float16
    run starting at Model Zoo's 2^15 skips several steps in a row while the scale comes down, and a
    line per step buried the steps' own lines. Each step's line is in the coordinator's log."""
    (first, before, _), (end, _, after) = overflows[0], overflows[-1]
    n = len(overflows)
    steps = f"step {first}" if n == 1 else f"steps {first}-{end} ({n} in a row)"
    print(f"{steps}: gradients overflowed, {'the update was' if n == 1 else 'their updates were'} skipped; "
          f"loss scale {before:g} -> {after:g}", flush=True)
    overflows.clear()


#: How often TensorBoard's writer thread flushes its event file on its own: a day, so never in a step
#: loop (the coordinator flushes every step, ``_flush``); its wait must fit epoll's limit of 24 days.
_BOARD_FLUSH_SECONDS = 24 * 3600


def _flush(writer):
    """Write out what a TensorBoard writer holds, from the coordinator. tensorboardX writes from a
    thread of its own, which a full disk ends (a traceback in mpiexec.log): the coordinator's next
    scalars then waited on its full queue for ever. Flushed here every step (and never by that
    thread), the file's buffer holds less than a step's events, so that thread's writes never reach
    the disk and this call is what meets a full disk: the coordinator's error names the directory."""
    try:
        writer.flush()
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, writer.logdir) from None


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without PyTorch: tensorboardX imports torch when it can
    (1-3 s before the first step) though scalars need only numpy."""
    import sys

    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


class Evaluations:
    """Evaluations during training (``runconfig.eval_frequency``): the weights of a step, gathered
    from the MemoryX servers, are evaluated on ``eval_input`` (``eval_steps`` batches) in a thread
    of the coordinator while training goes on; each result becomes a line of metrics.jsonl
    (``eval_loss``, ``eval_perplexity``, ``eval_accuracy``) and TensorBoard's eval/ scalars, in
    step order. Not part of simulated time (docs/design/params.md "Evaluation during training")."""

    def __init__(self, role, metrics, board):
        self.role, self.metrics, self.board = role, metrics, board
        self.pending, self._pool, self._dataset = [], None, None

    def start(self, step):
        from concurrent.futures import ThreadPoolExecutor

        from data_tools.dataset import Dataset
        from wse_core.nn.reference import evaluate

        role, e = self.role, self.role.params.eval_input
        weights = {}
        for rank in role.plan.memoryx:
            got = role.link.recv_object(rank, role.link.tag(REPORT, 0, EVAL_WEIGHTS),
                                        f"MemoryX rank {rank} (weights to evaluate after step {step})")
            weights.update(got.weights)
        if self._pool is None:
            self._pool, self._dataset = ThreadPoolExecutor(max_workers=1), Dataset(e.data_dir)
        steps = role.params.runconfig.eval_steps
        self.pending.append((step, self._pool.submit(evaluate, role.model, weights, self._dataset,
                                                     e.micro_batch_size or e.batch_size,
                                                     None if steps is None else steps * e.batch_size)))

    def report(self, wait=False):
        """Log the evaluations that have finished (all of them with ``wait``), oldest first."""
        while self.pending and (wait or self.pending[0][1].done()):
            step, future = self.pending.pop(0)
            r = future.result()
            record = {"step": step, "eval_loss": r["loss"], "eval_perplexity": r["perplexity"],
                      "eval_accuracy": r["accuracy"], "eval_examples": r["examples"], "eval_tokens": r["tokens"]}
            self.metrics.write(json.dumps(record) + "\n")
            if self.board is not None:
                for key in ("loss", "perplexity", "accuracy"):
                    self.board["eval"].add_scalar(key, r[key], step)
                _flush(self.board["eval"])
            print(f"eval after step {step}: loss {r['loss']:.4f}  perplexity {r['perplexity']:.2f}  "
                  f"accuracy {r['accuracy']:.4f} ({r['examples']:,} examples)", flush=True)

    def finish(self):
        self.report(wait=True)
        if self._pool is not None:
            self._pool.shutdown()
