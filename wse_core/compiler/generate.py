"""Generation from a compiled PyTorch language model (docs/design/inference.md "A compiled
model"): ``Recompute(model, params)`` is a runner of ``wse_core.nn.generate.Engine`` for a
``TorchModel`` of token ids.

The captured graph is the user's step, which ends in the loss, and its shapes are fixed but for
the batch: it has no KV cache to grow. So each forward pass runs the step's units on the
sequence's tokens alone (a batch of one), padded to the captured length, and reads the logits at
its last token from the tail unit cut before the loss (``logits_unit``: the loss's input, followed
back through reshapes, slices and copies to the op that made it; it must be [batch, T, V]). This is
right for a causal model only (a position's logits must not depend on the padding after it), so a
model whose logits do is refused in one line when the runner is made. Every token costs a forward
pass of the captured length: no KV cache, which is the price of running the user's graph as it
was captured.
"""
import copy
import operator
from dataclasses import replace

import numpy as np
import torch

from wse_core.compiler import runner as unit_runner
from wse_core.compiler.model import one_thread
from wse_core.errors import ConfigError

#: Ops between the logits and the loss that only reshape, slice or copy them (the logits are what
#: the first other op makes: the head's product, or a log-softmax, whose sampling is the same).
PASS_THROUGH = ("view", "reshape", "slice", "contiguous", "clone", "_to_copy", "to.", "alias", "detach", "flatten",
                "squeeze", "select")


def logits_unit(unit):
    """``unit`` (the tail) returning the value its loss reads the logits from (see ``PASS_THROUGH``)."""
    module = copy.deepcopy(unit.module)
    graph = module.graph
    out = next(n for n in graph.nodes if n.op == "output")
    node = out.args[0][0]
    if node.target is operator.getitem:  # a lowered loss's value (lower.py): the op is its first argument
        node = node.args[0]
    node = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
    while node is not None and node.op == "call_function" and any(k in str(node.target) for k in PASS_THROUGH):
        node = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
    if node is None:  # a placeholder is fine: the logits came from the unit before the tail
        raise ConfigError("the compiled model's loss reads no logits: generating needs a language model whose step "
                          "is loss(model(ids), labels)")
    graph.output((node,))
    graph.erase_node(out)
    graph.eliminate_dead_code()
    module.recompile()
    return replace(unit, module=module, outputs=("logits",), loss=None)


class Recompute:
    """A runner of the Engine (``wse_core.nn.generate.Local``'s interface) for a compiled language
    model: each sequence's tokens so far, run whole for every new token (see the module's docstring)."""

    def __init__(self, model, params):
        if not model.is_lm:
            raise ConfigError("generating from a compiled model needs one of token ids (an lm dataset's layout)")
        self.model = model
        (_, x_shape), _ = model.program["inputs"]
        self.capacity = int(x_shape[0])
        self.tail = logits_unit(model.torch_units[-1])
        self.weights = model.compute_weights(params)
        self.tokens, self._next = {}, 0
        self.vocab_size = None
        a = self._logits([1, 2, 3], pad=0)  # sets vocab_size from the logits' shape
        b = self._logits([1, 2, 3], pad=self.vocab_size - 1)
        if not np.array_equal(a, b):
            raise ConfigError("the compiled model is not causal: the logits at a position change with the tokens "
                              "after it, so it cannot generate")

    def fresh(self):
        """A runner of the same model, tail and weights with no sequences (checked once, when made)."""
        other = copy.copy(self)
        other.tokens, other._next = {}, 0
        return other

    def add(self):
        i, self._next = self._next, self._next + 1
        self.tokens[i] = []
        return i

    def remove(self, i):
        del self.tokens[i]

    def forward(self, ids, active):
        out = np.empty((len(active), self.vocab_size), np.float32)
        for row, i in enumerate(active):
            self.tokens[i].extend(int(t) for t in ids[row])
            out[row] = self._logits(self.tokens[i])
        return out

    def _logits(self, tokens, pad=0):
        """The logits after the last of ``tokens``: the step's units on them alone, padded with ``pad``."""
        model, n = self.model, len(tokens)
        if n > self.capacity:
            raise ConfigError(f"{n} positions exceed the compiled model's {self.capacity}")
        ids = np.full((1, 3, self.capacity), pad, np.int32)
        ids[0, 0, :n] = tokens
        x = model.first_input(model.batch_of([ids]), np.float32)
        with torch.no_grad(), one_thread():
            last = len(model.torch_units) - 1
            for u in range(last):
                x, _ = model.unit_forward(u, x, self.weights)
            weights = {p: torch.from_numpy(self.weights[p]) for p in self.tail.params}
            (logits,), _ = unit_runner.unit_forward(self.tail, weights, x, x["input"], None)
        if logits.dim() != 3 or logits.shape[:2] != (1, self.capacity) or \
                self.vocab_size not in (None, logits.shape[2]):
            raise ConfigError(f"the compiled model's loss reads values of shape {list(logits.shape)}, not logits "
                              f"[batch, {self.capacity}, vocab]: generating needs a language model whose step is "
                              "loss(model(ids), labels)")
        self.vocab_size = int(logits.shape[2])
        return logits[0, n - 1].to(torch.float32).numpy().copy()
