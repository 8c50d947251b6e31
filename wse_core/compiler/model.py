"""A compiled PyTorch model as a model family (``model.name: torch``): the streaming units the compiler
made, run by the cluster like any family's (docs/design/compiler.md "The family torch").

``save_program(graph, units, path)`` writes what the ranks need in one file: the units' fx modules
(with the buffers and constants they hold), what each reads and hands on, the loss's reduction, the
inputs' dtypes and shapes, and the initial weights. ``TorchModel`` reads it back and gives the
cluster the ``wse_core.nn.Model`` interface, so MemoryX, SwarmX, the CS-2s, the coordinator, the
reference step, checkpoints and the simulated clock run it unchanged:

- a micro-batch's state is a dict: the batch's tensors (``"input"``) and the values units hand on;
  ``unit_forward`` runs one unit with the streamed weights as leaves (``torch.from_numpy``: no copy),
  ``unit_backward`` one ``torch.autograd.grad`` per unit, as ``runner.forward_backward`` does;
- ``loss`` turns the micro-batch's loss (a mean over its n_j terms, or a sum) into what every family
  reports: the loss *sum* and n_j, with the backward seeded by n_j (times the loss scale); the
  coordinator divides by N = sum n_j of the global batch (``loss_divisor``), as for the built-in
  families, so the step's loss and gradients are the mean over the global batch;
- mixed precision (``model.mixed_precision``), by the built-in families' rules: the unit computes in
  float32 on the streamed 16-bit weights (``compute_weights``; rounded float32 values); the
  floating-point values it hands on (not the loss) and the batch's floating-point inputs are
  rounded to the format (copies: autograd keeps the unit's own outputs), and so are its input and
  weight gradients (each sum of them too); the loss's seed carries the loss scale in float32;
- dropout: torch's generator is seeded before each unit's forward from (seed, step, the
  micro-batch's first sample, unit) (``runner.dropout_seed``), inside ``fork_rng``;
- torch computes on one thread (``one_thread``): its reductions (a bias's gradient, LayerNorm's)
  give other bits on other thread counts, and a rank, the CPU backend's process and a test must
  agree whatever their own settings (docs/design.md section 5, (b)).

Batches come from the project's datasets, in one of their layouts: ``tensors`` (a column per
input of the step, of its dtype and shape: what a ``pyapi.cstorch`` script's loader made), or for
a program trained on the project's own data, ``arrays`` (``features`` ``[n, ...]``, ``labels``
int32 ``[n]``) for a model of one input and a class target, ``lm`` (int32 ``[n, 3, T]``: ids, loss
mask, labels) for a model of token ids and per-token targets, masked-out labels becoming the
loss's ``ignore_index``. The file is a pickle (``torch.save``):
load only programs you made.
"""
import contextlib
import functools
import math
import os
from dataclasses import replace

import numpy as np
import torch

from wse_core.compiler.loss import Loss
from wse_core.compiler.lower import SUM, batch_dims, concrete as _concrete, draws, lower
from wse_core.compiler import runner
from wse_core.compiler.runner import dropout_seed
from wse_core.errors import ConfigError, DataError
from wse_core.nn.layers import ParamSpec
from wse_core.nn.model import Model
from wse_core.perf.model import UnitWork

#: The program file's format: a file of another format is refused by name, not misread (3: units lowered).
FORMAT = 3
#: The targets of masked-out tokens of an ``lm`` dataset (torch's losses ignore -100 by default).
IGNORE_INDEX = -100


def save_program(graph, units, path, groups=None, layout=None):
    """Write ``units`` (``partition(graph)``) and ``graph``'s inputs and initial weights to ``path``;
    return the dataset layout the program reads: ``layout`` ("tensors"), or the project's "arrays"
    or "lm" that fits the inputs. ``groups``: {parameter name: (lr factor, takes weight decay)} of the
    optimizer's parameter groups (default: 1 and yes for all)."""
    layout = layout or _layout(graph.inputs)
    # Shapes and work are read off the graphs' metadata now: an fx module's pickle drops it.
    shapes = {p: tuple(t.shape) for p, t in graph.params.items()}
    random = any(draws(node) for u in units for node in u.module.graph.nodes)
    costs = [{"shapes": {p: shapes[p] for p in u.params}, "handed_bytes": u.boundary_bytes, **_work(u, shapes)}
             for u in units]
    known = {node.name: b for node, b in batch_dims(graph.program.graph).items()}
    lowering = [lower(u, known) for u in units]  # last: it rewrites the graphs whose ops the costs read
    units = [replace(u, outputs=(*u.outputs, *r["sums"])) for u, r in zip(units, lowering)]
    torch.save({"format": FORMAT, "layout": layout, "inputs": graph.inputs, "outputs": graph.outputs, "units": units,
                "costs": costs, "lowering": lowering,
                "random": random,
                "groups": {n: (float(f), bool(d)) for n, (f, d) in (groups or {}).items()},
                "example_samples": len(graph.example[0]),
                "weights": {name: p.detach().clone() for name, p in graph.params.items()}}, path)
    return layout


def load_program(path):
    """The program at ``path`` as ``save_program`` wrote it; ValueError naming the file otherwise.
    Read once per version of the file: a launcher builds the model several times (checks, plan,
    memory), and a program holds the model's weights."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"model.program: {path}: no such file") from None
    return _load_program(os.path.abspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _load_program(path, mtime_ns, size):
    try:
        program = torch.load(path, weights_only=False)
    except Exception as exc:  # a pickle of anything: name the file, not the unpickler's frame
        raise DataError(f"model.program: {path}: not a compiled program ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not isinstance(program, dict) or program.get("format") != FORMAT:
        raise DataError(f"model.program: {path}: not a program of format {FORMAT} (wse_core.compiler.save_program)")
    return program


def _layout(inputs):
    """The dataset layout a step of these inputs reads: ``arrays`` or ``lm``; CompileError otherwise."""
    from wse_core.compiler.errors import CompileError

    if len(inputs) == 2:
        (x_dtype, x_shape), (y_dtype, y_shape) = inputs
        if not y_dtype.is_floating_point and y_shape == ():
            return "arrays"
        if not x_dtype.is_floating_point and not y_dtype.is_floating_point and len(x_shape) == 1 \
                and y_shape == x_shape:
            return "lm"
    shown = ", ".join(f"{str(d).replace('torch.', '')} {list(s)}" for d, s in inputs)
    raise CompileError(f"step inputs ({shown} per sample): the cluster reads (inputs, class targets) or (token ids "
                       "[T], token targets [T]); give the step those two")


def _numpy_dtype(dtype):
    """The numpy dtype of a torch dtype (the datasets' and the wire's)."""
    return torch.empty(0, dtype=dtype).numpy().dtype


@contextlib.contextmanager
def one_thread():
    """torch on one thread for the block (its own setting given back after)."""
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)


class TorchModel(Model):
    """A compiled PyTorch model (``model.name: torch``): see the module's docstring."""

    family = "torch"

    def __init__(self, config, program):
        self.program = program
        # Why its sums span a micro-batch (an op left to torch that sums over the batch), or None: the
        # lowered units' sums are trees over samples (``lower.report``).
        reasons = [r for unit in program["lowering"] for r in unit["batch_dependent"]]
        self.batch_dependent = reasons[0] if reasons else None
        self.torch_units = program["units"]
        self.layout = program["layout"]
        self.is_lm = self.layout == "lm"
        self.columns = [(f"t{i}", _numpy_dtype(d), tuple(shape)) for i, (d, shape) in enumerate(program["inputs"])]
        self.loss_spec: Loss = self.torch_units[-1].loss  # None: an evaluation's program
        # A lowered loss's float64 sum (lower.SUM), read by ``loss``: a step's output, never rounded.
        self.loss_sum = self.loss_spec.value + SUM if self.loss_spec and self.loss_spec.value + SUM in \
            self.torch_units[-1].outputs else None
        self.step_outputs = set(program["outputs"]) | {self.loss_sum}
        weights = program["weights"]
        self.groups = program.get("groups", {})
        super().__init__(config, [_Streamed(u.name, cost, program["example_samples"], self.groups)
                                  for u, cost in zip(self.torch_units, program["costs"])])
        self.initial = {n: w.numpy() for n, w in weights.items()}

    def lowering(self):
        """What runs on the kernels: {"torch_flops": the share of the step's FLOPs left to torch,
        "torch_ops": the ops left to torch, by name} (``lower.report``, summed over the units)."""
        reports = self.program["lowering"]
        lowered = sum(r["flops"]["lowered"] for r in reports)
        left = sum(r["flops"]["torch"] for r in reports)
        ops = sorted({op for r in reports for op in r["torch"]})
        return {"torch_flops": left / (lowered + left) if lowered + left else 0.0, "torch_ops": ops}

    # -- parameters ---------------------------------------------------------------------------

    def init_params(self, seed, dtype=np.float32, names=None):
        """The module's own initial weights (the program holds them: ``seed`` does not draw them)."""
        return {n: np.array(self.initial[n], dtype=dtype) for n in (self.param_names if names is None else names)}

    def lr_factors(self, adjust=None):
        """Each parameter's learning-rate factor: its optimizer group's (``save_program``'s groups)."""
        if adjust:
            raise ConfigError("optimizer.adjust_learning_rate: a compiled PyTorch model takes its optimizer's "
                              "parameter groups instead")
        return {n: self.groups.get(n, (1.0, True))[0] for n in self.param_names}

    # -- batches ------------------------------------------------------------------------------

    def example_layout(self, n, seq_len=None):
        if self.layout == "tensors":
            return [((n, *shape), dtype) for _, dtype, shape in self.columns]
        (_, x_shape), _ = self.program["inputs"]
        if self.is_lm:
            return [((n, 3, seq_len or x_shape[0]), np.int32)]
        return [((n, *x_shape), np.float32), ((n,), np.int32)]

    def batch_of(self, arrays):
        if self.layout == "tensors":
            return {name: a for (name, _, _), a in zip(self.columns, arrays)}
        if self.is_lm:
            a = arrays[0] if isinstance(arrays, (list, tuple)) else arrays
            return {"ids": np.ascontiguousarray(a[:, 0]), "mask": np.ascontiguousarray(a[:, 1]),
                    "labels": np.ascontiguousarray(a[:, 2])}
        return {"features": arrays[0], "labels": arrays[1]}

    def check_batch(self, batch):
        layout = self.example_layout(1)
        keys = (("ids", "mask", "labels") if self.is_lm else ("features", "labels") if self.layout == "arrays"
                else [name for name, _, _ in self.columns])
        for key in keys:
            if not isinstance(batch.get(key), np.ndarray):
                raise TypeError(f"batch[{key!r}]: expected an array, got {type(batch.get(key)).__name__}")
        if self.layout == "arrays" and batch["features"].shape[1:] != layout[0][0][1:]:
            raise ValueError(f"batch['features']: expected [batch, {', '.join(map(str, layout[0][0][1:]))}], "
                             f"got {list(batch['features'].shape)}")
        return len(batch[keys[0]])

    def check_dataset(self, fmt, example_shape, vocab_size, where, columns=None):
        """The dataset's layout is the program's, its examples the shape the graph was captured on
        (its shapes are fixed but for the batch); a tensor dataset's columns are the step's inputs."""
        words = {"lm": "LM", "arrays": "array", "tensors": "tensor"}
        if fmt != self.layout:
            raise ConfigError(f"{where} is {words[fmt]} data; this compiled model reads {words[self.layout]} data "
                              f"(its step takes {self._inputs_text()})")
        if self.layout == "tensors":
            got = [(dtype, shape) for _, dtype, shape in columns or []]
            if got != [(dtype, shape) for _, dtype, shape in self.columns]:
                shown = ", ".join(f"{d} {list(s)}" for d, s in got)
                raise ConfigError(f"{where}: examples of {shown}; this compiled model was captured on "
                                  f"{self._inputs_text()} a sample")
            return
        want = self.example_layout(1)[0][0][1:]
        if tuple(example_shape) != tuple(want):
            raise ConfigError(f"{where}: examples of shape {list(example_shape)}; this compiled model was captured "
                              f"on {list(want)} (capture it on the data's shape)")

    def _inputs_text(self):
        return ", ".join(f"{str(d).replace('torch.', '')} {list(s)}" for d, s in self.program["inputs"])

    def tensors(self, batch):
        """The step's inputs as the captured graph takes them (dtypes of its example)."""
        if self.layout == "tensors":
            return tuple(torch.from_numpy(np.asarray(batch[name])) for name, _, _ in self.columns)
        (x_dtype, _), (y_dtype, _) = self.program["inputs"]
        if self.is_lm:
            labels = np.where(batch["mask"] != 0, batch["labels"], IGNORE_INDEX)
            return torch.from_numpy(batch["ids"]).to(x_dtype), torch.from_numpy(labels).to(y_dtype)
        return torch.from_numpy(np.asarray(batch["features"])).to(x_dtype), \
            torch.from_numpy(np.asarray(batch["labels"])).to(y_dtype)

    def first_input(self, batch, dtype):
        """The batch's tensors; floating-point inputs in the run's precision, as the built-in families'."""
        return {"input": tuple(self._rounded(t) for t in self.tensors(batch))}

    # -- passes -------------------------------------------------------------------------------

    def check_evaluable(self):
        """An evaluation (a forward pass without dropout keys) runs a graph that draws no random numbers:
        one captured in eval mode, or without dropout. ValueError otherwise."""
        if self.program["random"]:
            raise ConfigError("evaluating a compiled model whose graph draws random numbers (dropout in training "
                              "mode): call model.eval() before the evaluation loop")

    def forward(self, params, batch, drop=None):
        if drop is None:
            self.check_evaluable()
        return super().forward(params, batch, drop)

    def evaluation_values(self, params, batch):
        """The step's outputs on ``batch`` in one forward pass, in order (arrays)."""
        with torch.no_grad():
            y, _ = self.forward(params, batch)
        return [y[name].detach().numpy() for name in self.program["outputs"]]

    def unit_forward(self, u, x, params, drop=None):
        unit = self.torch_units[u]
        weights = {p: torch.from_numpy(params[p]) for p in unit.params}  # no copy
        # Seeded only where the units draw: side by side, micro-batches must not touch the one generator.
        seed = None if drop is None or not self.program["random"] else dropout_seed(drop.seed, drop.step,
                                                                                   drop.first_sample, u)
        with one_thread():
            outputs, saved = runner.unit_forward(unit, weights, x, x["input"], seed)
        handed = dict(zip(unit.outputs, outputs))
        # What later units read leaves in the run's precision (rounded copies: autograd keeps the
        # unit's own outputs in ``saved``); the step's outputs (its loss, the values it hands to
        # Python) are read by no unit: they stay float32.
        return {**x, **{n: v if n in self.step_outputs else self._rounded(v) for n, v in handed.items()}}, saved

    def _rounded(self, value):
        """A floating-point tensor in the run's precision: a rounded copy, needing a gradient as the
        value does (the next unit takes it as a leaf); anything else, and every value in float32, as is."""
        if self.precision.format is None or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        rounded = self.precision.format.round(value.detach().to(torch.float32).numpy())
        return torch.from_numpy(rounded).to(value.dtype).requires_grad_(value.requires_grad)

    def _round_grad(self, g):
        """A gradient in the run's precision, rounded in place (as float32, contiguous: a broadcast
        gradient is copied first, so its memory is its own)."""
        if self.precision.format is None:
            return g
        if g.dtype != torch.float32 or not g.is_contiguous():
            g = g.to(torch.float32).contiguous()
        self.precision.round_(g.numpy())
        return g

    def loss(self, y, batch, loss_scale=1.0):
        """(loss_sum, n, dy): the micro-batch's loss times its n terms (a mean's) and n; dy seeds the
        tail's backward with n times the loss scale (the gradient of the sum, scaled)."""
        value = y[self.loss_spec.value]
        if self.loss_spec.reduction == "sum":
            n, factor = self.check_batch(batch), 1.0
        else:
            n = self._count(batch)
            factor = float(n)
        if n == 0:  # every target ignored: the mean is 0/0; the micro-batch adds nothing
            return 0.0, 0, {"seed": torch.zeros_like(value)}
        # The lowered loss's own sum, the tree over samples: the same whatever the micro-batch (a mean
        # times its n would not be); else the mean times n.
        total = float(y[self.loss_sum].detach()) if self.loss_sum in y else float(value.detach()) * factor
        return total, n, {"seed": torch.full_like(value, factor * loss_scale)}

    def loss_divisor(self, n_tokens, batch_size):
        return 1.0 if self.loss_spec.reduction == "sum" else n_tokens

    def step_values(self, y, batch):
        """The values the step hands Python beside its loss, of one micro-batch: (value times its
        weight, weight) each, the weight the terms of a mean (``loss.combination``)."""
        rules = self.torch_units[-1].values
        if not rules:
            return None
        inputs = self.tensors(batch)
        out = []
        for rule in rules:
            v = y[rule.value].detach().numpy()
            if rule.reduction == "mean":
                n = rule.count(inputs)  # none counted: its value (a NaN) weighs nothing
                out.append((v * np.asarray(n, v.dtype) if n else np.zeros_like(v), n))
            else:
                out.append((v, 1))
        return out

    def combine_values(self, parts):
        """The step's values from its micro-batches' (``step_values``, in the global batch's order):
        a mean is the tree sum of the weighted values over that of the weights, a sum their tree
        sum, a value per sample theirs in order, a value the batch does not enter the first's, a
        BatchNorm's statistic the tree sum of each micro-batch's times its weight in M sequential
        updates at momentum m, m (1 - m)^(M - 1 - j)."""
        from wse_core.microbatch import tree_sum

        out = []
        for i, rule in enumerate(self.torch_units[-1].values):
            got = [p[i] for p in parts]
            if rule.reduction == "mean":
                total = sum(n for _, n in got)
                out.append(tree_sum([v for v, _ in got]) / np.asarray(total, got[0][0].dtype) if total else
                           np.full_like(got[0][0], np.nan))
            elif rule.reduction == "sum":
                out.append(tree_sum([v for v, _ in got]))
            elif rule.reduction == "concat":
                out.append(np.concatenate([v for v, _ in got]))
            elif rule.reduction == "ema":  # eager's M sequential updates, less the old value's (1 - m)^M share
                m, count = rule.momentum, len(got)
                out.append(tree_sum([v * np.asarray(m * (1 - m) ** (count - 1 - j), v.dtype)
                                     for j, (v, _) in enumerate(got)]))
            else:
                out.append(got[0][0])
        return out

    def _count(self, batch):
        if self.loss_spec.counter is None:
            return self.check_batch(batch)
        return self.loss_spec.count(self.tensors(batch))

    def unit_backward(self, u, dy, saved, params):
        """Unit u's backward: the gradients waiting for earlier units' values, and its weight gradients,
        in the run's precision. A value several units read gets its gradients added in float32 and
        rounded, each sum, as every gradient sum is (``Model.add_grads``)."""
        unit, waiting = self.torch_units[u], dict(dy)
        if "seed" in waiting:  # the loss's (float32, times the loss scale): the tail's output
            waiting[self.loss_spec.value] = waiting.pop("seed")
        mine = {n: waiting.pop(n) for n in unit.outputs if n in waiting}
        with one_thread():
            grads = runner.unit_backward(unit, saved, mine)  # mine: now the gradients of what it read
            for name, g in mine.items():
                g = self._round_grad(g)
                waiting[name] = g if name not in waiting else self._round_grad(waiting[name] + g)
        return waiting, {p: self._round_grad(g).numpy() for p, g in grads.items()}

    # -- estimates ------------------------------------------------------------------------------

    def activation_floats(self, samples, seq_len=None):
        return sum(u.activation_floats(samples, seq_len) for u in self.units)

    def correct(self, y, batch):
        raise NotImplementedError("accuracy of a compiled PyTorch model is not built yet")


class _Streamed:
    """One compiled unit as the cluster sees it: its name, parameter specs and the work it does."""

    def __init__(self, name, cost, example_samples, groups):
        self.name, self.cost, self.example_samples, self.groups = name, cost, example_samples, groups

    def param_specs(self):
        """Each parameter's shape and whether it takes weight decay (its optimizer group's; the initial
        weights come from the program)."""
        return {p: ParamSpec(shape, ("program",), decay=self.groups.get(p, (1.0, True))[1])
                for p, shape in self.cost["shapes"].items()}

    def activation_floats(self, samples, seq_len=None):
        """Floats kept for the backward: the values the unit hands on, scaled from the example (an
        **assumption**: autograd keeps more inside a unit; nothing measures it yet)."""
        return math.ceil(samples * self.cost["handed_bytes"] / 4 / self.example_samples)

    def work(self, samples, seq_len=None):
        """``wse_core.perf``'s UnitWork for ``samples`` samples: the graph's weight GEMMs and convolutions
        (M scaled from the example), its other products of activations as multiply-adds, its other
        floating-point ops' outputs as element operations (an assumption, as for the built-in families)."""
        s, c = samples / self.example_samples, self.cost
        return UnitWork([(max(1, round(m * s)), k, n) for m, k, n in c["gemms"]], other_macs=round(c["other_macs"] * s),
                        elementwise=round(c["elementwise"] * s))


_LINEAR = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
_CONV = {torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default,
         torch.ops.aten.convolution.default}


def _work(unit, shapes):
    """{gemms: weight GEMMs [(M, K, N)], other_macs, elementwise} of ``unit`` on the example micro-batch
    (``shapes``: each parameter's)."""
    weights = {node: shapes[key] for (kind, key), node in zip(unit.inputs, unit.module.graph.nodes)
               if kind == "param" and len(shapes[key]) >= 2}
    gemms, macs, elementwise = [], 0, 0
    for node in unit.module.graph.nodes:
        if node.op != "call_function":
            continue
        out = node.meta.get("val")
        w = next((weights[a] for a in node.all_input_nodes if a in weights), None)
        if node.target in _LINEAR and w is not None:
            k, n = (w[1], w[0]) if node.target is torch.ops.aten.linear.default else (w[0], w[1])
            gemms.append((_concrete(out.numel()) // n, int(k), int(n)))
        elif node.target in _CONV and w is not None:  # [out channels, in channels / groups, *kernel]
            gemms.append((_concrete(out.numel()) // w[0], math.prod(w[1:]), int(w[0])))
        elif node.target in (torch.ops.aten.bmm.default, torch.ops.aten.matmul.default,
                             torch.ops.aten.scaled_dot_product_attention.default):
            macs += _activation_macs(node)
        elif isinstance(out, torch.Tensor) and out.is_floating_point():
            elementwise += _concrete(out.numel())
    return {"gemms": gemms, "other_macs": macs, "elementwise": elementwise}


def _activation_macs(node):
    """Multiply-adds of a product of two activations (attention's)."""
    a, b = (x.meta["val"] for x in node.all_input_nodes[:2])
    if node.target is torch.ops.aten.scaled_dot_product_attention.default:  # q [.., T, d], k [.., S, d]
        return 2 * _concrete(a.numel()) * _concrete(b.shape[-2])
    return _concrete(a.numel()) * _concrete(b.shape[-1])
