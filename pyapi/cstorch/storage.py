"""``cstorch.save`` and ``cstorch.load``: a state (nested dicts of tensors and plain values) in one
HDF5 file, a group per dict and a dataset per tensor (``/model/net.1.weight``: a state dict's own
names keep their dots), every other value JSON in the file's attributes with its key path; ``load``
also reads a checkpoint the cluster wrote."""
import json
from pathlib import Path

import h5py
import numpy as np

from data_tools.files import replacing

FORMAT = "cstorch-state-1"


def save(state, path):
    """Write ``state`` (a dict) to ``path``, as ``torch.save`` would, in HDF5."""
    import torch

    tensors, rest = {}, []

    def walk(path, value):
        if isinstance(value, torch.Tensor):
            tensors["/".join(k.replace("/", "|") for k in path)] = value.detach().cpu().numpy()
        elif isinstance(value, dict) and value:
            for k, v in value.items():
                walk((*path, str(k)), v)
        else:
            rest.append([list(path), value])

    if not isinstance(state, dict):
        raise TypeError(f"cstorch.save: expected a dict of state, got {type(state).__name__}")
    walk((), state)
    try:
        text = json.dumps(rest)
    except TypeError as exc:
        raise TypeError(f"cstorch.save: {exc} (a value that is neither a tensor nor JSON)") from None
    with replacing(path) as tmp, h5py.File(tmp, "w") as f:  # a reader (an eval script) never sees half a file
        f.attrs["format"], f.attrs["values"] = FORMAT, text
        for key, a in tensors.items():
            f.create_dataset(key, data=a)


def load(path, map_location=None, **kwargs):
    """The state ``save`` wrote, or ``{"model": weights, "optimizer": state, "global_step": n}`` of a
    checkpoint of the cluster (a ``checkpoint_<step>`` directory, or a run's model_dir: its latest),
    or what ``torch.load`` reads of a file that is not HDF5 (``kwargs`` are its)."""
    import torch

    p = Path(path)
    if p.is_dir():
        from data_tools.checkpoint import Checkpoint

        ckpt = Checkpoint(p)
        weights, opt_state = ckpt.load()
        # a compiled model's parameters are named as its module's, under "model." (the traced step's)
        return {"model": {n.removeprefix("model."): torch.from_numpy(w) for n, w in weights.items()},
                "optimizer": {n: {s: torch.from_numpy(np.asarray(v)) for s, v in st.items()}
                              for n, st in opt_state.items()},
                "global_step": ckpt.step}
    if p.is_file() and not h5py.is_hdf5(p):  # a torch.save'd file, as Cerebras' load reads them
        try:
            return torch.load(p, map_location=map_location, **kwargs)
        except Exception as exc:  # the unpickler's many errors: one line naming the file
            raise ValueError(f"cstorch.load: {p}: neither a state cstorch.save wrote nor a torch.save file "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    try:
        f = h5py.File(p, "r")
    except OSError as exc:
        raise ValueError(f"cstorch.load: {p}: not a readable state file ({str(exc).splitlines()[0]})") from None
    with f:
        if f.attrs.get("format") != FORMAT:
            raise ValueError(f"cstorch.load: {p}: not a state cstorch.save wrote")
        leaves = []
        f.visititems(lambda name, obj: leaves.append((name.split("/"), torch.from_numpy(np.asarray(obj[()]))))
                     if isinstance(obj, h5py.Dataset) else None)
        leaves += json.loads(f.attrs["values"])
    out = {}
    for path, value in leaves:
        if not path:  # an empty state
            continue
        *head, last = [k.replace("|", "/") for k in path]
        node = out
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return out
