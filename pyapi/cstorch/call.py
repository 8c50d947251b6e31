"""How a traced step's call is made of its step's batch (``Call``), and the module whose forward is the
step, which the compiler exports (``traced_module``)."""
import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from pyapi.cstorch.errors import not_built
from pyapi.cstorch.step import handed, recording


def traced_module(fn, model, call):
    """The module whose forward is the user's traced step on the batch's tensors it reads (``call``:
    ``Call``), returning (its loss, the tensors it hands to Python) (its class made here: torch is
    imported late)."""
    class TracedStep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model  # its parameters become the graph's ("model.<name>")

        def forward(self, *inputs):
            args, kwargs = call.arguments(inputs)
            out = fn(*args, **kwargs)
            rec = recording()
            values = ([] if rec.loss is None else [rec.loss]) + handed(rec, out)
            if not values:
                raise not_built(f"{fn.__name__}: a traced step that returns no tensor and calls no backward()",
                                "a step that trains a loss or returns the values it computes")
            return tuple(values)

    return TracedStep()


class Call:
    """How a traced step's arguments are made of its step's batch: each tensor among them one of the
    batch's tensors (``slots``: its index among ``Batch.leaves``), every other value a constant of
    the graph; ``inputs``: the indices the graph takes, in order."""

    def __init__(self, name, args, kwargs, batch):
        pairs, self.spec = tree_flatten_with_path((args, kwargs))
        self.name, self.slots, self.constants = name, [], []
        by_id = {id(t): i for i, t in enumerate(batch.leaves)}
        for path, leaf in pairs:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in by_id:
                    raise not_built(f"{name}: its argument {_argument(keystr(path))} is a tensor made outside the "
                                    "step, not one of the executor's batch", "the batch's tensors as the loop gets "
                                    "them: transform them inside the traced step (or in the loader)")
                self.slots.append(by_id[id(leaf)])
            else:
                self.slots.append(None)
                self.constants.append(leaf)
        self.inputs = sorted({k for k in self.slots if k is not None})

    def graph_inputs(self, batch):
        """The tensors of ``batch`` the graph takes, as it takes them: int32 widened to int64 (a CS-2
        takes int32 class targets and token ids, which torch's CPU losses refuse; the values are the
        same)."""
        return [t.to(torch.int64) if t.dtype == torch.int32 else t for t in (batch.leaves[k] for k in self.inputs)]

    def arguments(self, inputs):
        """(args, kwargs) of the step with the graph's ``inputs`` in their places."""
        of = dict(zip(self.inputs, inputs))
        constants = iter(self.constants)
        return tree_unflatten([of[k] if k is not None else next(constants) for k in self.slots], self.spec)

    def same_values(self, other):
        """Whether this call's Python values are ``other``'s (numbers and strings equal, others the same
        objects)."""
        return len(self.constants) == len(other.constants) and all(
            a is b or (type(a) is type(b) and isinstance(a, (bool, int, float, str)) and a == b)
            for a, b in zip(self.constants, other.constants))

    def check(self, args, kwargs, batch, step):
        """This step's call, of the same arguments as step 1's: the batch's tensors in the same places.
        Its Python values may differ (a step count given to the step): the graph holds step 1's, so
        a step given other values is checked (``Run._check_same_graph``: its ops and the numbers
        they take), and its closures see this step's."""
        other = Call(self.name, args, kwargs, batch)
        if other.spec != self.spec or other.slots != self.slots:
            raise not_built(f"{self.name}: called at step {step} with other arguments than at step 1",
                            "the same arguments on every step (the batch's tensors in the same places)")
        return other


def _argument(path):
    """``args[0]['input_ids']`` for a key path ``[0][0]['input_ids']`` of (args, kwargs)."""
    if path.startswith("[0]"):
        rest = path[3:]
        return "args" + rest if rest else "args"
    return "kwargs" + path[3:]
