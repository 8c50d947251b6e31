"""Lowering: a unit's heavy aten ops run on the wafer's kernels (``wse_core.nn``), with their backward.

``lower(unit, known)`` rewrites a partitioned unit's graph in place: each node of an op the kernels
do becomes a node of a custom op (``torch.ops.wse.*``, ``torch.library.custom_op``) whose forward
and backward (``register_autograd``) are ``wse_core.nn``'s kernels: the weight products
(``aten.linear``, and ``aten.addmm`` of a weight, GPT-2's ``Conv1D``), ``aten.layer_norm``,
``aten.embedding``, causal ``aten.scaled_dot_product_attention``, ``aten.cross_entropy_loss``, the
elementwise ``add``/``sub``/``mul``/``div`` whose operand is broadcast over the batch (a bias, a
norm's weight, a position embedding), and ``aten.conv2d`` (torch's, a sample at a time). The rest
(reshapes, elementwise glue) runs in torch.

What decides the bits is fixed at lowering, from the graph's symbolic shapes: ``batch_dims`` follows
the batch through the step, and every sum over samples of a lowered op (a weight's gradient, a
norm's, an embedding's table, the loss) is the tree over samples (``wse_core.nn.sample_tree``), so a
sample's part does not depend on its micro-batch. ``report`` names the ops left to torch, their
share of the unit's work, and every op whose sums span a micro-batch (docs/design/compiler.md
"Lowering").

The custom ops are ``kernel_ops``'.
"""
import math
import operator

import torch
from torch import fx

from wse_core.compiler.kernel_ops import (BINARY, aten, attention_, broadcast, conv2d, cross_entropy, embedding,
                                          layer_norm, product)

#: The name a unit hands a lowered loss's float64 sum on by: the loss's, and this.
SUM = ":sum"

#: aten ops that draw from the default generator without naming one in their schema.
_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
           "multinomial", "normal", "uniform", "exponential", "poisson", "rrelu", "rrelu_with_noise",
           "cauchy", "geometric", "log_normal", "random"}
_DROPOUT = {aten.dropout.default, aten.native_dropout.default,
            aten.feature_dropout.default, aten.alpha_dropout.default}


def draws(node):
    """Whether ``node`` draws from torch's generator when it runs: an op whose schema takes one
    (rand, bernoulli, normal_, uniform_, rrelu with training, ...), or dropout at a rate above 0
    (its schema names none; it draws from the default one) in training (eval mode's is the identity)."""
    if node.op != "call_function":
        return False
    if node.target in _DROPOUT:
        rate = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return train is not False and not (isinstance(rate, (int, float)) and rate == 0)
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    return schema.name.split("::")[-1].rstrip("_") in _RANDOM or any("Generator" in str(a.type)
                                                                   for a in schema.arguments)



# -- the rewrite ----------------------------------------------------------------------------------

_BY_TARGET = {v: k for k, v in BINARY.items()}
#: Ops that compute nothing (views, sizes, metadata): neither lowered nor work left to torch.
_FREE = {"view", "reshape", "_unsafe_view", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand", "slice",
         "select", "split", "split_with_sizes", "unflatten", "flatten", "contiguous", "clone", "alias", "detach",
         "sym_size", "_assert_tensor_metadata", "to", "getitem", "lift_fresh_copy", "unbind", "chunk"}
_SCHEMAS = {  # an aten op's arguments, by name, with their defaults
    aten.linear.default: (("input", None), ("weight", None), ("bias", None)),
    aten.addmm.default: (("self", None), ("mat1", None), ("mat2", None), ("beta", 1), ("alpha", 1)),
    aten.layer_norm.default: (("input", None), ("normalized_shape", None), ("weight", None), ("bias", None),
                              ("eps", 1e-5), ("cudnn_enable", True)),
    aten.embedding.default: (("weight", None), ("indices", None), ("padding_idx", -1), ("scale_grad_by_freq", False),
                             ("sparse", False)),
    aten.scaled_dot_product_attention.default: (("query", None), ("key", None), ("value", None), ("attn_mask", None),
                                                ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
                                                ("enable_gqa", False)),
    aten.cross_entropy_loss.default: (("self", None), ("target", None), ("weight", None), ("reduction", 1),
                                      ("ignore_index", -100), ("label_smoothing", 0.0)),
    aten.conv2d.default: (("input", None), ("weight", None), ("bias", None), ("stride", [1, 1]), ("padding", [0, 0]),
                          ("dilation", [1, 1]), ("groups", 1)),
}


def _arguments(node):
    """The node's arguments by name, defaults filled in (``_SCHEMAS``)."""
    names = _SCHEMAS[node.target]
    out = {name: default for name, default in names}
    out.update(zip((n for n, _ in names), node.args))
    out.update(node.kwargs)
    return out


def _float32(*nodes):
    return all(isinstance(_val(n), torch.Tensor) and _val(n).dtype == torch.float32 for n in nodes)


def _lowering(node, batch):
    """(custom op, its arguments, whether it returns a tuple whose first item is the value) that runs
    ``node`` on the kernels, or None: torch keeps it."""
    if node.target in _BY_TARGET and len(node.args) == 2 and not node.kwargs:
        batched = _broadcast_operand(node, batch)
        return None if batched is None else (
            broadcast, (*node.args, _BY_TARGET[node.target], batched, batch.per_sample(node.args[batched])), False)
    if node.target not in _SCHEMAS:
        return None
    a = _arguments(node)
    t = node.target
    if t is aten.linear.default and _float32(a["input"], a["weight"]) and _val(a["weight"]).dim() == 2 \
            and (a["bias"] is None or _float32(a["bias"])):
        rows, outer = batch.product_layout(a["input"])
        return product, (a["input"], a["weight"], a["bias"], rows, False, outer), False
    if t is aten.addmm.default and a["beta"] == 1 and a["alpha"] == 1 and _float32(a["self"], a["mat1"], a["mat2"]) \
            and _val(a["self"]).dim() == 1:
        rows, outer = batch.product_layout(a["mat1"])
        return product, (a["mat1"], a["mat2"], a["self"], rows, True, outer), False
    if t is aten.layer_norm.default and a["weight"] is not None and a["bias"] is not None \
            and len(a["normalized_shape"]) == 1 and _float32(a["input"], a["weight"], a["bias"]):
        return layer_norm, (a["input"], a["weight"], a["bias"], float(a["eps"]),
                            batch.rows(a["input"])), True
    if t is aten.embedding.default and not a["scale_grad_by_freq"] and not a["sparse"] and _float32(a["weight"]):
        return embedding, (a["weight"], a["indices"], a["padding_idx"], batch.per_sample(a["indices"])), False
    if t is aten.scaled_dot_product_attention.default and a["dropout_p"] == 0.0 and not a["enable_gqa"] \
            and _float32(a["query"], a["key"], a["value"]):
        return attention_, (a["query"], a["key"], a["value"], a["attn_mask"], a["is_causal"], a["scale"]), True
    if t is aten.cross_entropy_loss.default and a["weight"] is None and a["label_smoothing"] == 0.0 \
            and a["reduction"] in (1, 2) and _float32(a["self"]) and _val(a["self"]).dim() == 2 \
            and _val(a["target"]).dim() == 1 and not _val(a["target"]).is_floating_point():
        return cross_entropy, (a["self"], a["target"], a["reduction"] == 1, a["ignore_index"],
                               batch.rows(a["self"])), True
    if t is aten.conv2d.default and batch.first(a["input"]) and _val(a["input"]).dim() == 4 \
            and _float32(a["input"], a["weight"]) and (a["bias"] is None or _float32(a["bias"])):
        pairs = [list(v) if isinstance(v, (list, tuple)) else [v, v] for v in (a["stride"], a["padding"], a["dilation"])]
        return conv2d, (a["input"], a["weight"], a["bias"], *pairs, a["groups"], batch.per_sample(a["input"])), False
    return None


def lower(unit, known=None):
    """Rewrite ``unit``'s graph (its fx module, in place, while it holds its symbolic shapes: before
    ``save_program`` writes it) to run the ops the kernels do; return ``report``'s. ``known``: the
    batch dimension of each of the step's values, by name (``batch_dims`` of the whole step: what a
    unit reads from another is laid out as it was made)."""
    batch = _Batch(unit, known)
    graph = unit.module.graph
    sums = {}  # a lowered loss's value node -> the node of its float64 sum
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        how = _lowering(node, batch)
        if how is None:
            continue
        op, args, tupled = how
        with graph.inserting_after(node):
            new = graph.call_function(op._opoverload, args)
            new.meta.update(node.meta)
            new.meta["wse_lowered"] = node.target
            value = new
            if tupled:
                with graph.inserting_after(new):
                    value = graph.call_function(operator.getitem, (new, 0))
                value.meta["val"] = node.meta.get("val")
            if op is cross_entropy:
                with graph.inserting_after(value):
                    sums[value] = graph.call_function(operator.getitem, (new, 2))
        batch.dims[new] = batch.dims[value] = batch.dims.get(node)  # later nodes read the new one
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    out = next(n for n in graph.nodes if n.op == "output")
    extra = {name + SUM: sums[n] for n, name in zip(out.args[0], unit.outputs) if n in sums}
    if extra:  # the unit hands each loss's sum on too: "<loss>:sum"
        out.args = ((*out.args[0], *extra.values()),)
    graph.lint()
    unit.module.recompile()
    batch.dims = batch_dims(graph, known)  # the rewritten graph's nodes
    return {**report(unit, batch), "sums": list(extra)}


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _sym_dims(val):
    return [i for i, d in enumerate(val.shape) if isinstance(d, torch.SymInt)] if isinstance(val, torch.Tensor) else []


def _prefix(shape, dim):
    return math.prod(int(d) for d in shape[:dim])


#: Ops that move, repeat or join entries along a dimension (``_acts_on`` says which).
_REORDERS = {"cat", "flip", "roll", "index_select", "repeat", "gather", "scatter", "index", "sort", "argsort",
             "narrow", "take_along_dim", "repeat_interleave", "stack"}
#: Reductions over a list of dimensions (``mean.dim``, ``sum.dim_IntList``, ...).
_REDUCTIONS = {"mean", "sum", "amax", "amin", "prod", "var", "std", "logsumexp", "norm"}
#: Ops that lay a value's elements out anew (the batch kept where the elements before it stay as many).
_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze", "expand"}


def batch_dims(graph, known=None):
    """{node: (d, outer) where dimension d of its value holds the batch, or None} over ``graph``, its
    placeholders' from ``known`` (by name: the whole step's, for a unit's) or the batch first.
    ``outer``: how many runs of the batch dimension d holds, one after the other ([L * B, E] made
    from a sequence-first [L, B, E]: (0, L)); (d, 1): each sample's part of it one contiguous run
    (sample-major). A reshape keeps the batch where the elements before it stay as many; a transpose
    or permute moves it; other ops keep it where an input of the output's rank has it."""
    dims = {}
    for node in graph.nodes:
        out = _val(node)
        syms = _sym_dims(out)
        if node.op in ("placeholder", "get_attr"):
            dims[node] = known.get(node.name) if known is not None and node.name in known else \
                ((0, 1) if syms == [0] else None)
            continue
        if node.op != "call_function":
            continue
        ins = [(a, dims.get(a)) for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
        src, d = next(((a, b) for a, b in ins if b is not None), (None, None))
        name = _name(node.target)
        b = None
        if name == "getitem":
            b = dims.get(node.args[0])  # a split's piece, a tuple's item: the tuple's (checked by shape below)
        elif isinstance(out, (tuple, list)):  # a split's pieces: the input's, unless it splits the batch
            at = node.args[1 if name == "unbind" else 2] if len(node.args) > (1 if name == "unbind" else 2) else 0
            b = None if d is None or isinstance(at, int) and at % _val(src).dim() == d[0] else d
        elif len(syms) != 1:
            b = None
        elif src is None:  # made from sizes (arange, new_ones) or a value broadcast over the batch (its
            # copies, one a sample: an expand's backward sums them, which ``report`` names); from a value
            # whose batch is not followed: none
            b = None if any(_sym_dims(_val(a)) for a in node.all_input_nodes) else (syms[0], 1)
        elif name in _REORDERS and _acts_on(node, d[0]):
            b = None  # samples moved, repeated or joined along the batch: not one run each
        elif name in ("transpose", "t"):
            d0, d1 = (node.args[1], node.args[2]) if name == "transpose" else (0, 1)
            rank = _val(src).dim()
            d0, d1 = d0 % rank, d1 % rank
            b = ({d0: d1, d1: d0}.get(d[0], d[0]), d[1])
        elif name == "permute":
            b = ([p % _val(src).dim() for p in node.args[1]].index(d[0]), d[1])
        elif name in _RESHAPES:
            before = _prefix(_val(src).shape, d[0]) * d[1]  # elements' runs before each sample's part
            prefix = _prefix(out.shape, syms[0])
            outer = before // prefix if before % prefix == 0 else 0
            coef = out.shape[syms[0]].node.expr / next(iter(out.shape[syms[0]].node.expr.free_symbols))
            b = (syms[0], outer) if outer and coef.is_Integer and int(coef) % outer == 0 else None
        elif name in ("select", "slice"):
            dim = node.args[1] % _val(src).dim() if len(node.args) > 1 else 0
            whole = name == "slice" and (len(node.args) < 3 or node.args[2] in (0, None)) \
                and (len(node.args) < 4 or node.args[3] is None or isinstance(node.args[3], int)
                     and node.args[3] >= 2 ** 62) and (len(node.args) < 5 or node.args[4] == 1)
            b = d if whole or dim != d[0] else None
            if b is not None and name == "select" and dim < b[0]:
                b = (b[0] - 1, b[1])
        elif name == "embedding":
            b = dims.get(node.args[1])
        elif name in _REDUCTIONS and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) \
                and not (len(node.args) > 2 and node.args[2] is True or node.kwargs.get("keepdim")):
            gone = [x % _val(src).dim() for x in node.args[1]]
            b = None if d[0] in gone else (d[0] - sum(x < d[0] for x in gone), d[1])
        else:
            same = [bb for a, bb in ins if bb is not None and _val(a).dim() == out.dim()]
            b = same[0] if same else None
        if b is not None and not isinstance(out, (tuple, list)) and b[0] not in syms:
            b = None
        dims[node] = b
    return dims


def _acts_on(node, dim):
    """Whether a ``_REORDERS`` op moves, repeats or joins entries along dimension ``dim`` of its input (when
    it cannot tell: yes)."""
    name, args = _name(node.target), node.args
    if name in ("cat", "stack"):
        return (args[1] if len(args) > 1 else node.kwargs.get("dim", 0)) % max(1, _val(node).dim()) == dim
    if name in ("flip", "roll"):
        dims = args[1] if name == "flip" else (args[2] if len(args) > 2 else None)
        return dims is None or dim in [x % _val(node).dim() for x in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if name in ("index_select", "gather", "narrow", "sort", "argsort", "take_along_dim"):
        return len(args) < 2 or not isinstance(args[1], int) or args[1] % _val(node).dim() == dim
    if name == "repeat":
        repeats = args[1] if len(args) > 1 else None
        return not isinstance(repeats, (list, tuple)) or dim >= len(repeats) or repeats[dim] != 1
    return True


class _Batch:
    """Where the batch is in a unit's values (``batch_dims``), and what follows for its sums."""

    def __init__(self, unit, known):
        self.dims = batch_dims(unit.module.graph, known)

    def first(self, node):
        """Whether the value's batch is its first dimension, sample-major."""
        return self.dims.get(node) == (0, 1)

    def per_sample(self, node):
        """Entries of the first dimension a sample has, of a value whose batch is first; 0 otherwise."""
        if not self.first(node):
            return 0
        expr = _val(node).shape[0].node.expr
        k = expr / next(iter(expr.free_symbols))
        return int(k) if len(expr.free_symbols) == 1 and k.is_Integer and int(k) >= 1 else 0

    def has(self, node):
        return bool(_sym_dims(_val(node)))

    def rows(self, node):
        """Rows a sample of a value whose batch is first (its rows: all dimensions but the last), else None."""
        val = _val(node)
        if not self.first(node) or val.dim() < 1:
            return None
        expr = val.shape[0].node.expr
        k = expr / next(iter(expr.free_symbols))
        if len(expr.free_symbols) != 1 or not k.is_Integer or int(k) < 1:
            return None
        return int(k) * math.prod(int(d) for d in val.shape[1:-1])

    def product_layout(self, node):
        """(rows a sample, the runs of the batch its rows are: 1, sample-major; L, a sequence-first
        layout's, as ``nn.MultiheadAttention`` makes inside ``nn.TransformerEncoderLayer``) of a
        product's input; (None, 1) when its batch is not followed (one sum over all its rows)."""
        val, where = _val(node), self.dims.get(node)
        if where is None or where[0] >= val.dim() - 1:
            return None, 1
        d, runs = where
        expr = val.shape[d].node.expr
        coef = expr / next(iter(expr.free_symbols))
        if len(expr.free_symbols) != 1 or not coef.is_Integer:
            return None, 1
        before = _prefix(val.shape, d)
        return before * int(coef) * math.prod(int(x) for x in val.shape[d + 1:-1]), before * runs


def _broadcast_operand(node, batch):
    """The index of the operand with the batch first when the other is broadcast over it (a weight, a
    position table), else None."""
    vals = [_val(a) for a in node.args]
    out = _val(node)
    if not all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in (*vals, out)) or not batch.first(node):
        return None
    first = [batch.first(a) and v.dim() == out.dim() for a, v in zip(node.args, vals)]
    if first.count(True) != 1:
        return None
    other = vals[first.index(False)]
    if other.dim() == out.dim() and not (isinstance(other.shape[0], int) and other.shape[0] == 1):
        return None
    return first.index(True)


def _name(target):
    return getattr(target, "__name__", str(target)).split(".")[0]


def report(unit, batch):
    """What the lowering of ``unit`` did: {"lowered": {op: count}, "torch": {op: count} (ops that compute,
    left to torch), "flops": {"lowered": n, "torch": n} (the example micro-batch's forward), "torch_flops":
    the share of the unit's FLOPs left to torch, "batch_dependent": [one line per op whose sums span a
    micro-batch]}."""
    lowered, left, reasons = {}, {}, []
    flops = {"lowered": 0, "torch": 0}
    trained = _trained(unit, batch)
    for node in unit.module.graph.nodes:
        if node.op != "call_function":
            continue
        original = node.meta.get("wse_lowered")
        name = _name(original or node.target)
        if original is not None:
            lowered[name] = lowered.get(name, 0) + 1
            flops["lowered"] += _lowered_flops(node)
            operand = node.args[1] if name == "embedding" else node.args[node.args[3]] if name in _BY_TARGET.values() \
                else node.args[0]
            if name != "scaled_dot_product_attention" and batch.has(operand) and not _followed(node):
                reasons.append(f"{unit.name}: {name} of a tensor whose samples it cannot tell apart")
            continue
        work = _flops(node.target, node)
        if name == "expand" and _spans_batch(node, trained, batch):  # its backward sums the copies
            reasons.append(f"{unit.name}: expand broadcasts a weight over the batch (left to torch)")
        if name in _FREE or not isinstance(_val(node), torch.Tensor):  # a view, or a size or tuple
            continue
        left[name] = left.get(name, 0) + 1
        flops["torch"] += work
        reason = "draws its random numbers for the whole micro-batch" if draws(node) else _spans_batch(node, trained, batch)
        if reason:
            reasons.append(f"{unit.name}: {name} {reason} (left to torch)")
    total = flops["lowered"] + flops["torch"]
    return {"lowered": lowered, "torch": left, "flops": flops, "torch_flops": flops["torch"] / total if total else 0.0,
            "batch_dependent": reasons}


def _followed(node):
    """Whether a lowered node's sums over samples are trees: it was told where its operand's samples are."""
    op, args = node.target, node.args
    if op is torch.ops.wse.product.default:
        return args[3] is not None
    if op in (torch.ops.wse.layer_norm.default, torch.ops.wse.cross_entropy.default):
        return args[4] is not None
    return args[-1] > 0  # embedding, conv2d, broadcast: the entries a sample has


def _trained(unit, batch):
    """The unit's nodes whose values depend on a weight it reads, or on a value an earlier unit handed
    on that is not per sample: what a gradient flows into."""
    kinds = dict(zip((n for n in unit.module.graph.nodes if n.op == "placeholder"), unit.inputs))
    out = set()
    for node in unit.module.graph.nodes:
        if node.op == "placeholder":
            kind = kinds[node][0]
            if kind == "param" or kind == "value" and not batch.first(node):
                out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _spans_batch(node, trained, batch):
    """Why ``node``, run by torch, sums over a micro-batch: it broadcasts a trained tensor over the
    batch (its backward sums over it) or reduces the batch away; None: neither."""
    out = _val(node)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    ins = [(a, _val(a)) for a in node.all_input_nodes]
    floats = [(a, v) for a, v in ins if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if batch.first(node) and any(a in trained and not batch.first(a) for a, v in floats):
        return "broadcasts a weight over the batch"
    if not batch.first(node) and any(batch.first(a) for a, _ in floats):
        return "sums over the batch"
    return None


def _flops(target, node):
    """Multiply-adds x 2 of a product (a weight's, attention's, a convolution's) from the node's
    shapes; an element operation per output element otherwise."""
    out = _val(node)
    if not isinstance(out, torch.Tensor):
        return 0
    numel = concrete(out.numel())
    if target in (aten.linear.default, aten.addmm.default, aten.mm.default, aten.bmm.default, aten.matmul.default):
        inner = _val(node.args[1] if target is aten.addmm.default else node.args[0])
        return 2 * numel * concrete(inner.shape[-1]) if isinstance(inner, torch.Tensor) else numel
    if target is aten.scaled_dot_product_attention.default:
        q, k = _val(node.args[0]), _val(node.args[1])
        return 4 * concrete(q.numel()) * concrete(k.shape[-2])
    if "conv" in _name(target):
        w = _val(node.args[1])
        return 2 * numel * math.prod(concrete(d) for d in w.shape[1:]) if isinstance(w, torch.Tensor) else numel
    return numel


def _lowered_flops(node):
    """``_flops`` of a lowered node: a product's and attention's from their operands' shapes."""
    out = _val(node)
    numel = concrete(out.numel()) if isinstance(out, torch.Tensor) else 0
    if node.target is torch.ops.wse.product.default:
        return 2 * numel * concrete(_val(node.args[0]).shape[-1])
    if node.target is torch.ops.wse.attention.default:
        return 4 * concrete(_val(node.args[0]).numel()) * concrete(_val(node.args[1]).shape[-2])
    if node.target is torch.ops.wse.conv2d.default:
        return 2 * numel * math.prod(concrete(d) for d in _val(node.args[1]).shape[1:])
    return numel


def concrete(n):
    """A size's value on the example: a symbolic one's hint (``int()`` of it would fix the symbol to it for
    every later reader of the graph's shapes)."""
    return int(n.node.hint) if isinstance(n, torch.SymInt) else int(n)
