"""``Job``: configure, compile and run a training job from Python, as ``wse fit`` does.

    from pyapi import Job
    job = Job.from_yaml("params.yaml", num_csx=2)
    print(job.compile())     # the rank plan and memory estimate, nothing launched (a CompileReport)
    result = job.fit()       # starts mpiexec underneath; works from a script or a notebook
    result.metrics[-1]["loss"]
    job.validate()           # eval loss of the latest checkpoint on eval_input

    handle = job.submit(max_restarts=1)   # or queue it on a running appliance (`wse appliance start`)
    handle.status(); handle.wait(); handle.metrics(); handle.cancel()
"""
import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from data_tools.errors import DataError
from mpi_launch.launcher import Output, launch
from mpi_launch.mpiexec import check_capacity, job_command
from mpi_launch.rundir import RunDir
from pyapi import params as params_mod, plot
from pyapi.client import Client
from pyapi.errors import JobError  # also pyapi.job.JobError, the name users know (see pyapi/errors.py)
from wse_core.checks import plural
from wse_core.errors import ConfigError
from wse_core.perf import Hardware
from wse_core.perf.inference import serve
# Imported where used: the kernels (wse_core.models, wse_core.nn, mpi_launch.resolved, data_tools.dataset),
# which load after configure_process() (wse_core/__init__.py), never on `from pyapi import Job`; and h5py
# (data_tools.checkpoint), for validate() alone.


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


@dataclass(frozen=True)
class CompileReport(Mapping):
    """What ``Job.compile()`` finds and `wse compile` prints (``str(report)``; ``to_dict()`` is its --json),
    with nothing run: the rank plan, each rank's memory, the emulated hardware's step, a wafer's memory,
    the run pipelined on one CS-2 instead, and the strategy chosen. Also a mapping of ``to_dict()``'s keys
    (``report["plan"]["roles"]``), as scripts written when ``compile()`` returned a dict read it."""
    plan: dict                        # the rank plan (plan.json): roles, world_size, memoryx, swarmx, children, ...
    model: dict                       # name, parameters, units (the streaming units' names), unit_bytes
    memory_bytes: dict                # host bytes each rank holds, by rank ("0", "1", ..., as JSON has them)
    micro_batches_per_csx: int        # micro-batches each CS-2 runs a step
    wafer_bytes: dict                 # a CS-2's wafer in weight streaming: need, capacity and its parts
    simulated: dict                   # the emulated hardware's weight-streaming step: step_s, samples_per_s, parts
    bit_identical_to_reference: bool  # the cluster's sums are the single-process step's, bit for bit
    execution_strategy: str           # "weight_streaming" or "pipeline"
    why: str                          # the line that says why that strategy
    pipeline: dict                    # the run pipelined on one CS-2: fits, why, step_s, regions (the layers' PEs)
    micro_batches: list = None        # with explore: each size that deals the batch evenly, its wafer need and speed
    batch_invariant: bool = False     # the step's bits are the tree over its samples: any num_csx and micro-batch size
    micro_batch_size: int = None      # the micro-batch size taken
    batch_dependent: str = None       # why the model's sums depend on the micro-batch (None: they do not)
    lowering: dict = None             # a compiled PyTorch model's: the FLOPs and ops left to torch

    @property
    def step_s(self):
        """The simulated step time in seconds (weight streaming)."""
        return self.simulated["step_s"]

    @property
    def samples_per_s(self):
        """The simulated samples/s (weight streaming)."""
        return self.simulated["samples_per_s"]

    def to_dict(self):
        """As `wse compile --json` prints it: ``micro_batches`` only when explored."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.micro_batches is None:
            del d["micro_batches"]
        return d

    def __getitem__(self, key):
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self):
        return len(self.to_dict())

    def __str__(self):
        return "\n".join(self.lines())

    def lines(self):
        """The lines `wse compile` prints."""
        return [*self._cluster_lines(), *self._lowering_lines(), *self._step_lines(), *self._explore_lines(),
                self._bits_line(), *self._pipeline_lines(), f"execution strategy: {self.why}"]

    def _lowering_lines(self):
        """A compiled PyTorch model's: how much of its work runs on the kernels."""
        if not self.lowering:
            return []
        left = self.lowering["torch_ops"]
        return [f"kernels: {1 - self.lowering['torch_flops']:.1%} of the FLOPs lowered to the wafer's kernels"
                + (f"; left to torch: {', '.join(left)}" if left else "")]

    def _bits_line(self):
        """What the run's bits are the same as (docs/design.md section 5, (a))."""
        if self.batch_invariant:
            return "bits: the same for any num_csx and micro-batch size (every sum a tree over the batch's samples)"
        if not self.bit_identical_to_reference:
            return ("bits: of this layout alone (the same bits need a power of two of micro-batches per CS-2, and "
                    "num_csx at most swarmx_fanout or both powers of two)")
        why = self.batch_dependent or (f"its {self.micro_batches_per_csx * self.plan['num_csx']} micro-batches are "
                                       "not halvings of the batch; a power of two of them are")
        return (f"bits: the single-process reference's at micro_batch_size {self.micro_batch_size}, and another "
                f"micro-batch size's differ ({why})")

    def _cluster_lines(self):
        plan, m = self.plan, self.model
        out = [f"model {m['name']}: {m['parameters']:,} parameters in {plural(len(m['units']), 'streaming unit')}",
               f"cluster: {plural(plan['num_csx'], 'CS-2')}, {plan['num_wgt_servers']} MemoryX, {len(plan['swarmx'])} "
               f"SwarmX (fan-out {plan['swarmx_fanout']}), {plural(plan['num_workers_per_csx'], 'input worker')} "
               f"per CS-2: {plan['world_size']} MPI ranks"]
        for rank, role in enumerate(plan["roles"]):
            detail = ""
            if role == "memoryx":
                k = plan["memoryx"].index(rank)
                units = [m["units"][u] for u, o in enumerate(plan["unit_owner"]) if o == k]
                detail = f"owns {units[0]}..{units[-1]} ({plural(len(units), 'unit')})"
            elif role == "swarmx":
                detail = f"children {plan['children'][str(rank)]}" + (" (root)" if rank == plan["swarmx"][0] else "")
            elif role == "csx":
                detail = f"{plural(self.micro_batches_per_csx, 'micro-batch')} per step"
            out.append(f"  rank {rank:>3}  {role:<11} {self.memory_bytes[str(rank)] / 2**20:9.1f} MiB  {detail}")
        return out

    def _step_lines(self):
        sim, wafer = self.simulated, self.wafer_bytes

        def size(n):
            return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"

        return [f"simulated step, weight streaming (a model of the hardware, wse_core.perf; {sim['detail']['system']}, "
                f"{sim['detail']['precision']}, {sim['detail']['io_gbps']:g} Gb/s per system): "
                f"{sim['step_s'] * 1e3:.3f} ms, {sim['samples_per_s']:.1f} samples/s",
                f"  compute {sim['compute_s'] * 1e3:.3f} ms, waiting for weights "
                f"{sim['exposed_stream_s'] * 1e3:.3f} ms (their bytes alone, and the gradients', take "
                f"{sim['stream_s'] * 1e3:.3f} ms of the CS-2's I/O), reduce tail {sim['reduce_tail_s'] * 1e3:.3f} ms, "
                f"MemoryX update {sim['optimizer_s'] * 1e3:.3f} ms",
                f"  wafer memory per CS-2, a micro-batch of {wafer['micro_batch_size']}: "
                f"{size(wafer['checkpoints'] + wafer['segment'])} of activations (one unit's input in "
                f"{wafer['interval']} kept, a segment recomputed), {size(wafer['weights'] + wafer['gradients'])} of "
                f"weights and gradients in flight: {size(wafer['need'])} of {wafer['capacity'] / 1e9:.1f} GB usable"]

    def _explore_lines(self):
        if self.micro_batches is None:
            return []
        out = ["  micro-batch sizes (micro_batch_size: explore):", f"    {'size':>6} {'wafer GB':>9} {'samples/s':>10}"]
        for row in self.micro_batches:
            speed = f"{row['samples_per_s']:10.1f}" if row["fits"] else f"{'does not fit':>10}"
            out.append(f"    {row['micro_batch_size']:>6} {row['need_bytes'] / 1e9:9.2f} {speed}"
                       + ("  <- chosen" if row["chosen"] else ""))
        return out

    def _pipeline_lines(self):
        pl = self.pipeline
        out = [f"pipelined on one CS-2: {pl['why']}"]
        if pl["fits"]:
            out += [f"  step {pl['step_s'] * 1e3:.3f} ms for {plural(pl['micro_batches'], 'micro-batch')} of "
                    f"{pl['micro_batch_size']} through {plural(len(pl['regions']), 'stage')} (slowest "
                    f"{pl['slowest_stage_s'] * 1e3:.3f} ms), update {pl['update_s'] * 1e3:.3f} ms",
                    f"  {'layer':<12} {'columns':>9} {'PEs':>9} {'parameters':>13} {'need MiB':>10} "
                    f"{'usable MiB':>10} {'stage ms':>9}"]
            for r in pl["regions"]:
                cols = f"{r['columns'][0]}-{r['columns'][1] - 1}"
                out.append(f"  {r['name']:<12} {cols:>9} {r['pes']:>9,} {r['params']:>13,} "
                           f"{r['need_bytes'] / 2**20:>10.1f} {r['capacity_bytes'] / 2**20:>10.1f} "
                           f"{r['stage_s'] * 1e3:>9.3f}")
        return out


@dataclass(frozen=True)
class InferenceReport:
    """What ``Job.compile(inference=True)`` finds and `wse compile --inference` prints (``str(report)``;
    ``to_dict()`` is its --json): serving the params' model on the emulated hardware."""
    latency: object                   # a wse_core.perf.inference.Latency, of the placement chosen: ttft_s, tpot_s, ...
    streamed: object = None           # with the weights resident: the same batch streamed from MemoryX, if it fits

    def to_dict(self):
        return self.latency.to_dict()

    def __str__(self):
        return "\n".join(self.lines())

    def lines(self):
        """The lines `wse compile --inference` prints."""
        r, d = self.latency, self.latency.detail
        csx = plural(r.num_csx, "CS-2")
        out = [f"inference (a model of the hardware, wse_core.perf; {d['precision']}): {r.why}",
               f"  batch {r.batch}, prompt {r.prompt_tokens} tokens, {r.new_tokens} new: time to first token "
               f"{r.ttft_s * 1e3:.3f} ms, time per output token {r.tpot_s * 1e3:.3f} ms "
               f"(a request {d['request_s'] * 1e3:.1f} ms)",
               f"  {r.tokens_per_s_user:.1f} tokens/s per user, {r.tokens_per_s_batch:.1f} tokens/s for the batch",
               f"  KV cache {r.kv_bytes_per_sequence / 1e6:.3g} MB a sequence of {r.prompt_tokens + r.new_tokens} "
               f"positions: up to {r.max_batch['resident']} sequences with the weights resident on {csx}, "
               f"{r.max_batch['streamed']} with them streamed"]
        if r.placement == "resident":
            g, m = d["micro_batches"], d["micro_batch"]
            out.append(f"  pipelined over {plural(d['stages'], 'stage')}: {plural(g, 'micro-batch')} of "
                       f"{plural(m, 'sequence')}, slowest stage {d['slowest_stage_s'] * 1e3:.4f} ms, a token through "
                       f"them all {d['latency_s'] * 1e3:.3f} ms")
            if self.streamed is not None:
                s = self.streamed
                out.append(f"  streamed from MemoryX instead: {s.tokens_per_s_user:.1f} tokens/s per user, "
                           f"{s.tokens_per_s_batch:.1f} for the batch")
        else:
            out.append(f"  a decode step: compute {d['compute_s'] * 1e3:.3f} ms, the weights' stream "
                       f"{d['stream_s'] * 1e3:.3f} ms ({plural(d['sequences_per_csx'], 'sequence')} per CS-2)")
        return out


def _draw_loss(run_dir, stream):
    """The run's loss.png, from every step of its metrics.jsonl (a resumed run's earlier ones too), and a
    line saying where it is (``stream``: an ``Output``)."""
    try:
        plot.save(plot.loss_figure([run_dir.path]), run_dir.loss_png)
    except Exception as exc:  # the steps are trained and checkpointed: a picture is not worth failing them for
        stream.write(f"loss curve: not drawn: {type(exc).__name__}: {exc}\n")
    else:
        stream.write(f"loss curve: {run_dir.loss_png}\n")


class Job:
    """A validated training job."""

    def __init__(self, params, *, model=None):
        """``params``: a validated ``RunSpec``; ``model``: its model, when the caller built it (validation
        does): a job builds its model once, and resolves its run once (``resolved``)."""
        self.params = params
        self._model = model

    @classmethod
    def from_yaml(cls, path, *, num_csx=None, execution_strategy=None, model_dir=None, overrides=None):
        """The job of a params file (or a run's model_dir): ``overrides`` (``key.path=value`` strings, as
        ``--set``), then ``num_csx``, ``execution_strategy`` and ``model_dir`` as given (the runconfig keys)."""
        given = {"num_csx": num_csx, "execution_strategy": execution_strategy,
                 "model_dir": None if model_dir is None else str(model_dir)}
        spec, report = params_mod.load(path, overrides, values={f"runconfig.{k}": v for k, v in given.items()
                                                                if v is not None}, with_report=True)
        return cls(spec, model=report.model)

    @classmethod
    def from_dict(cls, raw):
        """The job of a params mapping (either layout), validated (``pyapi.params.check``) with the model the
        validation builds kept, so it is not built again."""
        spec, report = params_mod.check(raw)
        return cls(spec, model=report.model)

    @functools.cached_property
    def model(self):
        """The job's model (``wse_core.nn.Model``), built once."""
        from wse_core.models import build_model

        return build_model(self.params.model) if self._model is None else self._model

    @functools.cached_property
    def resolved(self):
        """The run resolved once (``mpi_launch.resolved.ResolvedRun``): the rank plan, the execution
        strategy and the micro-batches the ranks obey, written into run.json."""
        from mpi_launch.resolved import resolve

        return resolve(self.params, self.model)

    @property
    def model_dir(self):
        return Path(self.params.runconfig.model_dir)

    def compile(self, *, explore=False, inference=False, batch=None, prompt_tokens=None, new_tokens=None):
        """What `wse compile` prints, found with nothing run: a ``CompileReport`` (the rank plan, each rank's
        memory, the simulated step; with ``explore``, every micro-batch size that deals the batch evenly),
        or with ``inference`` an ``InferenceReport`` of serving the model (``batch`` sequences, default 1,
        of ``prompt_tokens`` and ``new_tokens``, default 128 each within the model's positions).
        ``print(report)`` prints what `wse compile` does. Data that is there is checked as ``fit``
        checks it (a plan of data the run would refuse is no plan); data not there yet is left to the run."""
        if inference:
            if explore:
                raise ConfigError("explore: searches training's micro-batches, not with inference=True")
            return self._compile_inference(1 if batch is None else batch, prompt_tokens, new_tokens)
        for name, given in (("batch", batch), ("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
            if given is not None:
                raise ConfigError(f"{name}: only with inference=True")
        from mpi_launch.resolved import describe, explore_sizes

        self._check_inputs(present_only=True)
        d = describe(self.resolved)
        if explore:
            d["micro_batches"] = explore_sizes(self.resolved)
        return CompileReport(**d)

    def _compile_inference(self, batch, prompt_tokens, new_tokens):
        """``compile(inference=True)``: the data is not read to serve, so not checked."""
        model = self.model
        most = model.config.get("max_position_embeddings", 2)
        prompt = prompt_tokens if prompt_tokens is not None else min(128, most // 2)
        new = new_tokens if new_tokens is not None else min(128, most - prompt)
        r = self.params.runconfig
        kwargs = dict(batch=batch, prompt_tokens=prompt, new_tokens=new, num_csx=r.num_csx,
                      hw=Hardware.for_model(model, r.hardware))
        latency = serve(model, **kwargs)
        streamed = None
        if latency.placement == "resident" and latency.max_batch["streamed"] >= latency.batch:
            streamed = serve(model, placement="streamed", **kwargs)  # the other placement, when it holds the batch
        return InferenceReport(latency, streamed)

    def command(self, *, checkpoint_path=None, hostfile=None):
        """Prepare model_dir for a run and return the mpiexec command that runs it (``wse fit --dry-run``).

        The command runs the job as it stands, without the launcher's watchdog: put it in a batch
        script, or run it by hand.
        """
        self._check_inputs()
        cmd, _ = self._command(hostfile, None)
        with RunDir(self.model_dir).lock("wse fit --dry-run") as run_dir:
            run = run_dir.prepare(self.resolved, checkpoint=checkpoint_path)
        if run["recovered"]:  # said apart from the output, which is the command alone
            print(run["recovered"], file=sys.stderr)
        return cmd

    def _command(self, hostfile, cores):
        from mpi_launch.resolved import check_host_memory

        plan = self.resolved.plan
        cmd = job_command(plan, self.params.runconfig.model_dir, hostfile=hostfile, cores=cores)
        check_capacity(plan, hostfile=hostfile, cores=cores)
        check_host_memory(self.resolved, hostfile=hostfile)
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
        stream = Output.of(sys.stdout if stream is None else stream)
        self._check_inputs()
        cmd, plan = self._command(hostfile, cores)
        r = self.params.runconfig
        if r.execution_strategy != "weight_streaming":
            stream.write(f"execution strategy: {self.resolved.why}\n")
        with RunDir(self.model_dir).lock() as run_dir:
            run = run_dir.prepare(self.resolved, checkpoint=checkpoint_path)
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
                           f"initialising {self.model.num_params():,} weights")
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
        """Queue the job on a running appliance (docs/design/appliance.md); return its ``SubmittedJob``.

        The data is checked here first, as the submitting user. The job runs as that user, resumes
        from model_dir's latest checkpoint, and is restarted from its checkpoint after a fault up to
        ``max_restarts`` times. ``socket``: the appliance's (default: ``$WSE_APPLIANCE_SOCKET``, this
        user's own appliance, then the machine's).
        """
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
        from wse_core.nn.reference import evaluate

        e = self.params.eval_input
        if not e:
            raise params_mod.ParamsError("eval_input: required by validate (data_dir, batch_size)")
        ds = self._check_data("eval_input")
        ckpt = Checkpoint(checkpoint_path if checkpoint_path is not None else self.model_dir)
        model = self.model
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
            self.model.check_dataset(fmt, shape, vocab, where, columns=columns)
        except ValueError as exc:
            raise params_mod.ParamsError(str(exc)) from None
        return ds
