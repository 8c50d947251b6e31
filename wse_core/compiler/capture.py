"""Capture: a user's model and its loss exported as one training-step graph (``torch.export``).

``capture(model, example_inputs, loss_fn)`` exports ``Step(model, loss_fn)``, the forward pass and
the loss of (inputs..., targets), as one graph, so the loss is the tail of the last streaming unit.
The export is non-strict (the model's Python runs as written, once, as Cerebras' trace does), in
train mode, with dimension 0 of every input a free symbol: one graph runs any micro-batch size.

Refused, each in one line naming the module path (``model.blocks.3.attn``) and the op, because a
captured step runs the same ops on every batch and a unit's buffers are constants streamed with
it: Python control flow on tensor values, data-dependent shapes (``nonzero``), ``.item()``, a model
code that fixes the batch size, and buffers updated in forward, but for BatchNorm's.

BatchNorm in training normalises each micro-batch by its own statistics (as a CS-2 does, and as
gradient accumulation or DDP without SyncBatchNorm does), and its running statistics are state of
the script's model, not of a unit: the graph's ``batch_norm`` ops are made functional (no buffer
written), and each one's micro-batch mean and unbiased variance become outputs of the step
(``Graph.batch_norms``), which the cluster combines over the micro-batches in their order as the
sequential updates of eager PyTorch would (``loss.combination``'s "ema": r_M = (1 - m)^M r_0 +
sum_j m (1 - m)^(M - 1 - j) s_j), the same bits for any number of CS-2s; the front-end applies them
to the model's buffers after each step (``pyapi.cstorch.run``).
"""
import contextlib
import io
import logging
import operator
import os
import re
import sys
import traceback
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from wse_core.compiler.errors import CompileError, module_of, op_name, source_line
from wse_core.errors import ConfigError


class Step(nn.Module):
    """The forward half of a training step as one module: the model's output, then the loss.

    With ``loss_fn`` the last positional input is the target: ``loss_fn(model(*inputs), target)``;
    an output with ``.logits`` (Hugging Face's) gives its logits. Without ``loss_fn`` the model
    returns the loss itself (a tensor, or an output with ``.loss``), or a tuple of tensors, the
    loss first (a traced step's values, ``pyapi.cstorch``)."""

    def __init__(self, model, loss_fn=None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn  # an nn.Module becomes submodule "loss_fn": its ops get that path

    def forward(self, *batch):
        if self.loss_fn is None:
            return _tensor_of(self.model(*batch), "loss")
        *inputs, target = batch
        return self.loss_fn(_tensor_of(self.model(*inputs), "logits"), target)


def _tensor_of(out, field):
    if isinstance(out, torch.Tensor) or (isinstance(out, tuple) and out
                                         and all(isinstance(t, torch.Tensor) for t in out)):
        return out
    if isinstance(getattr(out, field, None), torch.Tensor):
        return getattr(out, field)
    raise CompileError(f"model: forward returned {type(out).__name__}; the step needs a tensor "
                       f"(or an output with .{field})")


@dataclass(frozen=True)
class Graph:
    """A captured training step: the exported program and what the runner needs beside it."""

    program: ExportedProgram  # the lifted graph: parameters, buffers and inputs are its placeholders
    step: Step
    params: dict  # owner name (the model's own, as in named_parameters()) -> the live parameter
    aliases: dict  # every parameter name, tied ones included -> its owner's name
    buffers: dict  # buffer path in the Step ("model.bn.running_mean") -> tensor
    inputs: tuple  # per input: (dtype, shape of one sample)
    outputs: tuple  # the graph's output names: the loss (and what the step hands Python), then batch_norms'
    example: tuple  # the example micro-batch: the unit costs are measured on it
    batch_norms: tuple = ()  # BatchNorm in training: (module path, momentum, mean output, variance output) each

    def owner(self, target):
        """Owner name of the parameter a placeholder reads (its path in the Step)."""
        return self.aliases[_model_name(target)]


def _model_name(step_name):
    """A Step path as the model names it: "model.h.0.weight" -> "h.0.weight" (loss_fn's keep theirs)."""
    return step_name[len("model."):] if step_name.startswith("model.") else step_name


def capture(module, example_inputs, loss_fn=None, *, micro_batch=None):
    """Export the training step of ``module`` on ``example_inputs`` (a tuple of tensors, batch first;
    the last one the target when ``loss_fn`` is given) as a ``Graph``.

    ``micro_batch``: the size of the example micro-batch (its first samples) the unit costs are
    measured on; default the whole example. Raises ``CompileError`` in one line for a model that
    cannot be weight-streamed."""
    if not module.training:
        raise CompileError("model: in eval mode; capture exports the training step: call model.train() "
                           "(a submodule may stay in eval mode)")
    batch = _check_batch(tuple(example_inputs))
    n = len(batch[0])
    if micro_batch is not None and not 1 <= micro_batch <= n:
        raise ConfigError(f"micro_batch: expected 1 to {n} (the example's samples), got {micro_batch}")
    step = Step(module, loss_fn)
    for path, m in step.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats \
                and m.momentum is None:  # its update factor, 1 / num_batches_tracked, is read in Python
            raise CompileError(f"{path}: {type(m).__name__}(momentum=None) keeps a cumulative average of its "
                               "statistics; not supported in training (give it a momentum)")
    program = _export(step, batch)
    batch_norms = _functional_batch_norms(program, step)
    _outputs_computed(program)
    _refuse_unstreamable(program, step)
    named = list(step.named_parameters(remove_duplicate=False))
    first = {}  # id of each tensor -> the name it is met by first: its owner
    for name, p in named:
        first.setdefault(id(p), _model_name(name))
    return Graph(
        program=program, step=step,
        params={_model_name(name): p for name, p in step.named_parameters()},
        aliases={_model_name(name): first[id(p)] for name, p in named},
        buffers=dict(step.named_buffers(remove_duplicate=False)),
        inputs=tuple((t.dtype, tuple(t.shape[1:])) for t in batch),
        outputs=tuple(n.name for n in next(n for n in program.graph.nodes if n.op == "output").args[0]),
        example=tuple(t[:micro_batch] for t in batch) if micro_batch else batch,
        batch_norms=batch_norms,
    )


def _check_batch(batch):
    if not batch or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in batch):
        raise ConfigError("example_inputs: expected a non-empty tuple of tensors with a batch dimension first")
    sizes = [len(t) for t in batch]
    if len(set(sizes)) > 1:
        raise ConfigError(f"example_inputs: every input needs the same batch size, got {sizes}")
    return batch


def _export(step, batch):
    """torch.export of the Step, train mode, non-strict, batch dimension free; errors in one line."""
    if len(batch[0]) == 1:
        # export specialises a dimension whose example is 1 (it could broadcast): show it two samples
        batch = tuple(torch.cat([t, t]) for t in batch)
    dim = Dim("batch", min=1)
    stack = []  # module paths being run: the innermost is the one an export error comes from
    handles = []
    for path, m in step.named_modules():
        handles.append(m.register_forward_pre_hook(lambda mod, args, path=path: stack.append(path)))
        handles.append(m.register_forward_hook(_pop(stack)))
    printed = io.StringIO()
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)  # its warnings about data-dependent symbols repeat what we raise
    try:
        # torch prints the partial graph of a failed export to stderr: held back, and given back on success
        with contextlib.redirect_stderr(printed):
            program = torch.export.export(step, batch, dynamic_shapes=(tuple({0: dim} for _ in batch),),
                                          strict=False)
    except CompileError:
        raise
    except Exception as err:  # torch's export errors are many classes; each becomes one line
        raise CompileError(_export_error(err, stack[-1] if stack else "model")) from None
    finally:
        shapes_log.setLevel(level)
        for h in handles:
            h.remove()
    sys.stderr.write(printed.getvalue())
    return program


def _pop(stack):
    def hook(module, args, output):
        stack.pop()  # returns None: a forward hook's return value would replace the output

    return hook


def _export_error(err, path):
    where = path or "step"  # the Step's own code: a loss given as a plain function
    text = str(err)
    expr = re.search(r"data-dependent expression (.+?) \(unhinted", text)
    if expr:
        op = _unbacked_op(getattr(err, "partial_fx_graph", "") or "", expr.group(1))
        return (f"{where}: data-dependent control flow ({op}a Python decision on {expr.group(1)}, at "
                f"{_user_frame(err)}); not supported: a captured step runs the same ops on every batch "
                f"(compute both sides and use torch.where)")
    fixed = re.search(r"specialized it to be a constant \((\d+)\)", text)
    if fixed:
        return (f"model: the model's code fixes the batch size to {fixed.group(1)}; the batch dimension "
                f"must stay free (use -1 or x.shape[0] in view/reshape)")
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{where}: cannot be captured ({type(err).__name__}: {first}, at {_user_frame(err)})"


def _unbacked_op(partial_graph, expr):
    """``aten.nonzero: `` for the op that made a data-dependent symbol of ``expr`` (from the partial
    graph torch attaches to the error), or ''."""
    symbols = set(re.findall(r"\bu\d+\b", expr))
    for line in partial_graph.splitlines():
        m = re.match(r'\s*\w+: "([^"]*)" = torch\.ops\.(\w+\.\w+)\.', line)
        if m and symbols & set(re.findall(r"\bu\d+\b", m.group(1))):
            return f"{m.group(2)}: "
    return ""


def _user_frame(err):
    """``file:line `code``` of the innermost frame of the error outside torch (the user's code)."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(torch_dir) and not f.filename.startswith("<")]
    if not frames:
        return "an unknown place"
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} `{(f.line or '').strip()}`"


def _functional_batch_norms(program, step):
    """Make every BatchNorm of ``program`` that updates its running statistics in training functional:
    it normalises by the micro-batch's statistics and writes no buffer; its micro-batch mean and
    unbiased variance per channel are new outputs of the graph, and its ``num_batches_tracked``
    increment is dropped (the front-end counts micro-batches). Returns (module path, momentum, mean
    output, variance output) of each, in graph order."""
    aten = torch.ops.aten
    graph = program.graph
    buffers = {s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.BUFFER}
    found, extra = [], []
    for node in list(graph.nodes):
        if node.target is not aten.batch_norm.default:
            continue
        x, weight, bias, mean, var, training, momentum, eps, cudnn = (list(node.args) + [None] * 9)[:9]
        if training is not True or not (isinstance(mean, fx.Node) and mean.name in buffers):
            continue
        path, _ = module_of(node)
        node.args = (x, weight, bias, None, None, True, momentum, eps, cudnn)
        dims = [0] + list(range(2, x.meta["val"].dim()))
        with graph.inserting_after(node):
            both = graph.call_function(aten.var_mean.correction, (x, dims), {"correction": 1})
            with graph.inserting_after(both):
                v = graph.call_function(operator.getitem, (both, 0))
                m = graph.call_function(operator.getitem, (both, 1))
        for new in (both, v, m):
            new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        with _fake_mode(x):
            both.meta["val"] = aten.var_mean.correction(x.meta["val"], dims, correction=1)
            v.meta["val"], m.meta["val"] = both.meta["val"]
        found.append((path, float(momentum), m.name, v.name))
        extra += [m, v]
    if not found:
        return ()
    for node in list(graph.nodes):  # the counters of the batch norms made functional
        if node.target is aten.add_.Tensor and isinstance(node.args[0], fx.Node) \
                and node.args[0].name in buffers and node.args[0].target.endswith("num_batches_tracked") \
                and not node.users:
            graph.erase_node(node)
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = (tuple(output.args[0]) + tuple(extra),)
    graph.lint()
    return tuple(found)


def _outputs_computed(program):
    """An output that is an input of the graph (a batch's tensor, a weight the step hands Python) as a
    copy made by the graph: every output is a value some unit computes and hands on."""
    graph = program.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = []
    for value in output.args[0]:
        if isinstance(value, fx.Node) and value.op == "placeholder":
            with graph.inserting_before(output):
                copy = graph.call_function(torch.ops.aten.clone.default, (value,))
            copy.meta["val"] = value.meta["val"]
            value = copy
        outputs.append(value)
    output.args = (tuple(outputs),)


def _fake_mode(x):
    """The fake tensor mode of a node's metadata value, to compute new nodes' metadata in."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode([x.meta["val"]]) or contextlib.nullcontext()


def _refuse_unstreamable(program, step):
    """CompileError for the first op, in graph order, that reads a tensor's value back into Python
    or gives a data-dependent shape, or that updates a buffer."""
    buffers = {s.arg.name: s.target for s in program.graph_signature.input_specs if s.kind == InputKind.BUFFER}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        path, cls = module_of(node)
        if free_unbacked_symbols(node.meta.get("val")):
            op = op_name(node)
            at = source_line(node.meta.get("stack_trace"))
            if op in ("aten.item", "aten._local_scalar_dense"):
                raise CompileError(f"{path}: .item() in forward ({op} at {at}); not supported: a captured "
                                   f"step cannot read a tensor's value back into Python (keep it a tensor)")
            raise CompileError(f"{path}: data-dependent shape ({op} at {at}); not supported: every unit "
                               f"has static shapes (use a mask and torch.where)")
        buffer = _mutated_buffer(node, buffers)
        if buffer is None:
            continue
        if isinstance(step.get_submodule(path) if path != "step" else step, nn.modules.batchnorm._BatchNorm):
            raise CompileError(f"{path}: {cls} updates its running statistics in forward (training); not "
                               f"supported: use eval mode or LayerNorm/GroupNorm")
        raise CompileError(f"{path}: {cls} updates its buffer {buffer} in forward ({op_name(node)}); not "
                           f"supported in training: a unit's buffers are constants")


def _mutated_buffer(node, buffers):
    """The path of the buffer a node updates in place, or None."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    values = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
              for i, a in enumerate(schema.arguments)}
    for arg in schema.arguments:
        value = values[arg.name]
        if not isinstance(value, fx.Node) or value.name not in buffers:
            continue
        writes = arg.alias_info is not None and arg.alias_info.is_write
        # aten.batch_norm's schema marks no write, yet in training it updates its running statistics
        if writes or (arg.name in ("running_mean", "running_var") and values.get("training") is True):
            return buffers[value.name]
    return None
