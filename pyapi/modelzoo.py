"""Model Zoo params files as they are: both layouts, and a fate for every key.

Model Zoo has written params in two layouts. The *flat* one (1.x to 2.3: sections
``train_input``, ``eval_input``, ``model``, ``optimizer``, ``runconfig``, ``sparsity``) is the one
wse-cluster reads natively. The *trainer* one (2.3 on: ``trainer.init.{model, optimizer, schedulers,
precision, loop, checkpoint, logging, callbacks, backend}``, ``trainer.fit.{train_dataloader,
val_dataloader}``, ``trainer.validate``) is translated into it by ``flatten`` and written back by
``to_trainer`` (``wse params convert``); docs/design/params.md "Both layouts, one spec".

``sort_keys`` then gives every key of a flat params dict its fate (docs/design/params.md "Every key
has a fate"):

- **honoured**: a key wse-cluster implements, under its own name or a Model Zoo alias (1.x
  ``beta1``/``beta2``/``epsilon``/``weight_decay_rate``, ``use_rms_norm``, ...), renamed in place;
- **honoured, same value**: a key naming what wse-cluster always does (``position_embedding_type:
  learned``, ``use_ffn_bias: true``, ``correct_bias: true``); any other value is refused;
- **tuning**: a key that only tunes the hardware, the input pipeline or logging on a real system
  and cannot change the numerics (``data_processor``, ``num_workers``, ``precision_opt_level``):
  accepted, dropped, and listed in one warning;
- **refused**: a key that would change the numerics and is not built (``adjust_learning_rate``, a
  ``sparsity`` section, muP's ``scale_qk_dot_by_d``), or a key nobody knows (a typo): every such key
  goes into one error, so a file is fixed in one pass.

It is one module because both halves are Model Zoo's one contract: a key Model Zoo adds needs its
home in the trainer layout and its fate here, in the same change.
"""
import copy
import warnings
from dataclasses import fields

from mpi_launch.spec import SECTIONS
from wse_core.checks import plural, show
from wse_core.errors import ConfigError
# wse_core.nn.config is imported where used: it loads the kernels, which come after configure_process().

#: Activations of gated feed-forward layers: llama's (swiglu), not built for gpt2.
LLAMA_NONLINEARITIES = ("swiglu", "geglu", "reglu", "relu", "silu", "leaky_relu")


class ParamsWarning(UserWarning):
    """Keys accepted without effect (they tune what an emulator has not got), listed once."""


# -- the trainer layout ---------------------------------------------------------------------------

#: (trainer path under ``trainer.init``, flat path): scalar keys with a fixed home in both layouts.
#: The cluster keys of wse-cluster's own (swarmx_fanout, timeouts, hardware, execution_strategy,
#: which Model Zoo's 2.x layout no longer has) live beside Model Zoo's in ``backend.cluster_config``.
INIT_HOMES = (
    ("model_dir", "runconfig.model_dir"),
    ("seed", "runconfig.seed"),
    ("backend.backend_type", "runconfig.target_device"),
    ("backend.compile_only", "runconfig.compile_only"),
    ("backend.validate_only", "runconfig.validate_only"),
    ("backend.cluster_config.num_csx", "runconfig.num_csx"),
    ("backend.cluster_config.max_wgt_servers", "runconfig.num_wgt_servers"),
    ("backend.cluster_config.num_workers_per_csx", "runconfig.num_workers_per_csx"),
    ("backend.cluster_config.swarmx_fanout", "runconfig.swarmx_fanout"),
    ("backend.cluster_config.peer_timeout", "runconfig.peer_timeout"),
    ("backend.cluster_config.startup_timeout", "runconfig.startup_timeout"),
    ("backend.cluster_config.hardware", "runconfig.hardware"),
    ("backend.cluster_config.execution_strategy", "runconfig.execution_strategy"),
    ("backend.cluster_config.allow_numerics_change", "runconfig.allow_numerics_change"),
    ("precision.enabled", "model.mixed_precision"),
    ("precision.fp16_type", "model.fp16_type"),
    ("precision.precision_opt_level", "runconfig.precision_opt_level"),
    ("precision.loss_scaling_factor", "optimizer.loss_scaling_factor"),
    ("precision.initial_loss_scale", "optimizer.initial_loss_scale"),
    ("precision.steps_per_increase", "optimizer.steps_per_increase"),
    ("precision.min_loss_scale", "optimizer.min_loss_scale"),
    ("precision.max_loss_scale", "optimizer.max_loss_scale"),
    ("precision.max_gradient_norm", "optimizer.max_gradient_norm"),
    ("precision.max_gradient_value", "optimizer.max_gradient_value"),
    ("precision.log_loss_scale", "optimizer.log_summaries"),
    ("loop.max_steps", "runconfig.max_steps"),
    ("loop.num_steps", "runconfig.num_steps"),
    ("loop.num_epochs", "runconfig.num_epochs"),
    ("loop.steps_per_epoch", "runconfig.steps_per_epoch"),
    ("loop.eval_frequency", "runconfig.eval_frequency"),
    ("loop.eval_steps", "runconfig.eval_steps"),
    ("loop.grad_accum_steps", "optimizer.grad_accum_steps"),
    ("checkpoint.steps", "runconfig.checkpoint_steps"),
    ("checkpoint.save_initial_checkpoint", "runconfig.save_initial_checkpoint"),
    ("checkpoint.disable_strict_checkpoint_loading", "runconfig.disable_strict_checkpoint_loading"),
    ("checkpoint.autoload_last_checkpoint", "runconfig.autoload_last_checkpoint"),
    ("logging.log_steps", "runconfig.log_steps"),
    ("logging.log_level", "runconfig.logging"),
)
#: Callbacks whose flags have a flat home: {callback: {flag: flat path}}; ComputeNorm has no
#: arguments (wse-cluster logs the gradient norm anyway).
CALLBACK_HOMES = {
    "ScopedTrainFlags": {"csx.performance.micro_batch_size": "train_input.micro_batch_size"},
    "ScopedValidateFlags": {"csx.performance.micro_batch_size": "eval_input.micro_batch_size"},
    "LoadCheckpointStates": {"load_checkpoint_states": "runconfig.load_checkpoint_states"},
    "ComputeNorm": {},
}


def is_trainer_layout(raw):
    return isinstance(raw, dict) and "trainer" in raw


def _get(d, path):
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None, False
        d = d[part]
    return d, True


def _put(d, path, value):
    *head, last = path.split(".")
    for part in head:
        d = d.setdefault(part, {})
    d[last] = value


def _pop(d, path):
    """Remove ``path`` from ``d`` (and mappings it leaves empty); return (value, found)."""
    *head, last = path.split(".")
    chain = [d]
    for part in head:
        node = chain[-1].get(part) if isinstance(chain[-1], dict) else None
        if not isinstance(node, dict):
            return None, False
        chain.append(node)
    if last not in chain[-1]:
        return None, False
    value = chain[-1].pop(last)
    for parent, part in zip(reversed(chain[:-1]), reversed(head)):
        if parent[part] == {}:
            del parent[part]
    return value, True


def _leaves(d, prefix=""):
    """Every key path of a nested mapping (lists are values)."""
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            yield from _leaves(v, path)
        else:
            yield path


def _scheduler_to_flat(entry, where):
    """``{LinearLR: {...}}`` (trainer layout) -> ``{scheduler: LinearLR, ...}``, nested lists included."""
    if not (isinstance(entry, dict) and len(entry) == 1 and isinstance(next(iter(entry.values())), dict)):
        raise ConfigError(f"{where}: expected one mapping {{SchedulerName: {{...}}}}, got {show(entry)}")
    (name, args), = entry.items()
    # The flat spelling: LinearLR -> Linear.
    out = {"scheduler": name[:-2] if str(name).endswith("LR") else name, **args}
    if isinstance(args.get("schedulers"), list):
        out["schedulers"] = [_scheduler_to_flat(s, f"{where}.{name}.schedulers[{i}]")
                             for i, s in enumerate(args["schedulers"])]
    return out


def _scheduler_to_trainer(entry):
    if not isinstance(entry, dict):
        return entry
    args = {k: v for k, v in entry.items() if k != "scheduler"}
    if isinstance(args.get("schedulers"), list):
        args["schedulers"] = [_scheduler_to_trainer(s) for s in args["schedulers"]]
    name = str(entry.get("scheduler", "Constant"))
    return {name if name.endswith("LR") else name + "LR": args}


def flatten(raw, origins=None):
    """The flat layout of a trainer-layout params dict; raises ValueError naming the key path.

    Keys the translation does not know stay where a message can name them: under
    ``trainer.<path>`` in the flat dict's ``unknown`` list (the returned second value). ``origins``, a
    dict, is filled with where each flat key (or a flat prefix: ``model``) was in the file
    (``trainer.init.model``), so what is said of a key names it as the file does (``KeyReport.in_file``).
    """
    origins = {} if origins is None else origins
    t = copy.deepcopy(_one_trainer(raw["trainer"]))
    flat, unknown = {}, [section for section in raw if section != "trainer"]
    init = t.pop("init", None) or {}
    if not isinstance(init, dict):
        raise ConfigError(f"trainer.init: expected a mapping, got {show(init)}")
    for tpath, fpath in INIT_HOMES:
        value, found = _pop(init, tpath)
        if found:
            _put(flat, fpath, value)
            origins[fpath] = f"trainer.init.{tpath}"
    model = init.pop("model", None)
    if model is not None:
        if not isinstance(model, dict):
            raise ConfigError(f"trainer.init.model: expected a mapping, got {show(model)}")
        origins["model"] = "trainer.init.model"
        for k, v in model.items():  # model keys are the same in both layouts (mixed_precision too)
            flat.setdefault("model", {})[k] = v
    _optimizer_to_flat(init.pop("optimizer", None), flat, origins)
    _schedulers_to_flat(init.pop("schedulers", None), flat, origins)
    sparsity = init.pop("sparsity", None)
    if sparsity is not None:
        flat["sparsity"] = sparsity
        origins["sparsity"] = "trainer.init.sparsity"
    _callbacks_to_flat(init.pop("callbacks", None) or [], flat, unknown, origins)
    unknown += [f"trainer.init.{p}" for p in _leaves(init)]
    _dataloaders_to_flat(t, flat, unknown, origins)
    t.pop("validate_all", None)  # the dataloaders of Model Zoo's validate_all command, not of a fit
    unknown += [f"trainer.{p}" for p in _leaves(t)]
    return flat, unknown


def _one_trainer(trainer):
    """The one trainer of ``raw["trainer"]``: a mapping, or a list of one phase (``[{trainer: {...}}]``)."""
    if isinstance(trainer, list):
        if len(trainer) != 1:
            raise ConfigError(f"trainer: a list of {len(trainer)} training phases; wse-cluster runs one "
                              "(give one trainer, or one file per phase)")
        trainer = trainer[0].get("trainer") if isinstance(trainer[0], dict) else None
    if not isinstance(trainer, dict):
        raise ConfigError(f"trainer: expected a mapping with init and fit, got {show(trainer)}")
    return trainer


def _optimizer_to_flat(opt, flat, origins):
    """``trainer.init.optimizer`` (``{OptimizerName: {...}}``) into the flat ``optimizer`` section."""
    if opt is None:
        return
    if not (isinstance(opt, dict) and len(opt) == 1 and isinstance(next(iter(opt.values())), (dict, type(None)))):
        raise ConfigError("trainer.init.optimizer: expected one mapping {OptimizerName: {...}}, "
                          f"got {show(opt)}")
    (name, args), = opt.items()
    flat.setdefault("optimizer", {}).update({"optimizer_type": name, **(args or {})})
    origins.update({"optimizer": f"trainer.init.optimizer.{name}",
                    "optimizer.optimizer_type": "trainer.init.optimizer"})


def _schedulers_to_flat(scheds, flat, origins):
    """``trainer.init.schedulers`` into the flat ``optimizer.learning_rate`` (one scheduler or a list)."""
    if scheds is None:
        return
    if isinstance(scheds, dict):
        scheds = [scheds]
    if not isinstance(scheds, list):
        raise ConfigError(f"trainer.init.schedulers: expected a list of schedulers, got {show(scheds)}")
    lr = [_scheduler_to_flat(s, f"trainer.init.schedulers[{i}]") for i, s in enumerate(scheds)]
    if len(lr) > 1:  # several top-level schedulers in Model Zoo's trainer are chained
        lr = [dict(s, main_scheduler="chained") for s in lr]
    elif str(lr[0]["scheduler"]).lower() == "sequential" and set(lr[0]) == {"scheduler", "schedulers"}:
        lr = lr[0]["schedulers"]  # the flat layout's list is a SequentialLR without milestones
    if "learning_rate" in flat.get("optimizer", {}):
        raise ConfigError("trainer.init.schedulers: given beside the optimizer's learning_rate; give one")
    flat.setdefault("optimizer", {})["learning_rate"] = lr[0] if len(lr) == 1 else lr
    origins["optimizer.learning_rate"] = "trainer.init.schedulers"


def _callbacks_to_flat(callbacks, flat, unknown, origins):
    """``trainer.init.callbacks`` into their flat homes (CALLBACK_HOMES, GlobalFlags' as runconfig keys);
    a callback or flag with no home goes to ``unknown``."""
    if not isinstance(callbacks, list):
        raise ConfigError(f"trainer.init.callbacks: expected a list, got {show(callbacks)}")
    for i, cb in enumerate(callbacks):
        if not (isinstance(cb, dict) and len(cb) == 1):
            raise ConfigError(f"trainer.init.callbacks[{i}]: expected one mapping {{CallbackName: {{...}}}}, "
                              f"got {show(cb)}")
        (name, args), = cb.items()
        args = args or {}
        if name == "GlobalFlags":  # hardware/debug flags of a real system: kept to be named as tuning
            for flag, v in args.items():
                flat.setdefault("runconfig", {})[flag.rsplit(".", 1)[-1]] = v
                origins[f"runconfig.{flag.rsplit('.', 1)[-1]}"] = f"trainer.init.callbacks[{i}].{name}.{flag}"
        elif name in CALLBACK_HOMES:
            for flag, v in args.items():
                if flag not in CALLBACK_HOMES[name]:
                    unknown.append(f"trainer.init.callbacks[{i}].{name}.{flag}")
                else:
                    _put(flat, CALLBACK_HOMES[name][flag], v)
                    origins[CALLBACK_HOMES[name][flag]] = f"trainer.init.callbacks[{i}].{name}.{flag}"
        else:
            unknown.append(f"trainer.init.callbacks[{i}].{name}")


def _dataloaders_to_flat(t, flat, unknown, origins):
    """``trainer.fit``'s dataloaders and ``trainer.validate``'s into ``train_input``/``eval_input``, popped
    from ``t``; what else those two sections hold goes to ``unknown``."""
    fit = t.pop("fit", None) or {}
    for key, section in (("train_dataloader", "train_input"), ("val_dataloader", "eval_input")):
        value = fit.pop(key, None)
        if value is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"trainer.fit.{key}: expected a mapping, got {show(value)}")
            flat[section] = {**value, **flat.get(section, {})}
            origins[section] = f"trainer.fit.{key}"
    unknown.extend(f"trainer.fit.{p}" for p in _leaves(fit))
    validate = t.pop("validate", None) or {}
    val = validate.pop("val_dataloader", None)
    if val is not None and "eval_input" not in flat:
        flat["eval_input"] = dict(val)
        origins["eval_input"] = "trainer.validate.val_dataloader"
    elif val is not None and {k: v for k, v in flat["eval_input"].items() if k != "micro_batch_size"} != val:
        raise ConfigError("trainer.validate.val_dataloader: differs from trainer.fit.val_dataloader; wse-cluster "
                          "evaluates on one eval_input")
    unknown.extend(f"trainer.validate.{p}" for p in _leaves(validate))


def to_trainer(flat):
    """The trainer layout of a flat params dict (keys with no trainer home are returned as dropped)."""
    flat = copy.deepcopy(flat)
    init, dropped = {}, []
    for tpath, fpath in INIT_HOMES:
        value, found = _pop(flat, fpath)
        if found and value is not None:
            _put(init, tpath, value)
    model = flat.pop("model", {})
    init["model"] = model
    opt = flat.pop("optimizer", {})
    lr = opt.pop("learning_rate", None)
    name = opt.pop("optimizer_type", "AdamW")
    init["optimizer"] = {name: {k: v for k, v in opt.items() if v is not None}}
    if isinstance(lr, (dict, list)):
        entries = lr if isinstance(lr, list) else [lr]
        chained = any(isinstance(e, dict) and str(e.get("main_scheduler", "")).lower() in ("chained", "chainedlr")
                      for e in entries)
        entries = [_scheduler_to_trainer({k: v for k, v in e.items() if k != "main_scheduler"}) for e in entries]
        if len(entries) > 1 and not chained:
            entries = [{"SequentialLR": {"schedulers": entries}}]
        init["schedulers"] = entries
    elif lr is not None:
        init["optimizer"][name]["learning_rate"] = lr
    if "sparsity" in flat:
        init["sparsity"] = flat.pop("sparsity")
    callbacks = []
    for section, cb in (("train_input", "ScopedTrainFlags"), ("eval_input", "ScopedValidateFlags")):
        mbs = flat.get(section, {}).pop("micro_batch_size", None)
        if mbs is not None:
            callbacks.append({cb: {"csx.performance.micro_batch_size": mbs}})
    lcs, found = _pop(flat, "runconfig.load_checkpoint_states")
    if found:
        callbacks.append({"LoadCheckpointStates": {"load_checkpoint_states": lcs}})
    if callbacks:
        init["callbacks"] = callbacks
    trainer = {"init": init, "fit": {}}
    if "train_input" in flat:
        trainer["fit"]["train_dataloader"] = flat.pop("train_input")
    if "eval_input" in flat:
        trainer["fit"]["val_dataloader"] = flat["eval_input"]
        trainer["validate"] = {"val_dataloader": flat.pop("eval_input")}
    dropped += list(_leaves(flat))
    return {"trainer": trainer}, dropped


# -- the fate of every key ------------------------------------------------------------------------

#: Sections of Model Zoo's that are not built (refused whole).
SECTIONS_NOT_BUILT = {"sparsity": "Model Zoo's sparsity algorithms (wse-cluster has model.sparsity: a fixed random "
                                  "mask) are not built"}


def spec_of(section, values):
    """The spec class that says what ``section`` takes (a family's config for ``model``), or None."""
    if section == "model":
        from wse_core.nn.config import CONFIGS  # here: importing wse_core.nn loads the kernels (configure_process)

        return CONFIGS.get(values.get("name")) if isinstance(values.get("name"), str) else None
    return SECTIONS.get(section)


class KeyReport:
    """What ``sort_keys`` decided: each key path with its fate, and the notes (inferred things)."""

    def __init__(self):
        self.fates = {}     # path -> "honoured" | "honoured (same value)" | "alias of X" | "tuning" | "refused: why"
        self.notes = []
        self.compile_only = False      # laid out, not run (wse compile): micro_batch_size: explore allowed
        self.micro_batch_mode = None   # "number", "auto", "explore" or "none": how the params gave it
        self.origins = {}   # a trainer-layout file's: flat path (or prefix) -> its path in the file (``flatten``)
        self.model = None   # the model the params build, built once (``mpi_launch.resolved``)

    def in_file(self, path):
        """A key's path as the file spells it: ``trainer.init.loop.max_steps`` for ``runconfig.max_steps``
        of a trainer-layout file; the flat path of a flat file (or of a flat --set)."""
        if path in self.origins:
            return self.origins[path]
        head, _, rest = path.rpartition(".")
        while head:
            if head in self.origins:
                return f"{self.origins[head]}.{rest}"
            head, _, more = head.rpartition(".")
            rest = f"{more}.{rest}"
        return path

    @property
    def tuning(self):
        return [p for p, f in self.fates.items() if f == "tuning"]

    @property
    def refused(self):
        return [(p, f[len("refused: "):]) for p, f in self.fates.items() if f.startswith("refused: ")]


def sort_keys(flat, report):
    """Apply aliases, drop tuning keys and same-value keys, record every key's fate; return the dict
    left for the schema (which records its own keys as honoured or unknown)."""
    flat = copy.deepcopy(flat)
    model = flat.get("model")
    if isinstance(model, dict):
        _infer_family(model, report)
        weight = model.get("loss_weight", 1.0)
        if "loss_scaling" not in model and weight != 1.0 and model.get("name") != "fc_mlp":
            # Before Model Zoo had loss_scaling (1.x), its GPT loss was sum / batch_size * loss_weight.
            model["loss_scaling"] = "batch_size"
            report.notes.append(f"model.loss_scaling: absent beside loss_weight {show(weight)}; inferred batch_size "
                                "(the loss was sum / batch_size * loss_weight before Model Zoo had loss_scaling)")
        if "use_bfloat16" in model:  # 1.x: true for bfloat16, false for float16 (when mixed_precision)
            use = model.pop("use_bfloat16")
            if use is True and model.get("fp16_type", "bfloat16") != "bfloat16":
                report.fates["model.use_bfloat16"] = "refused: true beside another model.fp16_type; give one"
            else:
                report.fates["model.use_bfloat16"] = "alias of model.fp16_type"
                model.setdefault("fp16_type", "bfloat16" if use is True else "float16")
        if "use_rms_norm" in model:  # 1.x spelling of norm_type: rmsnorm
            use = model.pop("use_rms_norm")
            report.fates["model.use_rms_norm"] = "alias of model.norm_type"
            model.setdefault("norm_type", "rmsnorm" if use is True else "layernorm")
        if model.get("name") in ("gpt2", "gpt3") and model.get("nonlinearity") in LLAMA_NONLINEARITIES:
            report.fates["model.nonlinearity"] = (f"refused: {model.pop('nonlinearity')} is not built for gpt2 (built: "
                                                  "gelu, gelu_new; swiglu: model.name: llama)")
    opt = flat.get("optimizer")
    if isinstance(opt, dict):
        if "beta1" in opt or "beta2" in opt:
            betas = [opt.pop("beta1", 0.9), opt.pop("beta2", 0.999)]  # Model Zoo 1.x defaults
            if "betas" in opt:
                report.fates["optimizer.beta1"] = "refused: given beside optimizer.betas; give one"
            else:
                opt["betas"] = betas
                report.fates["optimizer.beta1"] = report.fates["optimizer.beta2"] = "alias of optimizer.betas"
    for section, values in list(flat.items()):
        if section in SECTIONS_NOT_BUILT:
            report.fates[section] = f"refused: {SECTIONS_NOT_BUILT[section]}"
            del flat[section]
            continue
        cls = spec_of(section, values) if isinstance(values, dict) else None
        if cls is None:
            continue
        aliases = {old: f.name for f in fields(cls) for old in f.metadata.get("aliases", ())}
        for key in list(values):
            path = f"{section}.{key}"
            if key in aliases:
                new = aliases[key]
                if new in values:
                    report.fates[path] = f"refused: given beside {section}.{new}; give one"
                else:
                    values[new] = values.pop(key)
                    report.fates[path] = f"alias of {section}.{new}"
            elif key in cls.ZOO:
                report.fates[path] = cls.ZOO[key].judge(values.pop(key))
    return flat


#: What marks a model family in a file that does not name it (Model Zoo's 1.x files).
def _infer_family(model, report):
    if "name" in model:
        return
    llama = (model.get("norm_type") == "rmsnorm" or model.get("use_rms_norm") is True
             or model.get("position_embedding_type") == "rotary" or model.get("nonlinearity") == "swiglu")
    if "vocab_size" in model and "num_heads" in model:
        model["name"] = "llama" if llama else "gpt2"
        why = ("RMSNorm, rotary positions or SwiGLU" if llama
               else "a GPT-2 decoder: vocab_size, num_heads, learned positions")
        report.notes.append(f"model.name: absent; inferred {model['name']} from its keys ({why})")
    elif "input_size" in model:
        model["name"] = "fc_mlp"
        report.notes.append("model.name: absent; inferred fc_mlp from its keys (input_size)")


def warn_tuning(where, report):
    """One warning line listing the keys accepted without effect, named as the file names them."""
    if report.tuning:
        warnings.warn(ParamsWarning(
            f"{where}: {plural(len(report.tuning), 'key')} accepted without effect (they tune a real system's "
            f"hardware, input pipeline or logging, not the numerics): {', '.join(map(report.in_file, report.tuning))}"),
            stacklevel=3)
