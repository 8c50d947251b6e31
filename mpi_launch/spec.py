"""The run's spec: what the ranks read, as frozen dataclasses with their defaults and constraints.

One class per params section (``TrainInput``, ``EvalInput``, ``OptimizerSpec``, ``RunConfig``),
each field with its default and, in its metadata, its constraint and help (``wse_core.checks.key``);
each class's ``ZOO`` holds the Model Zoo keys of its section it has no field for, with their fate.
``RunSpec`` holds them and the model's normalised config (``wse_core.nn.config``). ``pyapi.params``
reads the YAML, translates Model Zoo's layouts and walks these fields with the one validator
(``wse_core.checks.check_fields``); the launcher writes ``RunSpec.to_dict()`` to ``run.json`` and
every rank rebuilds it with ``from_dict``. Values are deep-frozen (mappings read-only, lists
tuples), so no rank can change what it was given.

A field without a default is required in the params (``kw_only`` lets it stand anywhere).
"""
import math
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import ClassVar

from wse_core.checks import Bool, Check, Int, Number, OneOf, Text, Zoo, key, show
from wse_core.errors import ConfigError


def freeze(value):
    """A read-only copy of plain data: mappings become MappingProxyType, lists tuples."""
    if isinstance(value, (dict, MappingProxyType)):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value):
    """Plain data again (dicts and lists), for JSON and YAML."""
    if isinstance(value, (dict, MappingProxyType)):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


STRATEGIES = ("weight_streaming", "pipeline", "auto")
POSITIVE = Number(0, open="low")

# wse-cluster's bounds on a run's sizes: far beyond any real run, so that an absurd one is one line at
# once, not minutes of laying out ranks (100,000 input workers per CS-2) or a MemoryError in every rank
# (a batch of 10^9 samples). Steps times samples stays within an int64 (a stream's position).
STEPS = Int(1, 10**9, bound="wse-cluster's bound on steps (real runs take at most a few million)")
BATCH = Int(1, 1 << 20, bound="wse-cluster's bound on a batch's samples (real batches hold thousands)")
CSX = Int(1, 2048, bound="wse-cluster's bound on CS-2s (Cerebras' largest clusters: 192 CS-2s, 2,048 CS-3s)")
MEMORYX = Int(1, 2048, bound="wse-cluster's bound on MemoryX servers (each is a process)")
WORKERS = Int(1, 64, bound="wse-cluster's bound on input workers per CS-2 (each is a process)")
# A wait of 10^10 s would overflow threading's timeouts (TIMEOUT_MAX) in a rank, mid-run.
SECONDS = Int(1, 7 * 24 * 3600, bound="wse-cluster's bound on a wait (a week)")


def _paths(value, path):
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return value
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: expected a directory or a non-empty list of directories, got {show(value)}")
    return value


def _micro_batch(value, path):
    if value in ("auto", "explore", "none") or isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ConfigError(f"{path}: expected a number of samples, auto, explore or none, got {show(value)}")


def _mixture(value, path):
    if not (isinstance(value, list) and value and all(
            isinstance(m, dict) and set(m) >= {"data_dir", "weight"} and set(m) <= {"data_dir", "weight", "data_subset"}
            and isinstance(m["data_dir"], str) and m["data_dir"] and isinstance(m["weight"], (int, float))
            and not isinstance(m["weight"], bool) and 0 <= m["weight"] < math.inf for m in value)
            and any(m["weight"] > 0 for m in value)):
        raise ConfigError(f"{path}: expected a list of {{data_dir: DIR, weight: number >= 0}}, some weight > 0, "
                          f"got {show(value)}")
    if any("data_subset" in m for m in value):
        raise ConfigError(f"{path}: data_subset is not built (use each directory whole)")
    return value


def _learning_rate(value, path):
    from wse_core.optim import make_schedule

    if isinstance(value, str):
        raise ConfigError(f"{path}: expected a number or a list of schedulers, got {show(value)}")
    make_schedule(value, key=path)
    return value


def _betas(value, path):
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)):
        raise ConfigError(f"{path}: expected two numbers in [0, 1), got {show(value)}")
    return value


def _loss_scale(value, path):
    if value == "dynamic":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{path}: expected a number > 0 or dynamic, got {show(value)}")
    return value


def _lr_adjust(value, path):
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping of parameter groups to scales > 0, got {show(value)}")
    for group, scale in value.items():
        POSITIVE(scale, f"{path}.{group}")
    return value


def _hardware(value, path):
    """A system's name (cs2, cs3), or a mapping of constants over its ``system``'s (default cs2)."""
    from wse_core.perf import Hardware

    if isinstance(value, str):
        value = {"system": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a system (cs2, cs3) or a mapping of hardware constants, got {show(value)}")
    Hardware.from_params(value)
    return value


#: Optimizers a Model Zoo params file may name that are not built here: refused by name, not as unknown.
OPTIMIZERS_NOT_BUILT = ("lamb", "adafactor", "lion", "adadelta", "adagrad", "adamax", "asgd", "nadam", "radam",
                        "rmsprop", "rprop", "muon")


def _optimizer_type(value, path):
    Text()(value, path)
    if value.lower() in OPTIMIZERS_NOT_BUILT:
        raise ConfigError(f"{path}: {value} is one of Model Zoo's optimizers that wse-cluster does not implement "
                          "(implemented: SGD, Adam, AdamW)")
    if value.lower() not in ("sgd", "adam", "adamw"):
        raise ConfigError(f"{path}: unknown optimizer {show(value)} (known: SGD, Adam, AdamW)")
    return value


#: Model Zoo's input keys that tune a real system's input pipeline.
_INPUT_TUNING = ("data_processor", "num_workers", "prefetch_factor", "persistent_workers", "use_multiple_workers",
                 "vocab_size", "max_sequence_length", "mixed_precision", "repeat", "use_worker_cache", "drop_last")


@dataclass(frozen=True, kw_only=True)
class TrainInput:
    """The validated ``train_input`` section (every default filled in; read-only)."""

    ZOO: ClassVar[dict] = {k: Zoo.tuning() for k in _INPUT_TUNING}

    data_dir: str | tuple | None = key(Check(_paths, "a directory or a list of them"), "directory of HDF5 training shards (or a list of them); or mixture",
                                       None)
    mixture: tuple | None = key(Check(_mixture, "a list of {data_dir, weight}"), "datasets mixed in proportion: a list of {data_dir, weight} (Model Zoo's)",
                                None)
    batch_size: int = key(BATCH, "global batch size, dealt to the CS-2s and their micro-batches as evenly as it goes")
    micro_batch_size: int | str | None = key(Check(_micro_batch, "a number of samples, auto, explore or none"),
                                             "samples per micro-batch: a number, auto (the default: the largest "
                                             "that fits), explore (wse compile only) or none", None)
    shuffle: bool = key(Bool(), "shuffle examples each epoch", True)
    shuffle_seed: int = key(Int(0), "seed of the per-epoch shuffle", 0)


@dataclass(frozen=True, kw_only=True)
class EvalInput:
    """The validated ``eval_input`` section (every default filled in; read-only)."""

    ZOO: ClassVar[dict] = {**{k: Zoo.tuning() for k in (*_INPUT_TUNING, "shuffle_seed")},
                           "shuffle": Zoo.same((False,), "a shuffled evaluation set")}

    data_dir: str | tuple = key(Check(_paths, "a directory or a list of them"), "directory of HDF5 evaluation shards (or a list of them)")
    batch_size: int = key(BATCH, "evaluation batch size")
    micro_batch_size: int | None = key(BATCH, "samples per micro-batch", None)


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """The validated ``optimizer`` section (every default filled in; read-only)."""

    ZOO: ClassVar[dict] = {
        **{k: Zoo.tuning() for k in ("log_summaries", "ws_summary", "disable_lr_steps_reset", "use_bias_correction")},
        "correct_bias": Zoo.same((True,), "Adam without bias correction"),
        "grad_accum_steps": Zoo.same((1, None), "gradient accumulation by steps (use train_input.micro_batch_size)"),
        "max_gradient_value": Zoo.same((None,), "clipping gradients by value"),
    }

    optimizer_type: str = key(Check(_optimizer_type, "SGD, Adam or AdamW"), "SGD, Adam or AdamW", "AdamW")
    learning_rate: object = key(Check(_learning_rate, "a number or a list of schedulers"), "a number, or a list of schedulers (Linear, CosineDecay, Constant)")
    weight_decay: float = key(Number(0), "L2 (SGD, Adam) or decoupled (AdamW) weight decay", 0.0,
                              aliases=("weight_decay_rate",))
    betas: tuple = key(Check(_betas, "two numbers in [0, 1)"), "Adam/AdamW moment decay rates", (0.9, 0.999))
    eps: float = key(Number(0), "Adam/AdamW denominator term", 1e-8, aliases=("epsilon",))
    momentum: float = key(Number(0), "SGD momentum", 0.0)
    nesterov: bool = key(Bool(), "SGD Nesterov momentum", False)
    max_gradient_norm: float | None = key(POSITIVE, "clip the global gradient norm to this value", None)
    loss_scaling_factor: float | str = key(Check(_loss_scale, "a number > 0 or dynamic"), "scale of the loss for 16-bit gradients: a number, or dynamic",
                                           1.0)
    initial_loss_scale: float | None = key(POSITIVE, "dynamic loss scaling: the first scale (2^15; 2^31 for "
                                           "cbfloat16)", None)
    max_loss_scale: float | None = key(POSITIVE, "dynamic loss scaling: the largest scale (2^15; 2^31 for "
                                       "cbfloat16)", None)
    min_loss_scale: float | None = key(POSITIVE, "dynamic loss scaling: the smallest scale (2^-14)", None)
    steps_per_increase: int | None = key(STEPS, "dynamic loss scaling: finite steps before the scale doubles "
                                         "(2000)", None)
    adjust_learning_rate: MappingProxyType | None = key(
        Check(_lr_adjust, "a mapping of parameter groups to scales > 0"), "learning-rate scale per parameter "
        "group (Model Zoo's: embedding, decoder_kernel, decoder_attention, decoder_input_ffn, decoder_output_ffn)",
        None)

    def optimizer(self):
        """The ``wse_core.optim`` optimizer these settings make (at lr 0: the schedule gives each step's)."""
        from wse_core.optim import make_optimizer

        kwargs = {"lr": 0.0, "weight_decay": self.weight_decay}
        if self.optimizer_type.lower() == "sgd":
            kwargs.update(momentum=self.momentum, nesterov=self.nesterov)
        else:
            kwargs.update(betas=tuple(self.betas), eps=self.eps)
        return make_optimizer(self.optimizer_type, **kwargs)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The validated ``runconfig`` section (every default filled in; read-only)."""

    ZOO: ClassVar[dict] = {
        **{k: Zoo.tuning() for k in (
            "show_debug_metrics", "save_losses", "save_summary_steps", "log_step_count_steps", "enable_distributed",
            "use_appliance_data", "use_cs_grad_accum", "compile_crd_memory_gi", "execute_crd_memory_gi",
            "wrk_memory_gi", "act_memory_gi", "cmd_memory_gi", "wgt_memory_gi", "chf_memory_gi",
            "precision_opt_level", "keep_checkpoint_max", "max_checkpoints", "disable_strict_checkpoint_loading",
            "load_checkpoint_states", "transfer_processes", "logging", "autoload_last_checkpoint", "num_act_servers",
            "mgmt_address", "mgmt_namespace", "credentials_path", "mount_dirs", "python_paths", "cbcore_image",
            "job_labels", "job_priority", "job_time_sec", "disable_version_check", "compile_dir",
            "lazy_initialization", "log_initialization", "retrace_every_iteration", "drop_data", "debug_args", "ini",
            "fabric_type_blacklist")},
        "mode": Zoo.same(("train",), "a mode other than train (use wse validate)"),
        "target_device": Zoo.same(("CSX", "CPU"), "another target device"),
        "compile_only": Zoo.same((False,), "compile only (use wse compile)"),
        "validate_only": Zoo.same((False,), "validate only (use wse compile)"),
        "num_steps": Zoo.not_built("a step count other than max_steps"),
        "num_epochs": Zoo.not_built("training by epochs"),
        "steps_per_epoch": Zoo.not_built("training by epochs"),
    }

    max_steps: int = key(STEPS, "training steps")
    checkpoint_steps: int = key(Int(0, STEPS.high, bound=STEPS.bound), "save a checkpoint every N steps (0: only at "
                                "the end)", 0)
    save_initial_checkpoint: bool = key(Bool(), "also save before the first step", False)
    log_steps: int = key(STEPS, "log every N steps", 1)
    num_csx: int = key(CSX, "CS-2 systems", 1)
    execution_strategy: str = key(OneOf(*STRATEGIES), "weight_streaming, pipeline (one CS-2, every layer resident on the "
                                  "wafer) or auto (pipelined when the model fits and is faster)", "weight_streaming")
    num_wgt_servers: int = key(MEMORYX, "MemoryX weight servers", 1)
    num_workers_per_csx: int = key(WORKERS, "input workers per CS-2", 1)
    swarmx_fanout: int = key(Int(2, CSX.high, bound="wse-cluster's bound on a SwarmX node's children (as on CS-2s)"),
                             "children per SwarmX node", 2)
    model_dir: str = key(Text(), "where checkpoints, logs and metrics go", "model_dir")
    seed: int = key(Int(0), "seed of the model initialisation and of the dropout masks", 0)
    eval_frequency: int | None = key(STEPS, "evaluate on eval_input every N steps and after the last (null: "
                                     "never)", None)
    eval_steps: int | None = key(STEPS, "batches of eval_input an evaluation reads (null: all of it)", None)
    peer_timeout: int = key(SECONDS, "seconds a silent peer is waited for beyond twice the longest step so far and "
                            "a checkpoint's write (until a step has set the pace: beyond startup_timeout) before the "
                            "job ends; also how long a stopped rank is given", 20)
    hardware: MappingProxyType = key(Check(_hardware, "a system or a mapping of hardware constants"),
                                     "the emulated system (cs2, cs3) or constants over its own ({system: cs3, "
                                     "io_gbps: 1600}; wse_core.perf.Hardware; the precision is the model's)",
                                     factory=lambda: MappingProxyType({}))
    startup_timeout: int = key(SECONDS, "seconds every rank has to start (imports, connecting, loading its "
                               "checkpoint) before the job is ended", 300)
    allow_numerics_change: bool = key(Bool(), "resume from a checkpoint written under another numerics environment "
                                      "(BLAS kernel, numpy): the continuation's bits then differ from an "
                                      "uninterrupted run's; refused unless true", False)


#: The params sections other than ``model``, by name.
SECTIONS = {"train_input": TrainInput, "eval_input": EvalInput, "optimizer": OptimizerSpec, "runconfig": RunConfig}


@dataclass(frozen=True)
class RunSpec:
    """A validated run: one typed, read-only section per params section; ``model`` is the model's
    normalised config (``wse_core.nn.build_model(spec.model)`` rebuilds it). ``to_dict`` is the flat
    params layout, which ``pyapi.params.validate`` takes back unchanged (the resolved ``params.yaml``
    of a run)."""

    kind: ClassVar[str] = "train"  # the job kind (run.json's "kind"; the appliance's requests.JOB_KINDS)
    train_input: TrainInput
    model: MappingProxyType
    optimizer: OptimizerSpec
    runconfig: RunConfig
    eval_input: EvalInput | None = None

    @classmethod
    def from_dict(cls, d):
        """From an already validated flat dict (``validate``'s result, or a run's ``run.json``)."""
        sections = {name: c(**{f.name: freeze(d[name][f.name]) for f in fields(c)})
                    for name, c in SECTIONS.items() if d.get(name) is not None}
        return cls(model=freeze(d["model"]), **sections)

    def to_dict(self):
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = thaw(value) if f.name == "model" else {g.name: thaw(getattr(value, g.name))
                                                                  for g in fields(value)}
        return out
