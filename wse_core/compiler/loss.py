"""How micro-batch losses make the step's: the loss's reduction over the batch, read from the graph.

A mean-reduced loss (``CrossEntropyLoss``'s default) of micro-batch j is a mean over its n_j terms,
and the step's loss is the mean over the global batch's N = n_1 + ... + n_M terms, so micro-batch j
weighs w_j = n_j / N: the step's loss is sum_j w_j * loss_j, and its gradients likewise (the
runner seeds micro-batch j's backward with w_j instead of 1). n_j is the micro-batch's sample
count (every sample has the same number of terms), or for a class-target loss with an
``ignore_index`` the number of its targets that are not ignored. Those are counted by the part of
the graph that makes the loss's targets from the inputs (HF's losses shift and pad the labels
first), run on the micro-batch before its forward, as the coordinator will count them from the
global batch. A sum-reduced loss weighs 1. Anything else is refused: the runner could not tell
how to combine micro-batches.
"""
from dataclasses import dataclass

import torch
from torch import fx
from torch.export.graph_signature import InputKind

from wse_core.compiler.errors import CompileError, module_of, op_name

aten = torch.ops.aten

# reduction argument of aten's loss ops (torch.nn._reduction): what the loss does over its terms
_NONE, _MEAN, _SUM = 0, 1, 2


@dataclass(frozen=True)
class Loss:
    """The step's loss: ``reduction`` "mean" or "sum" over the batch, by op ``op``; ``counter`` counts
    a micro-batch's terms not ignored (from its inputs), or is None: they are its samples."""

    reduction: str
    op: str
    counter: fx.GraphModule | None = None

    def weights(self, batch, ranges):
        """w_j of each micro-batch [lo, hi) of the global ``batch`` (a tuple of tensors)."""
        if self.reduction == "sum":
            return [1.0] * len(ranges)
        counts = [hi - lo if self.counter is None else int(self.counter(*(t[lo:hi] for t in batch)))
                  for lo, hi in ranges]
        total = sum(counts)
        if total == 0:
            raise ValueError("batch: every target is the loss's ignore_index, so the loss is undefined")
        return [count / total for count in counts]


def analyse(program):
    """The ``Loss`` of a captured step's program; CompileError if its reduction is not known."""
    output = next(n for n in program.graph.nodes if n.op == "output")
    (node,) = output.args[0]  # the Step returns the loss alone
    where = f"{module_of(node)[0]}: the loss ({op_name(node)})"
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        shape = ([d if isinstance(d, int) else "B" for d in val.shape] if isinstance(val, torch.Tensor)
                 else type(val).__name__)  # a symbolic size is the batch's
        raise CompileError(f"{where} is {shape}, not a scalar: reduce it over the batch (mean or sum)")
    if node.target is aten.mean.default:
        return Loss("mean", op_name(node))
    if node.target is aten.sum.default:
        return Loss("sum", op_name(node))
    args = _arguments(node)
    reduction = args.get("reduction")
    if reduction == _SUM:
        return Loss("sum", op_name(node))
    if reduction != _MEAN:
        raise CompileError(f"{where} does not end in a mean or sum over the batch; the runner needs one to "
                           f"weigh micro-batches (end the loss with a reduction, or .mean() / .sum())")
    target = args.get("target")
    if "ignore_index" not in args or not isinstance(target, fx.Node) or target.meta["val"].is_floating_point():
        return Loss("mean", op_name(node))
    if args.get("weight") is not None:
        raise CompileError(f"{where} is a class-weighted mean, not supported: its divisor is a sum of "
                           f"class weights over the global batch (use reduction='sum', or no weight)")
    return Loss("mean", op_name(node), _counter(program, target, args["ignore_index"], where))


def _arguments(node):
    """A call's arguments by schema name, defaults filled in."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    return {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
            for i, a in enumerate(schema.arguments)}


def _counter(program, target, ignore_index, where):
    """An fx module: the step's inputs -> how many entries of the loss's ``target`` are not ``ignore_index``."""
    needed, todo = set(), [target]
    while todo:
        node = todo.pop()
        if node not in needed:
            needed.add(node)
            todo.extend(node.all_input_nodes)
    inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    made_of = sorted(n.name for n in needed if n.op == "placeholder" and n.name not in inputs)
    if made_of:
        raise CompileError(f"{where}: its targets are computed from {made_of[0]}, not from the inputs alone, "
                           f"so the terms its ignore_index leaves cannot be counted before the step")
    graph, env = fx.Graph(), {}
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for name in inputs:
        env[by_name[name]] = graph.placeholder(name)
    for node in program.graph.nodes:
        if node in needed and node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    kept = graph.call_function(aten.ne.Scalar, (env[target], ignore_index))
    graph.output(graph.call_function(aten.sum.default, (kept,)))
    return fx.GraphModule(program.graph_module, graph)
