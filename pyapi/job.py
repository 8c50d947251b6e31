"""``Job``: configure, compile and run a training job from Python, as ``wse fit`` does.

    from pyapi import Job
    job = Job.from_yaml("params.yaml", num_csx=2)
    job.compile()            # the rank plan and memory estimate, nothing launched
    result = job.fit()       # starts mpiexec underneath; works from a script or a notebook
    result.metrics[-1]["loss"]
    job.validate()           # eval loss of the latest checkpoint on eval_input

    handle = job.submit(max_restarts=1)   # or queue it on a running appliance (`wse appliance start`)
    handle.status(); handle.wait(); handle.metrics(); handle.cancel()
"""
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pyapi import params as params_mod
from pyapi.errors import JobError  # also pyapi.job.JobError, the name users know (see pyapi/errors.py)


@dataclass
class FitResult:
    model_dir: Path
    metrics: list = field(default_factory=list)   # every step's record in metrics.jsonl, resumed ones included
    start_step: int = 0                            # the step this run started from (its checkpoint's)
    end_step: int = 0                              # the last step trained (runconfig.max_steps)
    checkpoint: str = None                         # the checkpoint this run resumed from

    @property
    def steps_trained(self):
        return self.end_step - self.start_step


def _draw_loss(run_dir, stream):
    """The run's loss.png, from every step of its metrics.jsonl (a resumed run's earlier ones too), and a
    line saying where it is (``stream``: an ``Output``)."""
    from pyapi import plot

    try:
        plot.save(plot.loss_figure([run_dir.path]), run_dir.loss_png)
    except Exception as exc:  # the steps are trained and checkpointed: a picture is not worth failing them for
        stream.write(f"loss curve: not drawn: {type(exc).__name__}: {exc}\n")
    else:
        stream.write(f"loss curve: {run_dir.loss_png}\n")


class Job:
    """A validated training job."""

    def __init__(self, params):
        self.params = params

    @classmethod
    def from_yaml(cls, path, *, num_csx=None, model_dir=None, overrides=None):
        overrides = list(overrides or [])
        if num_csx is not None:
            overrides.append(f"runconfig.num_csx={num_csx}")
        if model_dir is not None:
            overrides.append(f"runconfig.model_dir={json.dumps(str(model_dir))}")
        return cls(params_mod.load(path, overrides))

    @property
    def model_dir(self):
        return Path(self.params.runconfig.model_dir)

    def compile(self):
        """The rank plan and the memory estimates (``wse compile``); nothing runs. Data that is there
        is checked as ``fit`` checks it (a plan of data the run would refuse is no plan); data not
        there yet is left to the run."""
        from mpi_launch.plan import describe

        self._check_inputs(present_only=True)
        return describe(self.params)

    def command(self, *, checkpoint_path=None, hostfile=None):
        """Prepare model_dir for a run and return the mpiexec command that runs it (``wse fit --dry-run``).

        The command runs the job as it stands, without the launcher's watchdog: put it in a batch
        script, or run it by hand.
        """
        from mpi_launch.rundir import RunDir

        self._check_inputs()
        cmd, _ = self._command(hostfile, None)
        with RunDir(self.model_dir).lock("wse fit --dry-run") as run_dir:
            run = run_dir.prepare(self.params, checkpoint=checkpoint_path)
        if run["recovered"]:  # said apart from the output, which is the command alone
            print(run["recovered"], file=sys.stderr)
        return cmd

    def _command(self, hostfile, cores):
        from mpi_launch.mpiexec import check_capacity, fit_command
        from mpi_launch.plan import check_host_memory

        cmd, plan = fit_command(self.params, hostfile=hostfile, cores=cores)
        check_capacity(plan, hostfile=hostfile, cores=cores)
        check_host_memory(self.params, plan, hostfile=hostfile)
        return cmd, plan

    def fit(self, *, checkpoint_path=None, hostfile=None, cores=None, stream=None, stop=None):
        """Train; raise JobError with one line if any rank fails. A run that trained draws its loss curve
        into model_dir/loss.png (``pyapi.plot``) and says so on ``stream`` (default: standard output;
        a stream that fails, its reader gone or its disk full, is let go and the run goes on:
        ``mpi_launch.launcher.Output``).

        ``cores``: how many of this machine's cores the job's CS-2 ranks share (default: all; the
        appliance gives each job its share of the pool). ``stop``: a threading.Event that ends the
        job when set (from another thread; the checkpoints written so far stay).

        Only one job runs in a model_dir at a time (RunDirBusy names the one that does). SIGTERM,
        SIGINT or SIGHUP to this process end the job's ranks and raise
        ``mpi_launch.launcher.JobInterrupted`` (when called from the main thread).
        """
        from mpi_launch.launcher import Output, launch
        from mpi_launch.rundir import RunDir
        from wse_core.nn import build_model

        stream = Output.of(sys.stdout if stream is None else stream)
        self._check_inputs()
        cmd, plan = self._command(hostfile, cores)
        r = self.params.runconfig
        if r.execution_strategy != "weight_streaming":
            from mpi_launch.plan import strategy

            stream.write(f"execution strategy: {strategy(self.params, build_model(self.params.model))[1]}\n")
        with RunDir(self.model_dir).lock() as run_dir:
            run = run_dir.prepare(self.params, checkpoint=checkpoint_path)
            result = FitResult(self.model_dir, start_step=run["start_step"], end_step=r.max_steps,
                               checkpoint=run["checkpoint"])
            if run["recovered"]:  # latest was missing: where the run resumes, and why there
                stream.write(f"{run['recovered']}\n")
            elif run["checkpoint"]:
                stream.write(f"resuming from {Path(run['checkpoint']).name} (step {run['start_step']})\n")
            if run["numerics_changed"]:
                changed = "; ".join(run["numerics_changed"])
                stream.write(f"the numerics environment changed since that checkpoint ({changed}): resuming anyway "
                             "(runconfig.allow_numerics_change); the bits will differ from an uninterrupted run's\n")
            if result.start_step >= result.end_step:
                stream.write(f"nothing to train: the checkpoint is at step {result.start_step}, "
                             f"runconfig.max_steps is {result.end_step}\n")
                result.end_step = result.start_step
            else:
                # Said as it happens: a 12 x 768 GPT-2 takes 10 s and more on 2 cores before its first
                # step's line (ranks starting, weights initialised, the first step itself).
                stream.write(f"starting {plan.summary()}\n")
                weights = (f"loading the weights of {Path(run['checkpoint']).name}" if run["checkpoint"] else
                           f"initialising {build_model(self.params.model).num_params():,} weights")
                code, failure = launch(cmd, plan, run_dir, peer_timeout=r.peer_timeout,
                                       startup_timeout=r.startup_timeout, hostfile=hostfile,
                                       stream=stream, next_up=f"{weights}, then step {result.start_step + 1}",
                                       stop=stop)
                if code != 0:
                    raise JobError(failure)
            result.metrics = run_dir.read_metrics()
            if result.steps_trained:
                _draw_loss(run_dir, stream)
        return result

    def submit(self, *, max_restarts=0, priority=0, name=None, socket=None):
        """Queue the job on a running appliance (docs/design.md section 11); return its ``SubmittedJob``.

        The data is checked here first, as the submitting user. The job runs as that user, resumes
        from model_dir's latest checkpoint, and is restarted from its checkpoint after a fault up to
        ``max_restarts`` times. ``socket``: the appliance's (default: ``$WSE_APPLIANCE_SOCKET``, this
        user's own appliance, then the machine's).
        """
        from pyapi.appliance.client import Client

        self._check_inputs()
        return Client(socket).submit(self.params, max_restarts=max_restarts, priority=priority, name=name)

    def validate(self, *, checkpoint_path=None, batches=None, stream=None):
        """Eval loss of a checkpoint (default: model_dir's latest) on ``eval_input``.

        Runs in this process: the forward pass of every unit over the eval set in order (or its
        first ``batches`` batches), losses summed per micro-batch in the same balanced tree as
        training. Returns a dict with the loss, perplexity, counts and the checkpoint's step.
        ``stream`` (a file) is told what is evaluated once the checks have passed: it can take a while.
        """
        from data_tools.checkpoint import Checkpoint
        from wse_core.checks import plural
        from wse_core.nn import build_model
        from wse_core.nn.reference import evaluate

        e = self.params.eval_input
        if not e:
            raise params_mod.ParamsError("eval_input: required by validate (data_dir, batch_size)")
        ds = self._check_data("eval_input")
        ckpt = Checkpoint(checkpoint_path if checkpoint_path is not None else self.model_dir)
        model = build_model(self.params.model)
        ckpt.check_model(model)
        weights, _ = ckpt.load(model.param_names)
        batches = self.params.runconfig.eval_steps if batches is None else batches
        if stream is not None:
            n = ds.n_examples if batches is None else min(ds.n_examples, batches * e.batch_size)
            stream.write(f"evaluating {ckpt.dir} (step {ckpt.step}) on {plural(n, 'example')} of {e.data_dir}\n")
            stream.flush()
        try:
            r = evaluate(model, weights, ds, e.micro_batch_size or e.batch_size,
                         None if batches is None else batches * e.batch_size)
        except ValueError as exc:
            raise params_mod.ParamsError(f"eval_input.data_dir: {e.data_dir}: {exc}") from None
        return {"checkpoint": str(ckpt.dir), "step": ckpt.step, "eval_loss": r["loss"], "perplexity": r["perplexity"],
                "accuracy": r["accuracy"], "examples": r["examples"], "tokens": r["tokens"]}

    def _check_inputs(self, *, present_only=False):
        """The training data, and the evaluation data when the run evaluates as it trains.
        ``present_only``: only a section whose every directory is there (``compile``)."""
        for section in ("train_input", "eval_input") if self.params.runconfig.eval_frequency else ("train_input",):
            if not present_only or all(Path(d).exists() for d in self._data_dirs(section)):
                self._check_data(section)

    def _data_dirs(self, section):
        """Every directory ``section`` reads: its data_dir, or its mixture's (each a directory or a list)."""
        t = getattr(self.params, section)
        mixture = getattr(t, "mixture", None)
        given = [m["data_dir"] for m in mixture] if mixture is not None else [t.data_dir]
        return [d for g in given for d in ([g] if isinstance(g, str) else g)]

    def _check_data(self, section):
        """Fail before any work starts if ``section``'s data cannot feed the model; return the Dataset
        (of evaluation data; training data, which may be a mixture, is checked as its stream)."""
        from data_tools.dataset import Dataset, GlobalStream
        from data_tools.errors import DataError
        from wse_core.nn import build_model

        t = getattr(self.params, section)
        mixture = getattr(t, "mixture", None)
        where = f"{section}.mixture" if mixture is not None else f"{section}.data_dir: {t.data_dir}"
        try:
            if section == "train_input":
                ds = GlobalStream(t.data_dir, mixture=mixture)
                ds.close()
                fmt, shape, n, vocab, columns = ds.format, ds.example_shape, ds.n, ds.vocab_size, ds.dataset.columns
            else:
                ds = Dataset(t.data_dir)
                fmt, shape, n, vocab = ds.format, ds.example_shape, ds.n_examples, ds.params.get("vocab_size")
                columns = ds.columns
        except DataError as exc:  # the examples' data is the demo's: a new user's first error says what makes it
            hint = params_mod.demo_hint(self._data_dirs(section))
            if not hint:
                raise
            raise DataError(f"{exc}{hint}") from None
        if n == 0:
            raise params_mod.ParamsError(f"{where} holds no examples")
        try:
            build_model(self.params.model).check_dataset(fmt, shape, vocab, where, columns=columns)
        except ValueError as exc:
            raise params_mod.ParamsError(str(exc)) from None
        return ds
