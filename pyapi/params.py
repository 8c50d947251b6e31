"""The params YAML: its schema, validation with errors that name the key path, and overrides.

Sections and keys follow Model Zoo where they exist. ``model`` is checked by
``wse_core.nn.build_model`` (which knows the models); everything else here. Every error is a
``ParamsError`` whose message starts with the key path: ``optimizer.learning_rate: expected a
number or a list of schedulers, got 'fast'``. A key whose default is null may be given as null
(the default), so the resolved ``params.yaml`` a run writes loads again.

YAML is read by one loader (``parse_yaml``) for files and ``--set`` values alike: it refuses
duplicate keys (naming the key path and both lines), a document that expands to more than
``MAX_VALUES`` values (an alias bomb) or nests deeper than ``MAX_DEPTH``; values in messages are
shortened (``show``), so no message is ever larger than a line.
"""
import copy
import math
import warnings
from dataclasses import dataclass, fields, make_dataclass
from pathlib import Path
from types import MappingProxyType

import yaml

from pyapi import modelzoo
from wse_core._checks import did_you_mean, show

#: Values (scalars, lists, mappings; an alias counted each time it is used) a params document may
#: expand to: a real one has a few hundred; an alias bomb has billions.
MAX_VALUES = 100_000
#: Levels of nesting a params document may have: a real one has four or five.
MAX_DEPTH = 32



class ParamsError(ValueError):
    """A params file is unreadable or a key is unknown, missing or of the wrong type.

    ``report`` (a ``modelzoo.KeyReport``, when the keys were sorted) holds every key's fate."""

    def __init__(self, message, report=None):
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class Key:
    """One allowed key: its type check, default (``REQUIRED`` if none) and help."""

    kind: str
    default: object
    help: str


REQUIRED = object()
STRATEGIES = ("weight_streaming", "pipeline", "auto")

SCHEMA = {
    "train_input": {
        "data_dir": Key("paths", None, "directory of HDF5 training shards (or a list of them); or mixture"),
        "mixture": Key("mixture", None, "datasets mixed in proportion: a list of {data_dir, weight} (Model Zoo's)"),
        "batch_size": Key("int>0", REQUIRED, "global batch size, split evenly across the CS-2s"),
        "micro_batch_size": Key("int>0", None, "samples per micro-batch (default: batch_size / num_csx)"),
        "shuffle": Key("bool", True, "shuffle examples each epoch"),
        "shuffle_seed": Key("int>=0", 0, "seed of the per-epoch shuffle"),
    },
    "eval_input": {
        "data_dir": Key("paths", REQUIRED, "directory of HDF5 evaluation shards (or a list of them)"),
        "batch_size": Key("int>0", REQUIRED, "evaluation batch size"),
        "micro_batch_size": Key("int>0", None, "samples per micro-batch"),
    },
    "optimizer": {
        "optimizer_type": Key("str", "AdamW", "SGD, Adam or AdamW"),
        "learning_rate": Key("lr", REQUIRED, "a number, or a list of schedulers (Linear, CosineDecay, Constant)"),
        "weight_decay": Key("float>=0", 0.0, "L2 (SGD, Adam) or decoupled (AdamW) weight decay"),
        "betas": Key("betas", [0.9, 0.999], "Adam/AdamW moment decay rates"),
        "eps": Key("float>=0", 1e-8, "Adam/AdamW denominator term"),
        "momentum": Key("float>=0", 0.0, "SGD momentum"),
        "nesterov": Key("bool", False, "SGD Nesterov momentum"),
        "max_gradient_norm": Key("float>0?", None, "clip the global gradient norm to this value"),
        "loss_scaling_factor": Key("lossscale", 1.0, "scale of the loss for 16-bit gradients: a number, or dynamic"),
        "initial_loss_scale": Key("float>0?", None, "dynamic loss scaling: the first scale (2^15; 2^31 for cbfloat16)"),
        "max_loss_scale": Key("float>0?", None, "dynamic loss scaling: the largest scale (2^15; 2^31 for cbfloat16)"),
        "min_loss_scale": Key("float>0?", None, "dynamic loss scaling: the smallest scale (2^-14)"),
        "steps_per_increase": Key("int>0?", None, "dynamic loss scaling: finite steps before the scale doubles (2000)"),
        "adjust_learning_rate": Key("lradjust", None, "learning-rate scale per parameter group (Model Zoo's: "
                                    "embedding, decoder_kernel, decoder_attention, decoder_input_ffn, decoder_output_ffn)"),
    },
    "runconfig": {
        "max_steps": Key("int>0", REQUIRED, "training steps"),
        "checkpoint_steps": Key("int>=0", 0, "save a checkpoint every N steps (0: only at the end)"),
        "save_initial_checkpoint": Key("bool", False, "also save before the first step"),
        "log_steps": Key("int>0", 1, "log every N steps"),
        "num_csx": Key("int>0", 1, "CS-2 systems"),
        "execution_strategy": Key("strategy", "weight_streaming", "weight_streaming, pipeline (one CS-2, every "
                                  "layer resident on the wafer) or auto (pipelined when the model fits and is faster)"),
        "num_wgt_servers": Key("int>0", 1, "MemoryX weight servers"),
        "num_workers_per_csx": Key("int>0", 1, "input workers per CS-2"),
        "swarmx_fanout": Key("int>1", 2, "children per SwarmX node"),
        "model_dir": Key("path", "model_dir", "where checkpoints, logs and metrics go"),
        "seed": Key("int>=0", 0, "seed of the model initialisation and of the dropout masks"),
        "eval_frequency": Key("int>0?", None, "evaluate on eval_input every N steps and after the last (null: never)"),
        "eval_steps": Key("int>0?", None, "batches of eval_input an evaluation reads (null: all of it)"),
        "peer_timeout": Key("int>0", 20, "seconds a silent peer is waited for beyond twice the longest step so far and a checkpoint's write (until a step has set the pace: beyond startup_timeout) before the job ends; also how long a stopped rank is given"),
        "hardware": Key("hardware", {}, "constants of the emulated hardware to override (wse_core.perf.Hardware: "
                                        "io_gbps, clock_hz, precision, ...)"),
        "startup_timeout": Key("int>0", 300, "seconds every rank has to start (imports, connecting, loading its "
                                            "checkpoint) before the job is ended"),
        "allow_numerics_change": Key("bool", False, "resume from a checkpoint written under another numerics "
                                     "environment (BLAS kernel, numpy): the continuation's bits then differ from an "
                                     "uninterrupted run's; refused unless true"),
    },
}
SECTIONS_REQUIRED = ("train_input", "model", "optimizer", "runconfig")


# -- the run spec: what mpi_launch and every rank receive ------------------------------------------

_TYPES = {"strategy": str, "path": str, "paths": str | tuple | None, "mixture": tuple | None, "str": str, "bool": bool, "int>0": int, "int>1": int, "int>=0": int,
          "float>=0": float, "float>0?": float | None, "int>0?": int | None, "lossscale": float | str,
          "lradjust": MappingProxyType | None, "betas": tuple, "hardware": MappingProxyType, "lr": object}


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


def _section_class(section, class_name):
    cls = make_dataclass(class_name, [(k, _TYPES[key.kind]) for k, key in SCHEMA[section].items()],
                         frozen=True)
    cls.__module__ = __name__  # make_dataclass names its own module otherwise (pickle needs this one)
    cls.__doc__ = f"The validated ``{section}`` section (every default filled in; read-only)."
    return cls


TrainInput = _section_class("train_input", "TrainInput")
EvalInput = _section_class("eval_input", "EvalInput")
OptimizerSpec = _section_class("optimizer", "OptimizerSpec")
RunConfig = _section_class("runconfig", "RunConfig")
_SECTION_CLASSES = {"train_input": TrainInput, "eval_input": EvalInput, "optimizer": OptimizerSpec,
                    "runconfig": RunConfig}


@dataclass(frozen=True)
class RunSpec:
    """A validated run: one typed, read-only section per params section; ``model`` is the model's
    normalised config (``wse_core.nn.build_model(spec.model)`` rebuilds it). ``to_dict`` is the flat
    params layout, which ``validate`` takes back unchanged (the resolved ``params.yaml`` of a run)."""

    train_input: TrainInput
    model: MappingProxyType
    optimizer: OptimizerSpec
    runconfig: RunConfig
    eval_input: EvalInput | None = None

    @classmethod
    def from_dict(cls, d):
        """From an already validated flat dict (``validate``'s result, or a run's ``run.json``)."""
        sections = {name: c(**{f.name: freeze(d[name][f.name]) for f in fields(c)})
                    for name, c in _SECTION_CLASSES.items() if d.get(name) is not None}
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


def _name(key):
    """A key for a message: as written, unless it is long or not a string."""
    return key if isinstance(key, str) and len(key) <= 60 else show(key)


def _check(path, kind, value):
    def bad(expected):
        return ParamsError(f"{path}: expected {expected}, got {show(value)}")

    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_num = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "path" or kind == "str":
        if not isinstance(value, str) or not value:
            raise bad("a non-empty string")
    elif kind == "paths":
        if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
            return value
        if not isinstance(value, str) or not value:
            raise bad("a directory or a non-empty list of directories")
    elif kind == "strategy":
        if value not in STRATEGIES:
            raise bad(" or ".join(STRATEGIES))
    elif kind == "mixture":
        if not (isinstance(value, list) and value and all(
                isinstance(m, dict) and set(m) >= {"data_dir", "weight"} and set(m) <= {"data_dir", "weight", "data_subset"}
                and isinstance(m["data_dir"], str) and m["data_dir"] and isinstance(m["weight"], (int, float))
                and not isinstance(m["weight"], bool) and 0 <= m["weight"] < math.inf for m in value)
                and any(m["weight"] > 0 for m in value)):
            raise bad("a list of {data_dir: DIR, weight: number >= 0}, some weight > 0")
        if any("data_subset" in m for m in value):
            raise ParamsError(f"{path}: data_subset is not built (use each directory whole)")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
    elif kind.startswith("int>"):
        low = 1 if kind == "int>0" else (2 if kind == "int>1" else 0)
        if not is_int or value < low:
            raise bad(f"an integer >= {low}")
    elif kind == "float>=0":
        if not is_num or value < 0:
            raise bad("a number >= 0")
    elif kind == "float>0?":
        if value is not None and (not is_num or value <= 0):
            raise bad("a number > 0 (or null)")
    elif kind == "int>0?":
        if value is not None and (not is_int or value < 1):
            raise bad("an integer >= 1 (or null)")
    elif kind == "lradjust":
        if value is not None and not (isinstance(value, dict) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf for v in value.values())):
            raise bad("a mapping of parameter groups to scales > 0")
    elif kind == "lossscale":
        if value != "dynamic" and (not is_num or value <= 0):
            raise bad("a number > 0 or dynamic")
    elif kind == "betas":
        if not (isinstance(value, (list, tuple)) and len(value) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)):
            raise bad("two numbers in [0, 1)")
    elif kind == "hardware":
        from wse_core.perf import Hardware

        if not isinstance(value, dict):
            raise bad("a mapping of hardware constants")
        try:
            Hardware.from_params(value)
        except (TypeError, ValueError) as exc:
            raise ParamsError(str(exc)) from None
    elif kind == "lr":
        from wse_core.optim import make_schedule

        if isinstance(value, str):
            raise bad("a number or a list of schedulers")
        try:
            make_schedule(value, key=path)
        except (TypeError, ValueError) as exc:
            raise ParamsError(str(exc)) from None
    return value


def validate(raw):
    """Check a params dict of either layout (docs/design.md section 5); return its ``RunSpec``.

    Every problem is gathered before anything is raised: a file with five unknown or unbuilt keys
    gets one ``ParamsError`` naming all five. Keys that only tune a real system are listed in one
    ``ParamsWarning``.
    """
    spec, _ = check(raw)
    return spec


def check(raw, where="params", overrides=()):
    """``validate``, also returning the ``KeyReport`` (each key's fate, and the notes). ``overrides``
    (``key.path=value``) may use either layout's paths: ``trainer.init.model.hidden_size=64`` or
    ``model.hidden_size=64`` on a file of the trainer layout."""
    report = modelzoo.KeyReport()
    flat, problems = _flat(raw, report, list(overrides or ()))
    try:
        spec = _validate_flat(flat, report, problems)
    finally:  # what was inferred is said even when the file is refused: it explains the refusal
        for note in report.notes:
            warnings.warn(modelzoo.ParamsWarning(f"{where}: {note}"), stacklevel=3)
    modelzoo.warn_tuning(where, report)
    return spec, report


def _flat(raw, report, overrides):
    if not isinstance(raw, dict):
        raise ParamsError(f"params: expected a mapping of sections, got {type(raw).__name__}")
    problems = []
    ours = [o for o in overrides if not o.strip().startswith("trainer.")]
    if modelzoo.is_trainer_layout(raw):
        raw = apply_overrides(raw, [o for o in overrides if o.strip().startswith("trainer.")])
        try:
            raw, unknown = modelzoo.flatten(raw)
        except ValueError as exc:
            raise ParamsError(str(exc)) from None
        for path in unknown:
            report.fates[path] = "refused: unknown key"
            problems.append(f"{_name(path)}: unknown key of the trainer layout")
    elif len(ours) != len(overrides):
        raise ParamsError(f"--set {_name(next(o for o in overrides if o not in ours))}: this file has the "
                          "flat layout (train_input, model, optimizer, runconfig), not trainer")
    return modelzoo.sort_keys(apply_overrides(raw, ours), report), problems


def _validate_flat(raw, report, problems):
    for path, why in report.refused:
        if not any(p.startswith(path + ":") for p in problems):
            problems.append(f"{path}: {why}")
    for section in raw:
        if section not in SCHEMA and section != "model":
            report.fates[_name(section)] = "refused: unknown section"
            problems.append(f"{_name(section)}: unknown section ({did_you_mean(section, sorted([*SCHEMA, 'model']))})")
    for section in SECTIONS_REQUIRED:
        if section not in raw:
            problems.append(f"{section}: missing section")
    out = {}
    for section, keys in SCHEMA.items():
        if section not in raw:
            continue
        given = raw[section] if raw[section] is not None else {}
        if not isinstance(given, dict):
            problems.append(f"{section}: expected a mapping, got {show(given)}")
            continue
        for key in given:
            if key not in keys:
                report.fates[f"{section}.{_name(key)}"] = "refused: unknown key"
                problems.append(f"{section}.{_name(key)}: unknown key ({did_you_mean(key, keys)})")
        out[section] = {}
        for key, spec in keys.items():
            try:
                if key in given and not (given[key] is None and spec.default is None):
                    out[section][key] = _check(f"{section}.{key}", spec.kind, given[key])
                    report.fates.setdefault(f"{section}.{key}", "honoured")
                elif spec.default is REQUIRED:
                    raise ParamsError(f"{section}.{key}: missing ({spec.help})")
                else:
                    out[section][key] = copy.deepcopy(spec.default)
            except ParamsError as exc:
                problems.append(str(exc))
    if isinstance(raw.get("model"), dict):
        from wse_core.nn import build_model

        try:
            out["model"] = build_model(raw["model"]).config
            for key in raw["model"]:
                report.fates.setdefault(f"model.{key}", "honoured")
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    elif "model" in raw:
        problems.append(f"model: expected a mapping, got {show(raw['model'])}")
    if not problems:
        try:
            _check_consistency(out)
        except ParamsError as exc:
            problems.append(str(exc))
    if len(problems) == 1:
        raise ParamsError(problems[0], report)
    if problems:
        raise ParamsError(f"{len(problems)} keys cannot be used as given (all of them are listed; "
                          "fix them and run again):\n  " + "\n  ".join(problems), report)
    return RunSpec.from_dict(out)


#: Optimizers a Model Zoo params file may name that are not built here: refused by name, not as unknown.
MODEL_ZOO_OPTIMIZERS_NOT_BUILT = ("lamb", "adafactor", "lion", "adadelta", "adagrad", "adamax", "asgd", "nadam",
                                  "radam", "rmsprop", "rprop", "muon")


def _check_consistency(p):
    t, r = p["train_input"], p["runconfig"]
    if r["execution_strategy"] == "pipeline" and r["num_csx"] != 1:
        raise ParamsError(f"runconfig.execution_strategy: pipeline runs on one CS-2, not runconfig.num_csx "
                          f"{r['num_csx']} (use weight_streaming, or auto)")
    if (t["data_dir"] is None) == (t["mixture"] is None):
        raise ParamsError("train_input: give one of data_dir or mixture" + (
            " (not both)" if t["data_dir"] is not None else " (the data to read)"))
    if t["batch_size"] % r["num_csx"]:
        raise ParamsError(f"train_input.batch_size: {t['batch_size']} does not split evenly across "
                          f"runconfig.num_csx {r['num_csx']}")
    per_csx = t["batch_size"] // r["num_csx"]
    if t["micro_batch_size"] is None:
        t["micro_batch_size"] = per_csx
    if per_csx % t["micro_batch_size"]:
        raise ParamsError(f"train_input.micro_batch_size: {t['micro_batch_size']} does not divide the "
                          f"{per_csx} samples each CS-2 gets (batch_size / num_csx)")
    if p["model"].get("fp16_type") == "cbfloat16" and p["model"].get("mixed_precision") \
            and p["optimizer"]["loss_scaling_factor"] != "dynamic":
        raise ParamsError("optimizer.loss_scaling_factor: cbfloat16 needs dynamic loss scaling (as in Model Zoo): "
                          "set loss_scaling_factor: dynamic")
    if p["optimizer"]["adjust_learning_rate"]:
        from wse_core.nn import build_model

        try:
            build_model(p["model"]).lr_factors(p["optimizer"]["adjust_learning_rate"])
        except ValueError as exc:
            raise ParamsError(str(exc)) from None
    if r["eval_frequency"] is not None and "eval_input" not in p:
        raise ParamsError("runconfig.eval_frequency: evaluating during training needs an eval_input section "
                          "(data_dir, batch_size)")
    kind = p["optimizer"]["optimizer_type"]
    if kind.lower() in MODEL_ZOO_OPTIMIZERS_NOT_BUILT:
        raise ParamsError(f"optimizer.optimizer_type: {kind} is one of Model Zoo's optimizers that wse-cluster "
                          "does not implement (implemented: SGD, Adam, AdamW)")
    if kind.lower() not in ("sgd", "adam", "adamw"):
        raise ParamsError(f"optimizer.optimizer_type: unknown optimizer {show(kind)} (known: SGD, Adam, AdamW)")


def apply_overrides(raw, overrides):
    """Apply ``key.path=value`` strings (values parsed as YAML) to a copy of ``raw``."""
    if not isinstance(raw, dict):
        raise ParamsError(f"params: expected a mapping of sections, got {type(raw).__name__}")
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        if "=" not in item:
            raise ParamsError(f"--set {_name(item)}: expected key.path=value")
        path, text = item.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) < 2 or not all(parts):
            raise ParamsError(f"--set {_name(item)}: expected section.key=value")
        try:
            value = parse_yaml(text, f"--set {_name(item)}")
        except yaml.YAMLError as exc:
            raise ParamsError(f"--set {_name(item)}: value is not valid YAML ({getattr(exc, 'problem', exc)})") from None
        node = raw
        for part in parts[:-1]:
            if node.get(part) is None:  # absent, or an empty section (``train_input:``)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ParamsError(f"--set {_name(item)}: {part} is not a section")
        node[parts[-1]] = value
    return raw


def parse_yaml(text, where):
    """One YAML document, refused (ParamsError naming ``where``, the line and the key path) if it
    repeats a key, nests deeper than MAX_DEPTH or expands to more than MAX_VALUES values."""
    loader = yaml.SafeLoader(text)  # composed, checked by _check_node, and only then built
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ParamsError(f"{where}: nested too deeply (more than {MAX_DEPTH} levels)") from None
        if node is None:
            return None
        _check_node(node, where)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_node(root, where):
    sizes = {}     # id(node) -> values it expands to: each node is walked once, however often it is aliased
    active = set()

    def walk(node, path, depth):
        key = id(node)
        if key in sizes:
            return sizes[key]
        line = node.start_mark.line + 1
        if key in active:
            raise ParamsError(f"{where}: line {line}: {path or 'the document'}: contains itself (a recursive alias)")
        if depth > MAX_DEPTH:
            raise ParamsError(f"{where}: line {line}: {path}: nested too deeply (more than {MAX_DEPTH} levels)")
        active.add(key)
        size = 1
        if isinstance(node, yaml.MappingNode):
            first = {}
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else "?"
                inner = f"{path}.{name}" if path else name
                if isinstance(k, yaml.ScalarNode) and name != "<<":
                    if name in first:
                        raise ParamsError(f"{where}: line {k.start_mark.line + 1}: duplicate key {_name(inner)} "
                                          f"(first at line {first[name]})")
                    first[name] = k.start_mark.line + 1
                size += walk(k, inner, depth + 1) + walk(v, inner, depth + 1)
                if size > MAX_VALUES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                size += walk(v, f"{path}[{i}]", depth + 1)
                if size > MAX_VALUES:
                    break
        if size > MAX_VALUES:
            raise ParamsError(f"{where}: line {line}: {path or 'the document'}: expands to more than "
                              f"{MAX_VALUES:,} values (aliases of aliases?)")
        active.discard(key)
        sizes[key] = size
        return size

    walk(root, "", 0)


def read(path):
    """A params YAML file as plain data (a mapping), or a ParamsError naming the file."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ParamsError(f"{p}: cannot read ({exc.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParamsError(f"{p}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    try:
        raw = parse_yaml(text, str(p))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ParamsError(f"{p}: not valid YAML{where} ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{p}: expected a mapping of sections (train_input, model, optimizer, runconfig; or "
                          f"trainer), got {'nothing' if raw is None else type(raw).__name__}")
    return raw


def load(path, overrides=None):
    """Read, override and validate a params YAML file of either layout: its ``RunSpec``."""
    return check(read(path), str(path), overrides)[0]
