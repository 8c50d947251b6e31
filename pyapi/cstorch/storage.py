"""``cstorch.save`` and ``cstorch.load``: a state (nested dicts of tensors and plain values) in one
HDF5 file, a group per dict and a dataset per tensor (``/model/net.1.weight``: a state dict's own
names keep their dots), every other value JSON in the file's attributes with its key path; ``load``
also reads a checkpoint the cluster wrote.

A file is checked as the cluster's checkpoints are (``data_tools.checkpoint``, one scheme): its
attribute ``tensors`` records each tensor's shape, dtype and SHA-256, and ``metadata_sha256`` those
attributes and the plain values, so ``load`` refuses a flipped bit in a weight or an optimizer moment,
a changed value or key, and a truncation, in one line naming the file (and the tensor). Files of the
first format (``cstorch-state-1``, written before the checksums) still load, said to be unchecked.
"""
import json
import sys
from pathlib import Path

import h5py
import numpy as np
import torch

from data_tools.checkpoint import Checkpoint, intact, metadata_sha256, tensor_entry
from data_tools.errors import CheckpointError
from data_tools.files import replacing
from wse_core.errors import DataError

FORMAT = "cstorch-state-2"
#: Written before every tensor had its SHA-256: loaded unchecked, and said so.
UNCHECKED_FORMAT = "cstorch-state-1"
#: What every HDF5 file begins with (cstorch.save's files have no user block before it).
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def save(state, path):
    """Write ``state`` (a dict) to ``path``, as ``torch.save`` would, in HDF5."""
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
    attrs = {"format": FORMAT, "values": text,
             "tensors": json.dumps({key: tensor_entry(a) for key, a in tensors.items()})}
    attrs["metadata_sha256"] = metadata_sha256(attrs)
    with replacing(path) as tmp, h5py.File(tmp, "w") as f:  # a reader (an eval script) never sees half a file
        f.attrs.update(attrs)
        for key, a in tensors.items():
            f.create_dataset(key, data=a)


def load(path, map_location=None, **kwargs):
    """The state ``save`` wrote, or ``{"model": weights, "optimizer": state, "global_step": n}`` of a
    checkpoint of the cluster (a ``checkpoint_<step>`` directory, or a run's model_dir: its latest),
    or what ``torch.load`` reads of a file that is not HDF5 (``kwargs`` are its)."""
    p = Path(path)
    if p.is_dir():
        ckpt = Checkpoint(p)
        weights, opt_state = ckpt.load()
        # a compiled model's parameters are named as its module's, under "model." (the traced step's)
        return {"model": {n.removeprefix("model."): torch.from_numpy(w) for n, w in weights.items()},
                "optimizer": {n: {s: torch.from_numpy(np.asarray(v)) for s, v in st.items()}
                              for n, st in opt_state.items()},
                "global_step": ckpt.step}
    try:
        with open(p, "rb") as f:
            start = f.read(len(HDF5_SIGNATURE))
    except OSError as exc:
        raise DataError(f"cstorch.load: {p}: cannot read ({exc.strerror})") from None
    # A file cut inside the signature (or empty) is a truncated HDF5 file, not a torch one.
    if not HDF5_SIGNATURE.startswith(start):  # a torch.save'd file, as Cerebras' load reads them
        try:
            return torch.load(p, map_location=map_location, **kwargs)
        except Exception as exc:  # the unpickler's many errors: one line naming the file
            raise DataError(f"cstorch.load: {p}: neither a state cstorch.save wrote nor a torch.save file "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    try:
        with h5py.File(p, "r") as f:
            arrays, values = _read(p, f)
    except CheckpointError:
        raise
    except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:  # HDF5's many errors: one line
        raise CheckpointError(f"cstorch.load: {p}: not a readable HDF5 file ({_first_line(exc)}): truncated or "
                              "damaged") from None
    leaves = [(key.split("/"), torch.from_numpy(np.asarray(a))) for key, a in arrays.items()] + values
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


def _read(p, f):
    """({key: array}, [[key path, plain value], ...]) of an open state file; a file of FORMAT checked against
    the table its intact metadata holds (CheckpointError naming the file, and the tensor at fault)."""
    fmt = f.attrs.get("format")
    if fmt == UNCHECKED_FORMAT:
        print(f"cstorch.load: {p}: unchecked (written before cstorch.save recorded checksums; save it again "
              "to have it checked)", file=sys.stderr)
        return {key: f[key][()] for key in _datasets(f)}, json.loads(f.attrs["values"])
    if fmt != FORMAT:
        raise CheckpointError(f"cstorch.load: {p}: not a state cstorch.save wrote")
    attrs = dict(f.attrs)
    try:
        table = json.loads(attrs["tensors"]) if attrs.get("metadata_sha256") == metadata_sha256(attrs) else None
    except (KeyError, ValueError, TypeError):
        table = None
    if not isinstance(table, dict):
        raise CheckpointError(f"cstorch.load: {p}: damaged: its metadata (the tensors' table, the other values) "
                              "does not match its metadata_sha256")
    unlisted = sorted(set(_datasets(f)) - set(table))
    if unlisted:
        raise CheckpointError(f"cstorch.load: {p}: damaged: tensor {unlisted[0]} is not in its table")
    arrays = {}
    for key, entry in table.items():
        try:
            a = f[key][()]
        except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"cstorch.load: {p}: tensor {key} unreadable ({_first_line(exc)}): truncated or "
                                  "damaged") from None
        if not intact(a, entry):
            raise CheckpointError(f"cstorch.load: {p}: tensor {key} is damaged (SHA-256, shape or dtype differs "
                                  "from what cstorch.save recorded)")
        arrays[key] = a
    return arrays, json.loads(attrs["values"])


def _first_line(exc):
    """An HDF5 error's first line (a KeyError's message without the quotes its str adds)."""
    text = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
    return text.splitlines()[0] if text else type(exc).__name__


def _datasets(f):
    """The paths of every dataset in an open HDF5 file."""
    found = []
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
    return found
