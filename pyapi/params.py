"""The params YAML: its schema, validation with errors that name the key path, and overrides.

Sections and keys follow Model Zoo where they exist. ``model`` is checked by
``wse_core.models.build_model`` (which knows the models); everything else here. Every error is a
``ParamsError`` whose message starts with the key path: ``optimizer.learning_rate: expected a
number or a list of schedulers, got 'fast'``. A key whose default is null may be given as null
(the default), so the resolved ``params.yaml`` a run writes loads again.

YAML is read by one loader (``parse_yaml``) for files and ``--set`` values alike: it refuses
duplicate keys (naming the key path and both lines), a document that expands to more than
``MAX_VALUES`` values (an alias bomb) or nests deeper than ``MAX_DEPTH``; values in messages are
shortened (``show``), so no message is ever larger than a line. A params file is a regular file of
at most ``MAX_BYTES`` (``read``: a FIFO or a device is refused before a byte is read).
"""
import copy
import os
import stat
import warnings
from dataclasses import fields
from pathlib import Path

import yaml

from mpi_launch.rundir import RunDir
from mpi_launch.spec import SECTIONS, RunSpec
from pyapi import modelzoo
from wse_core.checks import check_fields, did_you_mean, plural, show
from wse_core.errors import ConfigError, PlanError
from wse_core.microbatch import MicroBatches, share
from wse_core.perf import Hardware
# wse_core.models and mpi_launch.resolved are imported where used: they load the kernels, which come after
# configure_process() (wse_core/__init__.py), never on importing the params.

#: Values (scalars, lists, mappings; an alias counted each time it is used) a params document may
#: expand to: a real one has a few hundred; an alias bomb has billions.
MAX_VALUES = 100_000
#: Levels of nesting a params document may have: a real one has four or five.
MAX_DEPTH = 32
#: Bytes a params file may have: a real one has a few kilobytes; more is not read (/dev/zero would fill memory).
MAX_BYTES = 1 << 20
#: Where `wse demo` (pyapi.demo) writes its data and params.yaml: in the directory it runs in. The example
#: params files read that data by these relative paths, as every relative path of a params file is read: from
#: the directory the command runs in.
DEMO_DIR = Path("wse_demo")
#: wse-cluster's bound on a CS-2's micro-batches a step: each is a round of the simulated clock's walk
#: (16,384 of a 4-block GPT-2 took 10 s to lay out); real runs take tens.
MAX_ROUNDS = 1_024



class ParamsError(ConfigError):
    """A params file is unreadable or a key is unknown, missing or of the wrong type (a ValueError).

    ``report`` (a ``modelzoo.KeyReport``, when the keys were sorted) holds every key's fate."""

    def __init__(self, message, report=None):
        super().__init__(message)
        self.report = report


SECTIONS_REQUIRED = ("train_input", "model", "optimizer", "runconfig")


def _name(key):
    """A key for a message: as written, unless it is long or not a string."""
    return key if isinstance(key, str) and len(key) <= 60 else show(key)


def validate(raw):
    """Check a params dict of either layout (docs/design/params.md "The params YAML"); return its ``RunSpec``.

    Every problem is gathered before anything is raised: a file with five unknown or unbuilt keys
    gets one ``ParamsError`` naming all five. Keys that only tune a real system are listed in one
    ``ParamsWarning``.
    """
    spec, _ = check(raw)
    return spec


def check(raw, where="params", overrides=(), *, values=None, compile_only=False):
    """``validate``, also returning the ``KeyReport`` (each key's fate, and the notes). ``overrides``
    (``key.path=value``) may use either layout's paths: ``trainer.init.model.hidden_size=64`` or
    ``model.hidden_size=64`` on a file of the trainer layout. ``values``: {flat ``key.path``: value}
    set after them, as given (``wse fit --num_csx 2`` is the int 2, not YAML text to parse again). ``compile_only``: the params are laid
    out, not run (``wse compile``), so ``micro_batch_size: explore`` is allowed, and the keys accepted
    without effect are listed (one warning): said where a file is looked at, not again by every command
    that runs it (a Model Zoo file has them in every run; ``wse params keys`` lists them too)."""
    report = modelzoo.KeyReport()
    report.compile_only = compile_only
    flat, problems = _flat(raw, report, list(overrides or ()), values)
    try:
        spec = _validate_flat(flat, report, problems)
    finally:  # what was inferred is said even when the file is refused: it explains the refusal
        for note in report.notes:
            warnings.warn(modelzoo.ParamsWarning(f"{where}: {note}"), stacklevel=3)
    if compile_only:
        modelzoo.warn_tuning(where, report)
    return spec, report


def _flat(raw, report, overrides, values=None):
    if not isinstance(raw, dict):
        raise ParamsError(f"params: expected a mapping of sections, got {type(raw).__name__}")
    problems = []
    ours = [o for o in overrides if not o.strip().startswith("trainer.")]
    if modelzoo.is_trainer_layout(raw):
        raw = apply_overrides(raw, [o for o in overrides if o.strip().startswith("trainer.")])
        try:
            raw, unknown = modelzoo.flatten(raw, report.origins)
        except ValueError as exc:
            raise ParamsError(str(exc)) from None
        for path in unknown:
            report.fates[path] = "refused: unknown key"
            problems.append(f"{_name(path)}: unknown key of the trainer layout")
    elif len(ours) != len(overrides):
        raise ParamsError(f"--set {_name(next(o for o in overrides if o not in ours))}: this file has the "
                          "flat layout (train_input, model, optimizer, runconfig), not trainer")
    return modelzoo.sort_keys(apply_overrides(raw, ours, values), report), problems


def _validate_flat(raw, report, problems):
    for path, why in report.refused:
        if not any(p.startswith(path + ":") for p in problems):
            problems.append(f"{path}: {why}")
    for section in raw:
        if section not in SECTIONS and section != "model":
            report.fates[_name(section)] = "refused: unknown section"
            problems.append(f"{_name(section)}: unknown section ({did_you_mean(section, sorted([*SECTIONS, 'model']))})")
    for section in SECTIONS_REQUIRED:
        if section not in raw:
            problems.append(f"{section}: missing section")
    out = {}
    for section, cls in SECTIONS.items():
        if section not in raw:
            continue
        given = raw[section] if raw[section] is not None else {}
        if not isinstance(given, dict):
            problems.append(f"{section}: expected a mapping, got {show(given)}")
            continue
        known = {f.name for f in fields(cls)}
        for key in given:
            report.fates.setdefault(f"{section}.{_name(key)}", "honoured" if key in known else "refused: unknown key")
        out[section] = check_fields(cls, given, section, problems)
    if isinstance(raw.get("model"), dict):
        from wse_core.models import build_model

        try:
            report.model = build_model(raw["model"])  # the run's model, built once (mpi_launch.resolved)
            out["model"] = report.model.config
            for key in raw["model"]:
                report.fates.setdefault(f"model.{key}", "honoured")
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    elif "model" in raw:
        problems.append(f"model: expected a mapping, got {show(raw['model'])}")
    if not problems:
        try:
            _check_consistency(out, report)
        except (ParamsError, PlanError) as exc:  # a micro-batch the wafer cannot take (check_wafer) too
            problems.append(str(exc))
    if len(problems) == 1:
        raise ParamsError(problems[0], report)
    if problems:
        raise ParamsError(f"{len(problems)} keys cannot be used as given (all of them are listed; "
                          "fix them and run again):\n  " + "\n  ".join(problems), report)
    return RunSpec.from_dict(out)


def _check_consistency(p, report):
    t, r = p["train_input"], p["runconfig"]
    if r["execution_strategy"] == "pipeline" and r["num_csx"] != 1:
        raise ParamsError(f"runconfig.execution_strategy: pipeline runs on one CS-2, not runconfig.num_csx "
                          f"{r['num_csx']} (use weight_streaming, or auto)")
    if (t["data_dir"] is None) == (t["mixture"] is None):
        raise ParamsError("train_input: give one of data_dir or mixture" + (
            " (not both)" if t["data_dir"] is not None else " (the data to read)"))
    if t["batch_size"] < r["num_csx"]:
        raise ParamsError(f"train_input.batch_size: {t['batch_size']} samples cannot feed runconfig.num_csx "
                          f"{r['num_csx']} CS-2s")
    _resolve_micro_batch(p, report)
    batches = MicroBatches(t["batch_size"], t["micro_batch_size"], r["num_csx"])
    per_csx, rounds = batches.per_csx, batches.rounds
    if rounds > MAX_ROUNDS:
        raise ParamsError(f"train_input.micro_batch_size: {t['micro_batch_size']} deals each CS-2's {per_csx:,} "
                          f"samples in {rounds:,} micro-batches a step, more than {MAX_ROUNDS:,}, wse-cluster's bound "
                          "on micro-batches (use larger ones, more CS-2s or a smaller batch)")
    if not report.compile_only:  # `wse compile` prints it in its plan ("bit-identical to the ...: no")
        _note_bits(p, report)
    if p["model"].get("fp16_type") == "cbfloat16" and p["model"].get("mixed_precision") \
            and p["optimizer"]["loss_scaling_factor"] != "dynamic":
        raise ParamsError("optimizer.loss_scaling_factor: cbfloat16 needs dynamic loss scaling (as in Model Zoo): "
                          "set loss_scaling_factor: dynamic")
    if p["optimizer"]["adjust_learning_rate"]:
        try:
            report.model.lr_factors(p["optimizer"]["adjust_learning_rate"])
        except ValueError as exc:
            raise ParamsError(str(exc)) from None
    if r["eval_frequency"] is not None and "eval_input" not in p:
        raise ParamsError("runconfig.eval_frequency: evaluating during training needs an eval_input section "
                          "(data_dir, batch_size)")


def _resolve_micro_batch(p, report):
    """Turn ``train_input.micro_batch_size`` into a number of samples (docs/design/time-model.md
    "Micro-batching" and "Wafer memory"), one of the sizes that deal the batch evenly
    (``MicroBatches.even_sizes``): a number as given, or the next of those sizes up (said);
    ``none`` each CS-2's share; ``auto`` (or no key) the largest size whose micro-batch fits a wafer
    in weight streaming, the share itself whenever it fits (a pipelined run keeps the share);
    ``explore`` as ``auto``, for ``wse compile`` only, which then prints every candidate."""
    from mpi_launch.resolved import check_wafer

    t, r = p["train_input"], p["runconfig"]
    per_csx = share(t["batch_size"], r["num_csx"])
    sizes = MicroBatches.even_sizes(t["batch_size"], r["num_csx"])
    given = t["micro_batch_size"]
    report.micro_batch_mode = given if isinstance(given, str) else ("auto" if given is None else "number")
    if given == "explore" and not report.compile_only:
        raise ParamsError("train_input.micro_batch_size: explore searches the sizes when the params are compiled "
                          "(wse compile); give a number, or auto")
    if isinstance(given, int):
        if given > per_csx:
            raise ParamsError(f"train_input.micro_batch_size: {given} is more than the {per_csx} samples each CS-2 "
                              f"gets (batch_size / num_csx, rounded up)")
        size = min(b for b in sizes if b >= given)
        if size != given:
            t["micro_batch_size"] = size
            report.notes.append(f"train_input.micro_batch_size: {given} is taken as {size}, which deals the "
                                f"batch of {t['batch_size']} evenly across {r['num_csx']} CS-2s and their "
                                f"micro-batches (as many rounds)")
        return
    if given == "none" or r["execution_strategy"] == "pipeline":
        t["micro_batch_size"] = per_csx
        return
    try:
        hw = Hardware.for_model(report.model, r["hardware"])
    except ValueError as exc:
        raise ParamsError(str(exc)) from None
    best = check_wafer(report.model, t["batch_size"], r["num_csx"], None, p["model"].get("max_position_embeddings"), hw)
    t["micro_batch_size"] = best
    if best != per_csx:
        report.notes.append(f"train_input.micro_batch_size: {given or 'auto'} chose {best}: the largest that fits a "
                            f"CS-2's wafer and deals its {per_csx} samples evenly "
                            '(docs/design/time-model.md "Wafer memory")')


def demo_hint(dirs):
    """What an error about a missing data directory adds when one of ``dirs`` is a directory `wse demo`
    makes (DEMO_DIR/..., relative, absent): what makes it, and where. "" otherwise."""
    for d in map(Path, dirs):
        if not d.is_absolute() and d.parts[:1] == DEMO_DIR.parts and not d.exists():
            return (f"; `wse demo` makes {DEMO_DIR}/ in the directory it runs in: run it once here, or run this "
                    "where you ran it")
    return ""


def parse_override(item):
    """A ``--set`` value, ``key.path=value``: (its key path's parts, the value's text); ParamsError naming
    it otherwise."""
    if "=" not in item:
        raise ParamsError(f"--set {_name(item)}: expected key.path=value as one argument (no spaces around =)")
    path, text = item.split("=", 1)
    parts = path.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ParamsError(f"--set {_name(item)}: expected section.key=value")
    return parts, text


def _note_bits(p, report):
    """Say when the run's micro-batches are summed in an order of their own, so its weights will not have
    the bits of the single-process reference nor of another num_csx (docs/design.md section 5, the
    determinism contract, (a); ``MicroBatches.sums_as_one``): `--num_csx 3` trains, but not as
    1, 2 or 4 CS-2s do, and a user comparing them should not have to find that out."""
    t, r = p["train_input"], p["runconfig"]
    batches = MicroBatches(t["batch_size"], t["micro_batch_size"], r["num_csx"])
    rounds = batches.rounds
    if not batches.sums_as_one(r["swarmx_fanout"]):
        report.notes.append(
            f"runconfig.num_csx: {r['num_csx']} CS-2s ({plural(rounds, 'micro-batch')} each, SwarmX fan-out "
            f"{r['swarmx_fanout']}) sum the gradients in another order than one process: the weights' bits differ "
            "from the single-process reference's and from those of 1, 2 or 4 CS-2s (the same bits need a power of "
            "two of micro-batches per CS-2, and num_csx at most swarmx_fanout or both powers of two; "
            "docs/design.md section 5)")
    elif not batches.aligned:
        report.notes.append(
            f"train_input.micro_batch_size: {batches.size} makes {batches.count} micro-batches, which are not halvings "
            "of the batch: the weights' bits are the single-process reference's at this size, but differ from "
            "other micro-batch sizes' (a power of two of micro-batches keeps them; docs/design.md section 5)")


def apply_overrides(raw, overrides, values=None):
    """Apply ``key.path=value`` strings (values parsed as YAML), then ``values`` ({``key.path``: value},
    values as given: a command line's own options, which its parser has typed already), to a copy of ``raw``."""
    if not isinstance(raw, dict):
        raise ParamsError(f"params: expected a mapping of sections, got {type(raw).__name__}")
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        parts, text = parse_override(item)
        try:
            value = parse_yaml(text, f"--set {_name(item)}")
        except yaml.YAMLError as exc:
            raise ParamsError(f"--set {_name(item)}: value is not valid YAML ({getattr(exc, 'problem', exc)})") from None
        _set(raw, parts, value, f"--set {_name(item)}")
    for path, value in (values or {}).items():
        _set(raw, path.split("."), value, path)
    return raw


def _set(raw, parts, value, where):
    node = raw
    for part in parts[:-1]:
        if node.get(part) is None:  # absent, or an empty section (``train_input:``)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ParamsError(f"{where}: {part} is not a section")
    node[parts[-1]] = value


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


def params_file(path):
    """The params file ``path`` names: itself, or a run directory's resolved params (its params.yaml, which
    loads again: `wse validate runs/x` evaluates the run as it ran); a ParamsError for another directory."""
    p = Path(path)
    if not p.is_dir():
        return p
    resolved = RunDir(p).params_yaml
    if resolved.is_file():
        return resolved
    raise ParamsError(f"{p}: a directory, not a params file (a run's model_dir holds its params as "
                      f"{resolved.name}; this one has none)")


def read(path):
    """A params YAML file (or a run directory's: ``params_file``) as plain data (a mapping), or a
    ParamsError naming the file."""
    p = params_file(path)
    data = _read_bytes(p)
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


#: What a path that is not a regular file is, for the message that refuses it.
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _read_bytes(p):
    """The bytes of the params file ``p``: a regular file, of at most MAX_BYTES. Opened without blocking
    and checked before a byte is read: a FIFO would wait for a writer forever, a device never end."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ParamsError(f"{p}: cannot read ({exc.strerror})") from None
    with open(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "a special file")
            raise ParamsError(f"{p}: {kind}, not a params file (a regular YAML file)")
        try:
            data = f.read(MAX_BYTES + 1)
        except OSError as exc:
            raise ParamsError(f"{p}: cannot read ({exc.strerror})") from None
    if len(data) > MAX_BYTES:
        raise ParamsError(f"{p}: more than {MAX_BYTES:,} bytes, wse-cluster's bound on a params file (a real one "
                          "has a few kilobytes)")
    return data


def load(path, overrides=None, *, values=None, compile_only=False, with_report=False):
    """Read, override and validate a params YAML file of either layout (or a run directory's): its ``RunSpec``
    (with ``with_report``, also the ``KeyReport``, which holds the model the validation built)."""
    path = params_file(path)
    spec, report = check(read(path), str(path), overrides, values=values, compile_only=compile_only)
    return (spec, report) if with_report else spec
