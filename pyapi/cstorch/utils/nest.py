"""``cstorch.utils.nest``: visiting and mapping the leaves of nested lists, tuples and dicts (a
batch, a state dict), each with its scope: the keys and indices (as text) that lead to it."""
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from pyapi.cstorch.errors import refusing


def visit_structure(data_structure, select_fn, strict=False, scope=None):
    """Yield (scope, leaf) for every leaf ``select_fn`` accepts, depth first, dict keys and sequence
    indices (as text) making the scope. ``strict``: a container of another type is an error."""
    scope = list(scope or [])
    if isinstance(data_structure, dict):
        items = ((str(k), v) for k, v in data_structure.items())
    elif isinstance(data_structure, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(data_structure))
    else:
        if select_fn(data_structure):
            yield scope, data_structure
        elif strict and hasattr(data_structure, "__iter__") and not isinstance(data_structure, (str, bytes)):
            raise ValueError(f"visit_structure: {'.'.join(scope) or 'the structure'} is a "
                             f"{type(data_structure).__name__}, not a dict, list or tuple")
        return
    for key, value in items:
        yield from visit_structure(value, select_fn, strict, scope + [key])


def visit_torch_tensors(data_structure, strict=False, scope=None):
    """``visit_structure`` of the tensors."""
    yield from visit_structure(data_structure, lambda x: isinstance(x, torch.Tensor), strict, scope)


def map_structure(map_fn, data_structure, select_fn, scope=None):
    """The structure with each leaf ``select_fn`` accepts replaced by ``map_fn(scope, leaf)``."""
    leaves, spec = tree_flatten(data_structure)
    scopes = recurse_spec(spec, scope)
    return tree_unflatten([map_fn(s, x) if select_fn(x) else x for s, x in zip(scopes, leaves)], spec)


def map_torch_tensors(map_fn, data_structure, scope=None):
    """``map_structure`` of the tensors."""
    return map_structure(map_fn, data_structure, lambda x: isinstance(x, torch.Tensor), scope)


def recurse_spec(spec, scope=None):
    """The scope of every leaf of a ``torch.utils._pytree`` TreeSpec, in order."""
    scope = list(scope or [])
    if spec.is_leaf():
        yield scope
        return
    keys = spec.context if isinstance(spec.context, (list, tuple)) and spec.type is dict else \
        range(spec.num_children)
    for key, child in zip(keys, spec.children_specs):
        yield from recurse_spec(child, scope + [str(key)])


__getattr__ = refusing("cstorch.utils.nest", "built: visit_structure, visit_torch_tensors, map_structure, "
                      "map_torch_tensors, recurse_spec")
