"""How micro-batch losses make the step's: the loss's reduction over the batch, read from the graph.

A mean-reduced loss of micro-batch j is its sum over its terms divided by their number n_j, and
the step's loss is the global batch's sum divided by N = n_1 + ... + n_M, so micro-batch j weighs
w_j = n_j / N: the step's loss is sum_j w_j * loss_j, and its gradients likewise (the runner seeds
micro-batch j's backward with w_j instead of 1). A sum-reduced loss weighs 1.

The reduction is read off the graph's last ops, as users write losses (casts such as a trailing
``.to(dtype)`` are looked through):

- ``mean()`` over every dimension, or a loss op reduced by ``"mean"`` (``CrossEntropyLoss``'s
  default): n_j is the micro-batch's sample count (every sample has the same number of terms), or
  for a class-target loss with an ``ignore_index`` the number of its targets that are not ignored;
- ``sum()``, or a loss op reduced by ``"sum"``: a sum;
- a sum divided by a value made from the inputs alone (``loss.sum() / (B * T)`` with ``B =
  x.shape[0]``, a masked mean ``(l * mask).sum() / mask.sum()``, ``F.cross_entropy(...,
  reduction="sum") / labels.ne(-100).sum()``): a mean whose n_j is that divisor on micro-batch j,
  which must add up over the samples (checked on the captured example);
- a mean or sum divided by, or multiplied by, a constant (``loss.sum() / 64``): the same reduction,
  scaled.

The divisor n_j is counted by the part of the graph that makes it from the inputs (HF's losses
shift and pad the labels first), run on the micro-batch before its forward, as the coordinator
will count them from the global batch. Anything else is refused in one line: the runner could
not tell how to combine micro-batches.
"""
from dataclasses import dataclass, replace

import torch
from torch import fx
from torch.export.graph_signature import InputKind

from wse_core.compiler.errors import CompileError, module_of, op_name
from wse_core.errors import ConfigError, DataError

aten = torch.ops.aten

# reduction argument of aten's loss ops (torch.nn._reduction): what the loss does over its terms
_NONE, _MEAN, _SUM = 0, 1, 2


@dataclass(frozen=True)
class Loss:
    """The step's loss: ``reduction`` "mean" or "sum" over the batch, by op ``op``; ``counter`` counts
    a micro-batch's terms (from its inputs: the divisor of its mean), or is None: they are its samples."""

    reduction: str
    op: str
    counter: fx.GraphModule | None = None
    value: str = ""  # the name of the graph's value that is the loss
    momentum: float = 0.0  # an "ema" combination's (a BatchNorm's running statistics)

    def count(self, inputs):
        """n_j of a micro-batch of ``inputs`` (a tuple of tensors): its terms, an integer."""
        if self.counter is None:
            return len(inputs[0])
        value = self.counter(*inputs)
        value = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        if value != int(value):
            raise ConfigError(f"{self.op}: the loss's divisor is {value} on a micro-batch, not a count of terms")
        return int(value)

    def weights(self, batch, ranges):
        """w_j of each micro-batch [lo, hi) of the global ``batch`` (a tuple of tensors)."""
        if self.reduction == "sum":
            return [1.0] * len(ranges)
        counts = [self.count(tuple(t[lo:hi] for t in batch)) for lo, hi in ranges]
        total = sum(counts)
        if total == 0:
            raise DataError("batch: the loss counts no term in the whole batch (every target ignored, or a mask "
                            "of zeros), so the loss is undefined")
        return [count / total for count in counts]

    def check_additive(self, example, where):
        """The divisor adds up over the samples: on the captured ``example``, that of the whole is the
        sum of its halves' (a divisor that does not, a maximum or a clamped count, cannot weigh
        micro-batches). CompileError otherwise."""
        n = len(example[0])
        if self.counter is None or n < 2:
            return
        halves = [self.count(tuple(t[lo:hi] for t in example)) for lo, hi in ((0, n // 2), (n // 2, n))]
        whole = self.count(example)
        if whole != sum(halves):
            raise CompileError(f"{where}: its divisor is {whole} on the example batch but {halves[0]} + {halves[1]} "
                               "on its halves, so it is not a count of terms the cluster can add over micro-batches "
                               "(divide by a count: a mask's sum, the samples times the length)")


#: Ops a loss may end in after its reduction that change no value the runner weighs: casts and copies.
_THROUGH = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.clone.default, aten.alias.default,
            aten.squeeze.default, aten.view.default, aten.reshape.default, aten.detach.default}
_DIVIDE = {aten.div.Tensor, aten.div.Scalar}
_ADD = {aten.add.Tensor, aten.sub.Tensor}
_REDUCE = {aten.mean.default, aten.mean.dim, aten.sum.default, aten.sum.dim_IntList}
_MULTIPLY = {aten.mul.Tensor, aten.mul.Scalar}


def analyse(program, node=None, what="the loss", example=None):
    """The ``Loss`` of ``node`` of a captured step's program (default: its first output, the loss);
    CompileError in one line if its reduction over the batch is not known. ``example``: the captured
    batch, on which a divisor made from the inputs is checked to add up over the samples."""
    if node is None:
        output = next(n for n in program.graph.nodes if n.op == "output")
        node = output.args[0][0]
    where = f"{module_of(node)[0]}: {what} ({op_name(node)})"
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        shape = ([d if isinstance(d, int) else "B" for d in val.shape] if isinstance(val, torch.Tensor)
                 else type(val).__name__)  # a symbolic size is the batch's
        raise CompileError(f"{where} is {shape}, not a scalar: reduce it over the batch (mean or sum)")
    found = replace(_reduction(program, node, where), value=node.name)
    if example is not None:
        found.check_additive(example, where)
    return found


def combination(program, node, example):
    """How the value ``node`` a training step hands Python (beside its loss) is made of its
    micro-batches' values, as a ``Loss`` whose ``reduction`` says it: "mean" or "sum" over the batch
    (read as a loss's is), "concat" (a value per sample: the micro-batches' in order), or "same" (a
    value the batch does not enter: any micro-batch's). CompileError in one line otherwise. (A
    BatchNorm's statistics combine as "ema": ``capture``'s docstring.)"""
    val = node.meta.get("val")
    where = f"{module_of(node)[0]}: a value the step hands Python ({op_name(node)})"
    if not isinstance(val, torch.Tensor):
        raise CompileError(f"{where} is a {type(val).__name__}, not a tensor")
    if not _reads_batch(program, node):
        return Loss("same", op_name(node), value=node.name)
    if val.dim() == 0:
        found = replace(_reduction(program, node, where), value=node.name)
        found.check_additive(example, where)
        return found
    if str(val.shape[0]) == str(_batch_size(program)):  # batch first: a value per sample
        return Loss("concat", op_name(node), value=node.name)
    raise CompileError(f"{where} is {list(val.shape)}, made from the batch but not batch-first: the cluster cannot "
                       "combine it over micro-batches (hand Python means, sums, or a value per sample)")


def _reads_batch(program, node):
    """Whether ``node`` depends on the step's inputs (not only on weights and constants)."""
    kinds = _input_kinds(program)
    return any(kinds.get(n.name) == InputKind.USER_INPUT for n in _ancestors(node) if n.op == "placeholder")


def _batch_size(program):
    """The batch's size as the graph knows it: the symbol of its inputs' first dimension."""
    kinds = _input_kinds(program)
    first = next(n for n in program.graph.nodes if n.op == "placeholder" and kinds.get(n.name) == InputKind.USER_INPUT)
    return first.meta["val"].shape[0]


def _ancestors(node):
    """``node`` and every node it is computed from."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _through(node):
    while isinstance(node, fx.Node) and node.target in _THROUGH:
        node = node.args[0]
    return node


def _reduction(program, node, where):
    node = _through(node)
    name = op_name(node)
    target = node.target
    if target in _REDUCE:
        kind = "mean" if target in (aten.mean.default, aten.mean.dim) else "sum"
        batch = _batch_dims(node.args[0])
        if not batch:  # the batch was reduced before: this one scales what that reduction made
            return replace(_reduction(program, node.args[0], where), op=name)
        if batch <= _reduced_dims(node):
            return Loss(kind, name)
    if target in _ADD and all(isinstance(a, fx.Node) for a in node.args[:2]):
        return _terms(program, node, where)
    if target in _DIVIDE or target in _MULTIPLY:
        value, by = node.args[:2]
        if isinstance(value, (int, float)):
            value, by = by, value  # 2 * loss
        if _constant(program, by):  # a scale: the reduction of what it scales
            return _reduction(program, value, where)
        inner = _reduction(program, value, where)
        if target in _MULTIPLY or inner.reduction != "sum":
            raise CompileError(f"{where} {'multiplies' if target in _MULTIPLY else 'divides'} a "
                               f"{inner.reduction} by a value computed in the step; the runner weighs a sum "
                               "divided by a count made from the inputs (a mask's sum, the samples)")
        return Loss("mean", name, _subgraph(program, by, where, lambda graph, value: value))
    args = _arguments(node)
    reduction = args.get("reduction")
    if reduction == _SUM:
        return Loss("sum", name)
    if reduction != _MEAN:
        raise CompileError(f"{where} does not end in a mean or sum over the batch; the runner needs one to "
                           f"weigh micro-batches (end the loss with a reduction, or .mean() / .sum())")
    target = args.get("target")
    if "ignore_index" not in args or not isinstance(target, fx.Node) or target.meta["val"].is_floating_point():
        return Loss("mean", name)
    if args.get("weight") is not None:
        raise CompileError(f"{where} is a class-weighted mean, not supported: its divisor is a sum of "
                           f"class weights over the global batch (use reduction='sum', or no weight)")
    ignore = args["ignore_index"]

    def kept(graph, value):
        return graph.call_function(aten.sum.default, (graph.call_function(aten.ne.Scalar, (value, ignore)),))

    return Loss("mean", name, _subgraph(program, target, where, kept))


def _terms(program, node, where):
    """The reduction of a sum (or difference) of loss terms: the terms' one reduction, terms the batch
    does not enter (a weight penalty) counting once in a mean; terms weighed by other counts (a
    masked mean beside a mean over samples) would need a weight each: refused."""
    found, free = [], []
    for term in node.args[:2]:
        (found if _reads_batch(program, term) else free).append(term)
    kinds = [_reduction(program, term, where) for term in found]
    if not kinds:
        raise CompileError(f"{where} is not made from the batch")
    first = kinds[0]
    if any((k.reduction, k.counter is None) != (first.reduction, first.counter is None) for k in kinds) \
            or (len(kinds) > 1 and first.counter is not None):
        ops = ", ".join(k.op for k in kinds)
        raise CompileError(f"{where} adds terms reduced over the batch in different ways ({ops}: "
                           "each weighs a micro-batch by its own count); not supported: one reduction for the loss "
                           "(or means over the samples each)")
    if free and first.reduction == "sum":
        raise CompileError(f"{where} adds a term the batch does not enter to a sum over the batch: each micro-batch "
                           "would add it again (make the loss a mean, or the term part of the sum)")
    return Loss(first.reduction, op_name(node), first.counter)


def _reduced_dims(node):
    """The dimensions of its input a mean or sum reduces (all, without a ``dim``)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    rank = node.args[0].meta["val"].dim()
    return set(range(rank)) if dims is None or dims == [] else {d % rank for d in dims}


def _batch_dims(value):
    """The dimensions of a node's value whose size is symbolic: the batch's (it may be folded into
    another, as in a [B * T] view)."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return set()
    return {i for i, size in enumerate(val.shape) if not isinstance(size, int)}


def _constant(program, value):
    """Whether ``value`` (a node or a Python number) is the same for every batch: a number, or a node
    reading no placeholder but lifted constants."""
    if not isinstance(value, fx.Node):
        return True
    kinds = _input_kinds(program)
    return all(kinds.get(n.name) == InputKind.CONSTANT_TENSOR for n in _ancestors(value) if n.op == "placeholder")


def _input_kinds(program):
    return {s.arg.name: s.kind for s in program.graph_signature.input_specs}


def _arguments(node):
    """A call's arguments by schema name, defaults filled in."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    return {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
            for i, a in enumerate(schema.arguments)}


def _subgraph(program, value, where, finish):
    """An fx module: the step's inputs -> ``finish(graph, value)``, ``value`` being a node of the
    program computed from the inputs alone (CompileError if it reads a parameter or buffer)."""
    needed = _ancestors(value)
    inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    made_of = sorted(n.name for n in needed if n.op == "placeholder" and n.name not in inputs)
    if made_of:
        raise CompileError(f"{where}: its divisor is computed from {made_of[0]}, not from the inputs alone, "
                           "so the terms of a micro-batch cannot be counted before the step")
    graph, env = fx.Graph(), {}
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for name in inputs:
        env[by_name[name]] = graph.placeholder(name)
    for node in program.graph.nodes:
        if node in needed and node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(finish(graph, env[value]))
    return fx.GraphModule(program.graph_module, graph)
