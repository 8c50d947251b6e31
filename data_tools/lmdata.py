"""HDF5 dataset files: the layout (Model Zoo "LMData" and array datasets), writing and checking them.

LM files hold one int32 dataset ``data`` of shape ``[n_examples, 3, max_seq_length]`` (rows:
input_ids, loss mask, labels) with attribute ``n_examples``. Array files hold ``features``
(float32 ``[n, ...]``) and ``labels`` (int32 ``[n]``). Tensor files (a PyTorch script's batches,
``pyapi.cstorch``) hold columns ``t0``, ``t1``, ... of any numeric dtype, each ``[n, ...]``, listed
with their dtypes and shapes in ``data_params.json`` (``columns``). A directory of any has
``data_params.json`` beside the ``*.h5`` files: ours is flat (``n_examples``, ``vocab_size``,
``files`` with each file's count, ...); Model Zoo's is nested (``processing``, ``post-process``,
``setup``) and ``read_meta`` reads both as one flat dict. We write chunks of about
``CHUNK_BYTES`` (many examples each) with a Fletcher-32 checksum, so a damaged byte is caught
when read and named by its chunk's examples; files written by other tools in the same layout
(no checksum, other chunking) are read and checked all the same (docs/design/data.md "Reading").
"""
import contextlib
import json
from pathlib import Path

import h5py
import numpy as np

from data_tools import COMPRESSIONS, DEFAULT_COMPRESSION
from data_tools.errors import DataError

DATA_PARAMS = "data_params.json"
# HDF5 chunk and read block: h5py's advice is 10 KiB..1 MiB; see docs/design/data.md "Compression"
CHUNK_BYTES = 1 << 20
SLAB_BYTES = 8 << 20  # examples packed and written at once by preprocessing
CHECK_BLOCK = 512  # examples read at once when checking a file that is not chunked


def chunk_rows(example_shape, itemsize=4):
    """Examples per chunk (and per read block) for examples of this shape: about CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (int(np.prod(example_shape)) * itemsize))


def h5_files(data_dir):
    """Sorted ``*.h5`` files of a dataset directory; a clear error if there are none."""
    d = Path(data_dir)
    if not d.is_dir():
        # A params file's data_dir is read from wherever the command runs, not beside the file.
        here = "" if d.is_absolute() else f" (a relative path: looked for in the current directory, as {d.absolute()})"
        raise DataError(f"{d}: no such dataset directory{here}")
    files = sorted(d.glob("*.h5"))
    if not files:
        raise DataError(f"{d}: no .h5 files in this directory")
    return files


def read_data_params(data_dir):
    """The directory's ``data_params.json`` as a dict, or None if it has none."""
    path = Path(data_dir) / DATA_PARAMS
    if not path.exists():
        return None
    try:
        params = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(params, dict):
        raise DataError(f"{path}: expected a JSON object")
    return params


MODELZOO_SECTIONS = ("setup", "processing", "dataset", "post-process")


def read_meta(data_dir):
    """What a directory's data_params.json says, as one flat dict, whichever layout wrote it.

    Ours is flat already. Model Zoo's preprocessing nests it: ``processing`` holds
    ``max_seq_length``, ``vocab_size``, ``pad_id``, ``eos_id``, ``short_seq_prob`` and the
    tokenizer (``huggingface_tokenizer``, or ``tokenizer_params``), ``post-process`` the counts
    (older releases put ``vocab_size``/``pad_id``/``eos_id`` there too). Keys missing are absent.
    """
    raw = read_data_params(data_dir)
    if raw is None:
        return {}
    if not any(k in raw for k in MODELZOO_SECTIONS):
        meta = dict(raw)
        if "eot_id" in meta:
            meta.setdefault("eos_id", meta["eot_id"])
        return meta
    sections = {}
    for k in MODELZOO_SECTIONS:
        sections[k] = raw.get(k) or {}
        if not isinstance(sections[k], dict):
            raise DataError(f"{Path(data_dir) / DATA_PARAMS}: section '{k}' is not a JSON object")
    proc, post, dataset = sections["processing"], sections["post-process"], sections["dataset"]
    meta = {"format": "lm", "layout": "modelzoo"}
    for key in ("vocab_size", "pad_id", "eos_id", "max_seq_length", "short_seq_prob"):
        for section in (proc, post, dataset):
            if section.get(key) is not None:
                meta[key] = section[key]
                break
    if post.get("n_examples") is not None:
        meta["n_examples"] = post["n_examples"]
    tok_params = proc.get("tokenizer_params") or {}
    tokenizer = (proc.get("huggingface_tokenizer") or tok_params.get("pretrained_model_name_or_path")
                 or tok_params.get("encoder_file") or proc.get("tokenizer_type"))
    if tokenizer:
        meta["tokenizer"] = str(tokenizer)
    return meta


@contextlib.contextmanager
def open_h5(path, mode="r"):
    """h5py.File that turns low-level failures into one DataError naming the file."""
    try:
        f = h5py.File(path, mode)
    except OSError as exc:
        raise DataError(f"{path}: not a readable HDF5 file ({_reason(exc)})") from None
    with f:
        try:
            yield f
        except (RuntimeError, KeyError) as exc:  # h5py's errors for damaged metadata inside the file
            raise DataError(f"{path}: damaged HDF5 file ({_reason(exc)})") from None


def _reason(exc):
    """The first line of an h5py/HDF5 error, without the stack of HDF5 internals."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def h5_filters(compression):
    if compression not in COMPRESSIONS:
        raise DataError(f"--compression: expected one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    return {"compression": None if compression == "none" else compression, "fletcher32": True}


class LMFileWriter:
    """An LMData file written in slabs of examples, in order: ``writer.write(examples)`` until
    ``n_examples`` are written, then ``close()``. Slabs that are whole chunks are written once each."""

    def __init__(self, path, n_examples, seq_len, compression=DEFAULT_COMPRESSION):
        self.path, self.n, self.done = path, n_examples, 0
        self.file = h5py.File(path, "w")
        try:
            self.data = self.file.create_dataset("data", (n_examples, 3, seq_len), np.int32,
                                                 chunks=(max(1, min(n_examples, chunk_rows((3, seq_len)))), 3, seq_len),
                                                 **h5_filters(compression))
            self.file.attrs["n_examples"] = n_examples
        except BaseException:
            self.file.close()
            raise

    def write(self, examples):
        self.data[self.done:self.done + len(examples)] = examples
        self.done += len(examples)

    def close(self):
        self.file.close()
        if self.done != self.n:
            raise DataError(f"{self.path}: {self.done} of {self.n} examples written")

    def abort(self):
        """Close after a failure, without the count check (the failure is what gets reported)."""
        self.file.close()


def write_lm_file(path, examples, compression=DEFAULT_COMPRESSION):
    """Write ``examples`` (int32 ``[n, 3, S]``) as an LMData file."""
    w = LMFileWriter(path, len(examples), examples.shape[2], compression)
    try:
        w.write(examples.astype(np.int32, copy=False))
    except BaseException:
        w.abort()
        raise
    w.close()


def write_array_file(path, features, labels, compression=DEFAULT_COMPRESSION):
    """Write an array dataset file: float32 ``features`` and int32 ``labels``."""
    n = len(labels)
    with h5py.File(path, "w") as f:
        f.create_dataset("features", data=features.astype(np.float32, copy=False),
                         chunks=(max(1, min(n, chunk_rows(features.shape[1:]))), *features.shape[1:]),
                         **h5_filters(compression))
        f.create_dataset("labels", data=labels.astype(np.int32, copy=False), chunks=(min(n, 4096),),
                         **h5_filters(compression))
        f.attrs["n_examples"] = n


def write_tensors_file(path, columns, compression=DEFAULT_COMPRESSION):
    """Write a tensor dataset file: ``columns`` (arrays of one length) as ``t0``, ``t1``, ..."""
    n = len(columns[0])
    with h5py.File(path, "w") as f:
        for i, a in enumerate(columns):
            rows = max(1, min(n, chunk_rows(a.shape[1:], a.itemsize)))
            f.create_dataset(f"t{i}", data=a, chunks=(rows, *a.shape[1:]),
                             **h5_filters(compression))
        f.attrs["n_examples"] = n


def tensor_columns(meta):
    """[(name, dtype, example shape)] of a tensor dataset, from its data_params.json."""
    try:
        return [(f"t{i}", np.dtype(c["dtype"]), tuple(int(x) for x in c["shape"]))
                for i, c in enumerate(meta["columns"])]
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{DATA_PARAMS}: a tensor dataset's columns are not readable ({exc})") from None


def tensor_data(path, f, columns):
    """The datasets of an open tensor file, checked against the dataset's ``columns``."""
    out = []
    for name, dtype, shape in columns:
        d = _dataset(path, f, name)
        if d.dtype != dtype or tuple(d.shape[1:]) != shape:
            raise DataError(f"{path}: dataset '{name}' is {d.dtype} {list(d.shape[1:])} an example, expected "
                            f"{dtype} {list(shape)}")
        if out and d.shape[0] != out[0].shape[0]:
            raise DataError(f"{path}: dataset '{name}' has {d.shape[0]} examples, 't0' {out[0].shape[0]}")
        out.append(d)
    return out


def read_examples(path, dset, sel):
    """``dset[sel]``; a damaged file is named, with the examples that could not be read."""
    try:
        return dset[sel]
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: dataset '{dset.name.lstrip('/')}' unreadable at examples "
                        f"{sel.start}..{sel.stop - 1} ({_reason(exc)}): the file is damaged") from None


def _dataset(path, f, key):
    if key not in f:
        raise DataError(f"{path}: no dataset '{key}' (found: {', '.join(f.keys()) or 'nothing'})")
    d = f[key]
    if not isinstance(d, h5py.Dataset):
        raise DataError(f"{path}: '{key}' is a group, expected a dataset")
    return d


def lm_data(path, f, seq_len=None):
    """The ``data`` dataset of an open LM file, its layout checked (metadata only, nothing read)."""
    d = _dataset(path, f, "data")
    if d.dtype != np.int32:
        raise DataError(f"{path}: dataset 'data' has dtype {d.dtype}, expected int32")
    if d.ndim != 3 or d.shape[1] != 3:
        raise DataError(f"{path}: dataset 'data' has shape {d.shape}, expected [n_examples, 3, max_seq_length]")
    if seq_len is not None and d.shape[2] != seq_len:
        raise DataError(f"{path}: dataset 'data' has max_seq_length {d.shape[2]}, expected {seq_len}")
    return d


def array_data(path, f):
    """The ``features`` and ``labels`` datasets of an open array file, their layout checked."""
    x, y = _dataset(path, f, "features"), _dataset(path, f, "labels")
    if y.dtype != np.int32 or y.ndim != 1:
        raise DataError(f"{path}: dataset 'labels' is {y.dtype} {y.shape}, expected int32 [n]")
    if x.dtype.kind not in "fiu" or x.ndim < 2:
        raise DataError(f"{path}: dataset 'features' is {x.dtype} {x.shape}, expected numbers [n, ...]")
    if x.shape[0] != y.shape[0]:
        raise DataError(f"{path}: dataset 'features' has {x.shape[0]} examples, 'labels' {y.shape[0]}")
    return x, y


def _blocks(d):
    """Read blocks of a dataset for checking: whole chunks, several at a time."""
    n, rows = d.shape[0], (d.chunks[0] if d.chunks else 1)
    step = rows * max(1, CHECK_BLOCK // rows)
    return [(lo, min(lo + step, n), rows) for lo in range(0, n, step)]


def _read_checked(path, d, lo, hi, rows):
    """Examples [lo, hi); if they cannot be read, the error names the examples of the damaged chunk."""
    try:
        return d[lo:hi]
    except (OSError, ValueError):
        for c in range(lo, hi, rows):  # one chunk at a time, to name the one that is bad
            read_examples(path, d, slice(c, min(c + rows, hi)))
        return read_examples(path, d, slice(lo, hi))


def check_lm_file(path, *, vocab_size=None, seq_len=None):
    """Check one LM file entirely; return its number of examples or raise a DataError naming the first fault.

    Ids must lie in the vocabulary; where the loss counts a position whose next position is also
    a real input, the label must be that next input. A sequence's last label (before padding,
    whatever the pad id, as in Model Zoo's files with ``pad_id != eos_id`` or short sequences) is
    the token the inputs no longer hold, and is not compared.
    """
    with open_h5(path) as f:
        d = lm_data(path, f, seq_len)
        n = d.shape[0]
        if "n_examples" in f.attrs and int(f.attrs["n_examples"]) != n:
            raise DataError(f"{path}: attribute n_examples is {int(f.attrs['n_examples'])} but dataset "
                            f"'data' has {n} examples")
        for lo, hi, rows in _blocks(d):
            block = _read_checked(path, d, lo, hi, rows)
            ids, mask, labels = block[:, 0], block[:, 1], block[:, 2]
            bad = ids < 0
            if vocab_size is not None:
                bad |= (ids >= vocab_size) | ((mask != 0) & ((labels < 0) | (labels >= vocab_size)))
            rows_bad = np.flatnonzero(bad.any(axis=1))
            if rows_bad.size:
                e = int(rows_bad[0])
                j = int(np.flatnonzero(bad[e])[0])
                in_ids = ids[e, j] < 0 or (vocab_size is not None and ids[e, j] >= vocab_size)
                what, tok = ("token id", ids[e, j]) if in_ids else ("label", labels[e, j])
                raise DataError(f"{path}: dataset 'data' example {lo + e}: {what} {int(tok)} at position {j} "
                                f"outside the vocabulary [0, {vocab_size})")
            live = (mask[:, :-1] != 0) & (mask[:, 1:] != 0)
            shifted = live & (labels[:, :-1] != ids[:, 1:])
            rows_bad = np.flatnonzero(shifted.any(axis=1))
            if rows_bad.size:
                e = int(rows_bad[0])
                j = int(np.flatnonzero(shifted[e])[0])
                raise DataError(f"{path}: dataset 'data' example {lo + e}: label at position {j} is "
                                f"{int(labels[e, j])} but the next input is {int(ids[e, j + 1])}")
        return n


def check_array_file(path, *, num_classes=None):
    """Check one array-dataset file; return its number of examples."""
    with open_h5(path) as f:
        x, y = array_data(path, f)
        n = y.shape[0]
        if "n_examples" in f.attrs and int(f.attrs["n_examples"]) != n:
            raise DataError(f"{path}: attribute n_examples is {int(f.attrs['n_examples'])}, datasets have {n}")
        labels = read_examples(path, y, slice(0, n))
        for lo, hi, rows in _blocks(x):
            _read_checked(path, x, lo, hi, rows)
        if num_classes is not None and n and (labels.min() < 0 or labels.max() >= num_classes):
            e = int(np.flatnonzero((labels < 0) | (labels >= num_classes))[0])
            raise DataError(f"{path}: dataset 'labels' example {e}: label {int(labels[e])} outside [0, {num_classes})")
        return n


def check_tensors_file(path, columns):
    """Check one tensor-dataset file entirely; return its number of examples."""
    with open_h5(path) as f:
        ds = tensor_data(path, f, columns)
        for d in ds:
            for lo, hi, rows in _blocks(d):
                _read_checked(path, d, lo, hi, rows)
        return ds[0].shape[0]


def dataset_format(data_dir):
    """"lm", "arrays" or "tensors", from data_params.json or, for other tools' files, from the first file."""
    params = read_meta(data_dir)
    if "format" in params:
        return params["format"]
    with open_h5(h5_files(data_dir)[0]) as f:
        return "arrays" if "features" in f else "lm"


def verify_dataset(data_dir):
    """Check every file of a dataset directory; return a summary dict, or raise DataError at the first fault."""
    files = h5_files(data_dir)
    params = read_meta(data_dir)
    fmt = dataset_format(data_dir)
    counts = []
    for path in files:
        if fmt == "tensors":
            counts.append(check_tensors_file(path, tensor_columns(params)))
        elif fmt == "arrays":
            counts.append(check_array_file(path, num_classes=params.get("num_classes")))
        else:
            counts.append(check_lm_file(path, vocab_size=params.get("vocab_size"),
                                        seq_len=params.get("max_seq_length")))
    total = sum(counts)
    if "n_examples" in params and params["n_examples"] != total:
        raise DataError(f"{Path(data_dir) / DATA_PARAMS}: n_examples is {params['n_examples']} but the "
                        f"files hold {total}")
    return {"format": fmt, "files": len(files), "n_examples": total}
