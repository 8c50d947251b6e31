"""The run's spec: what the ranks read, as frozen dataclasses with their defaults and constraints.

One class per params section (``TrainInput``, ``EvalInput``, ``OptimizerSpec``, ``RunConfig``),
each field with its default and, in its metadata, the kind of value it takes and its help;
``RunSpec`` holds them and the model's normalised config. ``pyapi.params`` reads the YAML,
translates Model Zoo's layouts and walks these fields with its one checker; the launcher writes
``RunSpec.to_dict()`` to ``run.json`` and every rank rebuilds it with ``from_dict``. Values are
deep-frozen (mappings read-only, lists tuples), so no rank can change what it was given.

A field without a default is required in the params (``kw_only`` lets it stand anywhere).
"""
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType


def key(kind, help, default=MISSING, factory=MISSING):
    """A section's field: ``kind`` is what ``pyapi.params`` checks the value against."""
    return field(default=default, default_factory=factory, metadata={"kind": kind, "help": help})


def default_of(f):
    """A field's default as plain data, or MISSING for a required one."""
    if f.default_factory is not MISSING:
        return thaw(f.default_factory())
    return thaw(f.default)


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


@dataclass(frozen=True, kw_only=True)
class TrainInput:
    """The validated ``train_input`` section (every default filled in; read-only)."""

    data_dir: str | tuple | None = key("paths", "directory of HDF5 training shards (or a list of them); or mixture",
                                       None)
    mixture: tuple | None = key("mixture", "datasets mixed in proportion: a list of {data_dir, weight} (Model Zoo's)",
                                None)
    batch_size: int = key("int>0", "global batch size, split evenly across the CS-2s")
    micro_batch_size: int | None = key("int>0", "samples per micro-batch (default: batch_size / num_csx)", None)
    shuffle: bool = key("bool", "shuffle examples each epoch", True)
    shuffle_seed: int = key("int>=0", "seed of the per-epoch shuffle", 0)


@dataclass(frozen=True, kw_only=True)
class EvalInput:
    """The validated ``eval_input`` section (every default filled in; read-only)."""

    data_dir: str | tuple = key("paths", "directory of HDF5 evaluation shards (or a list of them)")
    batch_size: int = key("int>0", "evaluation batch size")
    micro_batch_size: int | None = key("int>0", "samples per micro-batch", None)


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """The validated ``optimizer`` section (every default filled in; read-only)."""

    optimizer_type: str = key("str", "SGD, Adam or AdamW", "AdamW")
    learning_rate: object = key("lr", "a number, or a list of schedulers (Linear, CosineDecay, Constant)")
    weight_decay: float = key("float>=0", "L2 (SGD, Adam) or decoupled (AdamW) weight decay", 0.0)
    betas: tuple = key("betas", "Adam/AdamW moment decay rates", (0.9, 0.999))
    eps: float = key("float>=0", "Adam/AdamW denominator term", 1e-8)
    momentum: float = key("float>=0", "SGD momentum", 0.0)
    nesterov: bool = key("bool", "SGD Nesterov momentum", False)
    max_gradient_norm: float | None = key("float>0?", "clip the global gradient norm to this value", None)
    loss_scaling_factor: float | str = key("lossscale", "scale of the loss for 16-bit gradients: a number, or dynamic",
                                           1.0)
    initial_loss_scale: float | None = key("float>0?", "dynamic loss scaling: the first scale (2^15; 2^31 for "
                                           "cbfloat16)", None)
    max_loss_scale: float | None = key("float>0?", "dynamic loss scaling: the largest scale (2^15; 2^31 for "
                                       "cbfloat16)", None)
    min_loss_scale: float | None = key("float>0?", "dynamic loss scaling: the smallest scale (2^-14)", None)
    steps_per_increase: int | None = key("int>0?", "dynamic loss scaling: finite steps before the scale doubles "
                                         "(2000)", None)
    adjust_learning_rate: MappingProxyType | None = key(
        "lradjust", "learning-rate scale per parameter group (Model Zoo's: embedding, decoder_kernel, "
        "decoder_attention, decoder_input_ffn, decoder_output_ffn)", None)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The validated ``runconfig`` section (every default filled in; read-only)."""

    max_steps: int = key("int>0", "training steps")
    checkpoint_steps: int = key("int>=0", "save a checkpoint every N steps (0: only at the end)", 0)
    save_initial_checkpoint: bool = key("bool", "also save before the first step", False)
    log_steps: int = key("int>0", "log every N steps", 1)
    num_csx: int = key("int>0", "CS-2 systems", 1)
    execution_strategy: str = key("strategy", "weight_streaming, pipeline (one CS-2, every layer resident on the "
                                  "wafer) or auto (pipelined when the model fits and is faster)", "weight_streaming")
    num_wgt_servers: int = key("int>0", "MemoryX weight servers", 1)
    num_workers_per_csx: int = key("int>0", "input workers per CS-2", 1)
    swarmx_fanout: int = key("int>1", "children per SwarmX node", 2)
    model_dir: str = key("path", "where checkpoints, logs and metrics go", "model_dir")
    seed: int = key("int>=0", "seed of the model initialisation and of the dropout masks", 0)
    eval_frequency: int | None = key("int>0?", "evaluate on eval_input every N steps and after the last (null: "
                                     "never)", None)
    eval_steps: int | None = key("int>0?", "batches of eval_input an evaluation reads (null: all of it)", None)
    peer_timeout: int = key("int>0", "seconds a silent peer is waited for beyond twice the longest step so far and "
                            "a checkpoint's write (until a step has set the pace: beyond startup_timeout) before the "
                            "job ends; also how long a stopped rank is given", 20)
    hardware: MappingProxyType = key("hardware", "constants of the emulated hardware to override "
                                     "(wse_core.perf.Hardware: io_gbps, clock_hz, precision, ...)",
                                     factory=lambda: MappingProxyType({}))
    startup_timeout: int = key("int>0", "seconds every rank has to start (imports, connecting, loading its "
                               "checkpoint) before the job is ended", 300)
    allow_numerics_change: bool = key("bool", "resume from a checkpoint written under another numerics environment "
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
