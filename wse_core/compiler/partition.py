"""Partition: a captured step cut into streaming units, each an fx graph of its own.

Default cut: each element of the ModuleList/Sequential holding the most parameters (the model's
blocks) is a unit; what runs before the first is the "head", what runs after the last (with the
loss) the "tail". An element without parameters joins the unit before it, and so does an op that
runs between two blocks: there is nothing to stream for them. ``units=[BlockClass, ...]`` makes
each instance of those classes a unit instead. Units are numbered in the order they run, which is
the order weights stream; a block whose ops run interleaved with another's is refused. A head
that reads no parameter joins the first block.

A unit reads parameters (by owner name: a tied weight is read by each unit that uses it, under
one name), the step's inputs, and values earlier units made. It hands on the values later units
read, so a value several units read (an attention mask, rotary tables) is made once, by its
unit, and given to each reader. Buffers and lifted constants are attributes of the unit's module:
they are not trained, and capture refused any update of them.
"""
import contextlib
from dataclasses import dataclass, replace

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind
from torch.utils.flop_counter import FlopCounterMode

from wse_core.compiler import loss, runner
from wse_core.compiler.errors import CompileError, module_of, op_name


@dataclass(frozen=True)
class Unit:
    """One streaming unit: its graph, what it reads and hands on, and its costs on the example
    micro-batch (FLOPs as FlopCounterMode counts them: matmul-class ops, convolutions, attention)."""

    name: str  # "head", a block's module path in the step ("model.transformer.h.0"), or "tail"
    module: fx.GraphModule  # one placeholder per entry of `inputs`; returns the tuple of `outputs`
    params: tuple  # owner names of the parameters it reads, in first-use order
    inputs: tuple  # per placeholder: ("param", owner) | ("input", index in the batch) | ("value", name)
    outputs: tuple  # names of the values it hands on; the tail's is the loss
    loss: "loss.Loss | None" = None  # the tail's: how micro-batch losses make the step's
    values: tuple = ()  # the tail's: how each other output (a value for Python) combines over micro-batches
    flops_forward: int = 0
    flops_backward: int = 0
    param_bytes: int = 0  # of the parameters it reads (a tied one counts in each unit that streams it)
    boundary_bytes: int = 0  # of the tensors it hands on


def partition(graph, units=None, training=True):
    """The streaming units of a captured ``graph`` (``capture.Graph``), in running order, their costs
    measured on the graph's example micro-batch. ``units``: classes whose instances are the units.
    ``training``: the graph's first output is a loss (its reduction analysed, the backward measured);
    otherwise every output is a value an evaluation reads."""
    nodes = [n for n in graph.program.graph.nodes if n.op not in ("placeholder", "output")]
    blocks = _blocks(graph.step, units)
    unit_of, names = _assign(nodes, blocks, graph)
    built = _build(graph, nodes, unit_of, names)
    if training:
        output = next(n for n in graph.program.graph.nodes if n.op == "output").args[0]
        ema = {name: momentum for _, momentum, *names in graph.batch_norms for name in names}
        values = tuple(loss.Loss("ema", "aten.batch_norm", value=node.name, momentum=ema[node.name]) if node.name in ema
                       else loss.combination(graph.program, node, graph.example) for node in output[1:])
        built[-1] = replace(built[-1], loss=loss.analyse(graph.program, example=graph.example), values=values)
    return _measure(built, graph, training)


def _blocks(step, classes):
    """Module paths (in the step) of the modules that are units of their own."""
    if classes:
        found = []
        for path, module in step.named_modules():
            if isinstance(module, tuple(classes)) and not any(path.startswith(f"{f}.") for f in found):
                found.append(path)  # an instance inside an instance belongs to the outer one
        if not found:
            raise CompileError(f"units: no module of the model is a {' or '.join(c.__name__ for c in classes)}")
        return set(found)
    best, most = None, 0
    for path, module in step.model.named_modules(prefix="model"):
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1:
            size = sum(p.numel() for p in module.parameters())
            if size > most:  # ties: the outer container, met first
                best, most = (path, module), size
    if best is None:
        return set()
    path, container = best
    return {f"{path}.{name}" for name, child in container.named_children() if next(child.parameters(), None) is not None}


def _block_of(node, blocks):
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():  # outermost first
        if path in blocks:
            return path
    return None


def _assign(nodes, blocks, graph):
    """Unit index of each node (monotone in graph order) and the units' names."""
    of = [_block_of(n, blocks) for n in nodes]
    if blocks:
        in_model = [b is not None for b in of]
    else:
        in_model = [module_of(n)[0] == "model" or module_of(n)[0].startswith("model.") for n in nodes]
    last = max((i for i, inside in enumerate(in_model) if inside), default=-1)
    order, unit_of, current = {}, {}, 0
    for i, (node, block) in enumerate(zip(nodes, of)):
        if block is not None:
            index = order.setdefault(block, len(order) + 1)
            if index < current:
                later = next(b for b, i in order.items() if i == current)
                raise CompileError(f"{block}: {node.name} ({op_name(node)} in {module_of(node)[0]}) runs after "
                                   f"ops of a later unit ({later}); a unit's ops must run together to be streamed")
            current = index
        unit_of[node] = current if i <= last else len(order) + 1
    names = ["head", *order, "tail"]
    params = {s.arg.name for s in graph.program.graph_signature.input_specs if s.kind == InputKind.PARAMETER}
    head_reads = any(a.name in params for n in nodes if unit_of[n] == 0 for a in n.all_input_nodes)
    if order and not head_reads:
        unit_of = {n: max(u, 1) for n, u in unit_of.items()}  # a head without weights streams nothing
    used = sorted(set(unit_of.values()))
    renumber = {u: i for i, u in enumerate(used)}
    return {n: renumber[u] for n, u in unit_of.items()}, [names[u] for u in used]


def _build(graph, nodes, unit_of, names):
    """One fx module per unit: placeholders for what it reads, outputs for what later units read."""
    program = graph.program
    specs = {s.arg.name: s for s in program.graph_signature.input_specs}
    user = {name: i for i, name in enumerate(program.graph_signature.user_inputs)}
    members = [[] for _ in names]
    for node in nodes:
        members[unit_of[node]].append(node)
    needs = [{} for _ in names]  # unit -> the outside nodes it reads, in first-use order
    handed = set(next(n for n in program.graph.nodes if n.op == "output").all_input_nodes)
    for u, unit_nodes in enumerate(members):
        for node in unit_nodes:
            for a in node.all_input_nodes:
                if a.op == "placeholder" or unit_of[a] != u:
                    needs[u].setdefault(a)
                    if a.op != "placeholder":
                        handed.add(a)
    out = []
    for u, name in enumerate(names):
        g, env, attrs = fx.Graph(), {}, {}
        sources = {a: _source(a, specs, user, graph) if a.op == "placeholder" else ("value", a.name)
                   for a in needs[u]}
        inputs = [source for source in sources.values() if source[0] != "const"]
        for a, (kind, _) in sources.items():
            if kind != "const":
                env[a] = g.placeholder(a.name)
                env[a].meta["val"] = a.meta.get("val")  # its symbolic shape: what lowering reads (lower.py)
        for a, (kind, value) in sources.items():
            if kind == "const":  # a buffer or constant: an attribute of the unit's module
                attrs[f"const_{a.name}"] = value
                env[a] = g.get_attr(f"const_{a.name}")
                env[a].meta["val"] = a.meta.get("val")
        for node in members[u]:
            env[node] = g.node_copy(node, env.__getitem__)
            if node.op == "get_attr":  # a higher-order op's body (torch.no_grad, autocast regions)
                attrs[node.target] = getattr(program.graph_module, node.target)
        outputs = [n for n in members[u] if n in handed]
        g.output(tuple(env[n] for n in outputs))
        params = tuple(dict.fromkeys(key for kind, key in inputs if kind == "param"))
        out.append(Unit(name=name, module=fx.GraphModule(attrs, g), params=params, inputs=tuple(inputs),
                        outputs=tuple(n.name for n in outputs),
                        param_bytes=sum(graph.params[p].numel() * graph.params[p].element_size() for p in params)))
    return out


def _source(placeholder, specs, user, graph):
    spec = specs[placeholder.name]
    if spec.kind == InputKind.PARAMETER:
        return "param", graph.owner(spec.target)
    if spec.kind == InputKind.USER_INPUT:
        return "input", user[placeholder.name]
    if spec.kind == InputKind.BUFFER:
        return "const", graph.buffers[spec.target]
    if spec.kind == InputKind.CONSTANT_TENSOR:
        return "const", graph.program.constants[spec.target]
    raise CompileError(f"step: graph input {placeholder.name} is a {spec.kind.name}, which units cannot hold")


class _Meter:
    """FLOPs of each unit's forward and backward, and the bytes each hands on, over one micro-batch."""

    def __init__(self, n):
        self.flops = [{"forward": 0, "backward": 0} for _ in range(n)]
        self.handed = [0] * n

    @contextlib.contextmanager
    def phase(self, unit, name):
        with FlopCounterMode(display=False) as counter:
            yield
        self.flops[unit][name] = counter.get_total_flops()

    def hand_on(self, unit, values):
        self.handed[unit] = sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _measure(units, graph, training):
    meter = _Meter(len(units))
    if training:
        runner.forward_backward(units, graph.params, graph.example, 1.0, [0] * len(units), meter)
    else:
        runner.forward(units, graph.params, graph.example, [0] * len(units), meter)
    return [replace(u, flops_forward=f["forward"], flops_backward=f["backward"], boundary_bytes=b)
            for u, f, b in zip(units, meter.flops, meter.handed)]
