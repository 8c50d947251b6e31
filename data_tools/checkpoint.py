"""The sharded checkpoint store: one HDF5 shard per MemoryX rank, an index, and an atomic commit.

Layout of ``model_dir/checkpoint_<step>/``:
  ``memoryx_<k>.h5``  datasets ``/model/<param>`` and ``/optimizer/<param>/<state>``
  ``index.h5``        attributes ``format_version``, ``step``, ``num_shards``, ``params_yaml``,
                      ``loader_state`` and ``rng_state`` (JSON), ``tensors`` (JSON: shard, shape,
                      dtype and SHA-256 of every tensor), ``shard_sha256`` (JSON), and
                      ``metadata_sha256``: the SHA-256 of all of these, so the index protects itself;
                      and HDF5 external links ``/model/<param>`` -> shard, so one file shows every tensor.
``model_dir/latest`` holds the name of the newest complete checkpoint and is written last; a run that
finds it missing or unreadable beside checkpoints resumes from the newest complete one and writes it
again (``recover_latest``), never starting afresh over them.

Writing is crash-safe: shards and index go to ``.checkpoint_<step>.partial/``, every file is
fsynced, the directory is renamed into place, and only then ``latest`` is replaced (write, fsync,
rename). A writer killed at any point leaves the previous ``latest`` intact and loadable; a re-save
of an existing step killed between its two renames leaves the committed copy in
``.checkpoint_<step>.old``, which readers fall back to and ``clean_up`` puts back. A write that
fails (a full disk) raises CheckpointError naming the file and removes what it wrote.

Verifying and loading share one check, so they give the same verdict and name the damaged file:
the index's metadata against ``metadata_sha256`` and its links against the tensor table, then each
shard touched against its file SHA-256 (naming the damaged tensor where one is), then each tensor
read against its own. Loading can reshard: any subset of parameters loads from whichever shards
hold them, so a checkpoint written by 2 MemoryX ranks loads into 1 or 3. See docs/design/checkpoints.md "Checkpoints".
"""
import hashlib
import io
import json
import os
import re
import shutil
from pathlib import Path

import h5py
import numpy as np

from data_tools.errors import CheckpointError

#: 2 added ``metadata_sha256``; format 1 checkpoints still load, without that check of the index.
FORMAT_VERSION = 2
INDEX = "index.h5"
LATEST = "latest"


def shard_name(k):
    return f"memoryx_{k}.h5"


# The tensor keys' grammar, spelled only here: ``model/<param>``, ``optimizer/<param>/<state>`` and
# ``sparse/<param>/<part>`` (part: indptr, indices, shape). A state's or part's name holds no ``/``.
MODEL, OPTIMIZER, SPARSE = "model", "optimizer", "sparse"
SPARSE_PARTS = ("indptr", "indices", "shape")


def model_key(name):
    """The key of parameter ``name``'s values."""
    return f"{MODEL}/{name}"


def state_key(name, state):
    """The key of optimizer state ``state`` (e.g. ``exp_avg``) of parameter ``name``."""
    return f"{OPTIMIZER}/{name}/{state}"


def sparse_key(name, part):
    """The key of one part (one of SPARSE_PARTS) of sparse weight ``name``'s CSR pattern."""
    return f"{SPARSE}/{name}/{part}"


def parse_key(key):
    """A tensor key -> (kind, name, part): kind MODEL, OPTIMIZER or SPARSE; part the state or the
    sparse part (None for MODEL). None for a key of none of these forms."""
    kind, _, rest = key.partition("/")
    if kind == MODEL and rest:
        return kind, rest, None
    name, _, part = rest.rpartition("/")
    if kind in (OPTIMIZER, SPARSE) and name and part:
        return kind, name, part
    return None


def _sha256(a):
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8)).hexdigest()


def tensor_entry(a):
    """What a table records of a tensor so that a reader can tell it is the one written: its shape,
    dtype and the SHA-256 of its bytes (a checkpoint's index, a ``cstorch.save`` file)."""
    a = np.asarray(a)
    return {"shape": list(a.shape), "dtype": str(a.dtype), "sha256": _sha256(a)}


def intact(a, entry):
    """Whether tensor ``a``, as read, is the one ``entry`` (``tensor_entry``'s) was made of."""
    return list(a.shape) == entry["shape"] and str(a.dtype) == entry["dtype"] and _sha256(a) == entry["sha256"]


def _file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def metadata_sha256(attrs):
    """SHA-256 of a file's metadata (every attribute but ``metadata_sha256`` itself), in one canonical form:
    what an index (or a ``cstorch.save`` file) stores to protect its own metadata."""
    canonical = {k: (v if isinstance(v, str) else int(v)) for k, v in attrs.items() if k != "metadata_sha256"}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_failed(path, exc, model_dir):
    """The CheckpointError for a write that failed (a full disk, a quota): the file, the reason, and
    that the checkpoint ``latest`` names is untouched."""
    reason = os.strerror(exc.errno) if getattr(exc, "errno", None) else str(exc).splitlines()[0]
    name, _ = _latest(model_dir)
    kept = f"{name} is intact" if name else "no earlier checkpoint"
    return CheckpointError(f"{path}: {reason} while writing a checkpoint; it was not saved ({kept})")


_CHECKPOINT_NAME = re.compile(r"checkpoint_(\d+)")


def _latest(model_dir):
    """(name, None): the checkpoint ``model_dir/latest`` names; (None, why) when it is missing or unreadable
    (then a run recovers it: ``recover_latest``)."""
    path = Path(model_dir) / LATEST
    if not path.exists():
        return None, "missing"
    if not path.is_file():
        return None, "unreadable (not a file)"
    try:
        with open(path, "rb") as f:
            text = f.read(256).decode()  # a checkpoint's name and a newline; more is not one
    except OSError as exc:
        return None, f"unreadable ({exc.strerror})"
    except UnicodeDecodeError:
        return None, "unreadable (not UTF-8 text)"
    name = text.strip()
    if not _CHECKPOINT_NAME.fullmatch(name):
        return None, f"unreadable (it holds {name[:40]!r}, not a checkpoint's name)"
    return name, None


def _write_latest(model_dir, name):
    """Point ``model_dir/latest`` at checkpoint ``name``: written beside it, fsynced, renamed over it, so a
    reader finds the old name or the new one."""
    model_dir = Path(model_dir)
    tmp = model_dir / (LATEST + ".tmp")
    try:
        tmp.write_text(name + "\n")
        _fsync_path(tmp)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _write_failed(tmp, exc, model_dir) from None
    os.replace(tmp, model_dir / LATEST)
    _fsync_path(model_dir)


def checkpoint_dirs(model_dir):
    """The ``checkpoint_<step>`` directories in ``model_dir``, the newest step first."""
    found = [(int(m.group(1)), d) for d in Path(model_dir).glob("checkpoint_*")
             if (m := _CHECKPOINT_NAME.fullmatch(d.name)) and d.is_dir()]
    return [d for _, d in sorted(found, reverse=True)]


def newest_complete(model_dir, why):
    """(the newest checkpoint in ``model_dir`` that verifies whole, what each newer one lacks), for a
    ``latest`` that is ``why`` (missing, unreadable); CheckpointError in one line when none is complete."""
    skipped = []
    dirs = checkpoint_dirs(model_dir)
    for d in dirs:
        try:
            ckpt = Checkpoint(d)
            ckpt.verify()
            return ckpt, skipped
        except CheckpointError as exc:
            skipped.append(str(exc))
    if not dirs:
        raise CheckpointError(f"{model_dir}: {LATEST} is {why} and there is no checkpoint_<step> to resume from; "
                              f"remove {LATEST} to start afresh")
    raise CheckpointError(f"{model_dir}: {LATEST} is {why} and no checkpoint in it is complete (the newest: "
                          f"{skipped[0]}); move them away to start afresh, or give one to resume from")


def recover_latest(model_dir):
    """Where a run in ``model_dir`` starts: (model_dir, None) when ``latest`` names a checkpoint; (None, None)
    when there is neither ``latest`` nor a checkpoint (a first run); when ``latest`` is missing or
    unreadable beside checkpoints (a copy that left it out, a damaged disk), (the newest complete one, the
    line that says so), with ``latest`` written again to name it: a run never starts afresh over
    checkpoints it did not make. Only the job that holds ``model_dir``'s lock calls this (as ``clean_up``)."""
    name, why = _latest(model_dir)
    if name is not None:
        return Path(model_dir), None
    if why == "missing" and not checkpoint_dirs(model_dir):
        return None, None
    ckpt, skipped = newest_complete(model_dir, why)
    _write_latest(model_dir, ckpt.dir.name)
    newer = f"; newer ones are not complete: {'; '.join(skipped)}" if skipped else ""
    return ckpt.dir, (f"{LATEST} was {why}: resuming from {ckpt.dir.name} (step {ckpt.step}), the newest complete "
                      f"one{newer}")


def clean_up(model_dir):
    """Finish what interrupted writers left in ``model_dir``: put back a committed checkpoint a re-save
    stranded in ``.checkpoint_<step>.old``, and remove staging directories. Only the one job that owns
    ``model_dir`` (it holds its lock) may call this, before it writes."""
    model_dir = Path(model_dir)
    for old in model_dir.glob(".checkpoint_*.old"):
        final = model_dir / old.name[1:-len(".old")]
        if final.exists():  # killed after the new copy was in place: the old one is garbage
            shutil.rmtree(old)
        else:               # killed between the renames: the old copy is the committed one
            os.rename(old, final)
    for partial in model_dir.glob(".checkpoint_*.partial"):
        shutil.rmtree(partial)


def _write_file(path, buf):
    """Write an HDF5 file built in memory, and fsync it. HDF5 itself is never the one to meet a full
    disk: its library can crash the process when a write fails half-way (seen with ENOSPC)."""
    with open(path, "wb") as f:
        f.write(buf.getbuffer())
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensor_keys(params, opt_state, sparse=None):
    for name, value in params.items():
        yield model_key(name), value
        for state, arr in (opt_state or {}).get(name, {}).items():
            yield state_key(name, state), arr
        for part, arr in (sparse or {}).get(name, {}).items():
            yield sparse_key(name, part), arr


class CheckpointWriter:
    """Writes one checkpoint: ``write_shard`` per MemoryX rank (any process), then ``commit`` once.

    Every writer of one step uses the same staging directory; create it with ``prepare()`` (the
    coordinator, before shards are written), which also clears what a killed writer left behind.
    """

    def __init__(self, model_dir, step):
        self.model_dir = Path(model_dir)
        self.step = int(step)
        self.final = self.model_dir / f"checkpoint_{self.step}"
        self.staging = self.model_dir / f".checkpoint_{self.step}.partial"

    def prepare(self):
        self.model_dir.mkdir(parents=True, exist_ok=True)
        clean_up(self.model_dir)  # also what a failed save of another step left (a full disk)
        try:
            self.staging.mkdir()
        except OSError as exc:
            raise _write_failed(self.staging, exc, self.model_dir) from None
        return self

    def write_shard(self, k, params, opt_state=None, sparse=None):
        """Write shard k; return its tensor table.

        ``params``: name -> array; ``opt_state``: name -> {state: array}; ``sparse``: for a weight
        stored as its nonzero values, name -> {"indptr", "indices", "shape"}: its CSR pattern
        (written as ``/sparse/<name>/...``, so the checkpoint alone can rebuild the dense matrix).
        """
        path = self.staging / shard_name(k)
        table = {}
        buf = io.BytesIO()
        with h5py.File(buf, "w") as f:
            for key, arr in _tensor_keys(params, opt_state, sparse):
                arr = np.ascontiguousarray(arr)
                f.create_dataset(key, data=arr)
                table[key] = {"shard": k, **tensor_entry(arr)}
        try:
            _write_file(path, buf)
        except OSError as exc:
            path.unlink(missing_ok=True)  # the rest of the staging directory goes at the next prepare()
            raise _write_failed(path, exc, self.model_dir) from None
        return table

    def commit(self, tables, *, params_yaml="", loader_state=None, rng_state=None, loss_scale=None, numerics=None):
        """Write the index from the shards' tables, then move the checkpoint into place and point ``latest`` at it.

        ``numerics``: the numerics environment the weights were computed in (``wse_core.numerics``),
        which a resume compares with its own."""
        tensors = {}
        for table in tables:
            tensors.update(table)
        num_shards = len(tables)
        shard_sha = {shard_name(k): _file_sha256(self.staging / shard_name(k)) for k in range(num_shards)}
        index = self.staging / INDEX
        attrs = {"format_version": FORMAT_VERSION, "step": self.step, "num_shards": num_shards,
                 "params_yaml": params_yaml, "loader_state": json.dumps(loader_state),
                 "rng_state": json.dumps(rng_state), "loss_scale": json.dumps(loss_scale),
                 "numerics": json.dumps(numerics), "tensors": json.dumps(tensors),
                 "shard_sha256": json.dumps(shard_sha)}
        attrs["metadata_sha256"] = metadata_sha256(attrs)
        buf = io.BytesIO()
        with h5py.File(buf, "w") as f:
            f.attrs.update(attrs)
            for key, meta in tensors.items():
                f[key] = h5py.ExternalLink(shard_name(meta["shard"]), "/" + key)
        try:
            _write_file(index, buf)
            _fsync_path(self.staging)
        except OSError as exc:
            shutil.rmtree(self.staging, ignore_errors=True)
            raise _write_failed(index, exc, self.model_dir) from None
        if self.final.exists():  # a re-save of the same step: keep the old one until the new one is in place
            old = self.model_dir / f".checkpoint_{self.step}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(self.final, old)
            os.rename(self.staging, self.final)
            shutil.rmtree(old)
        else:
            os.rename(self.staging, self.final)
        _fsync_path(self.model_dir)
        _write_latest(self.model_dir, self.final.name)  # if it fails, latest still names the one before
        return self.final


def save_checkpoint(model_dir, step, shards, *, params_yaml="", loader_state=None, rng_state=None):
    """Write a whole checkpoint from one process; ``shards`` is a list of (params, opt_state), one per MemoryX rank."""
    writer = CheckpointWriter(model_dir, step).prepare()
    tables = [writer.write_shard(k, p, s) for k, (p, s) in enumerate(shards)]
    return writer.commit(tables, params_yaml=params_yaml, loader_state=loader_state, rng_state=rng_state)


def resolve(path):
    """A model_dir (-> its ``latest``), a checkpoint directory, or an ``index.h5`` -> the checkpoint directory."""
    p = Path(path)
    if p.is_file() and p.name == INDEX:
        return p.parent
    if (p / INDEX).is_file():
        return p
    name, why = _latest(p)
    if name is not None:
        if (p / name / INDEX).is_file():
            return p / name
        if not (p / name).exists() and (p / f".{name}.old" / INDEX).is_file():
            return p / f".{name}.old"  # a re-save killed between its renames (see clean_up)
        raise CheckpointError(f"{p / LATEST}: names {name!r}, which has no {INDEX}")
    if why != "missing" or checkpoint_dirs(p):  # what `wse fit` recovers (recover_latest), read-only here
        ckpt, _ = newest_complete(p, why)
        raise CheckpointError(f"{p}: {LATEST} is {why}; the newest complete checkpoint is {ckpt.dir.name} (`wse fit` "
                              f"resumes from it and writes {LATEST} again; to read it now, give {ckpt.dir})")
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint or model directory")
    raise CheckpointError(f"{p}: not a checkpoint (no {INDEX}) and not a model directory (no {LATEST})")


class Checkpoint:
    """A committed checkpoint: its metadata, verification, loading and conversion."""

    def __init__(self, path):
        self.dir = resolve(path)
        index = self.dir / INDEX
        try:
            with h5py.File(index, "r") as f:
                self._read_metadata(index, dict(f.attrs))
                links = {key: f.get(key, getlink=True) for key in self.tensors}
        except OSError as exc:
            raise CheckpointError(f"{index}: not a readable HDF5 file ({str(exc).splitlines()[0]}): "
                                  "the index is damaged") from None
        for key, meta in self.tensors.items():
            link = links[key]
            if not (isinstance(link, h5py.ExternalLink) and link.filename == shard_name(meta["shard"])
                    and link.path == "/" + key):
                raise CheckpointError(f"{index}: the index is damaged: its link /{key} does not point to "
                                      f"{shard_name(meta['shard'])}")
        self._checked = set()  # shards whose file SHA-256 matched
        # A copy under another step's name (checkpoint_50 copied to checkpoint_75) would resume or
        # evaluate as that step: the name CheckpointWriter gave it must say the step its index records.
        named = _CHECKPOINT_NAME.fullmatch(self.dir.name.removeprefix(".").removesuffix(".old"))  # clean_up's too
        if named and int(named.group(1)) != self.step:
            raise CheckpointError(f"{self.dir}: its index records step {self.step}, not {named.group(1)}: a copy "
                                  "of another step's checkpoint under this name?")

    def _read_metadata(self, index, a):
        """Check the index's metadata against its own SHA-256 before anything in it is believed."""
        try:
            self.format_version = int(a["format_version"])
        except (KeyError, ValueError, TypeError):
            raise CheckpointError(f"{index}: missing or malformed attribute format_version") from None
        if self.format_version > FORMAT_VERSION:
            raise CheckpointError(f"{index}: format version {self.format_version} is newer than this "
                                  f"wse-cluster reads ({FORMAT_VERSION}): upgrade wse-cluster")
        if self.format_version >= 2:
            try:
                sound = a["metadata_sha256"] == metadata_sha256(a)
            except (KeyError, ValueError, TypeError):
                sound = False
            if not sound:
                raise CheckpointError(f"{index}: the index is damaged: its metadata (step, tensor table, "
                                      "SHA-256 entries, ...) does not match its metadata_sha256")
        try:
            self.step = int(a["step"])
            self.num_shards = int(a["num_shards"])
            self.params_yaml = str(a["params_yaml"])
            self.loader_state = json.loads(a["loader_state"])
            self.rng_state = json.loads(a["rng_state"])
            self.loss_scale = json.loads(a.get("loss_scale", "null"))  # the loss scaler's state (or null)
            self.numerics = json.loads(a.get("numerics", "null"))  # null: written before it was recorded
            self.tensors = json.loads(a["tensors"])
            self.shard_sha256 = json.loads(a["shard_sha256"])
            if not (isinstance(self.tensors, dict) and isinstance(self.shard_sha256, dict)):
                raise ValueError("tensors and shard_sha256 must be JSON objects")
            self._parsed = [k for k in map(parse_key, self.tensors) if k]  # (kind, name, part), in table order
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{index}: missing or malformed attribute ({exc})") from None

    @property
    def param_names(self):
        return [name for kind, name, _ in self._parsed if kind == MODEL]

    def shape(self, name):
        """The stored shape of parameter ``name`` (a sparse weight's: its number of nonzeros)."""
        return self.tensors[model_key(name)]["shape"]

    def check_model(self, model):
        """CheckpointError unless this checkpoint holds every parameter of ``model`` (a
        ``wse_core.nn`` model) with the model's shape: what a resume (``wse fit``) and an evaluation
        (``wse validate``) check before reading a tensor, so a params file whose model differs (a
        ``--set model.hidden_size=...``) is named as the cause, not a reshape deep in the forward."""
        missing = set(model.param_names) - set(self.param_names)
        if missing:
            raise CheckpointError(f"{self.dir}: does not hold parameter {sorted(missing)[0]!r} of this model")
        for name, spec in model.param_specs.items():  # e.g. another hidden_size, or model.sparsity
            if self.shape(name) != list(spec.shape):
                raise CheckpointError(f"{self.dir}: parameter {name!r} has shape {self.shape(name)}, this model's is "
                                      f"{list(spec.shape)} (the params' model is not the one that wrote it)")

    def sparse_names(self):
        """Parameters stored as the nonzero values of a sparse matrix."""
        return [n for n in self.param_names if sparse_key(n, "indptr") in self.tensors]

    def dense(self, params):
        """``params`` with every sparse weight expanded to its dense ``[out, in]`` matrix (zeros elsewhere)."""
        out = dict(params)
        handles = {}
        try:
            for n in self.sparse_names():
                if n not in out:
                    continue
                indptr, indices, shape = (self._read(sparse_key(n, part), handles) for part in SPARSE_PARTS)
                dense = np.zeros(tuple(int(x) for x in shape), out[n].dtype)
                dense[np.repeat(np.arange(len(indptr) - 1), np.diff(indptr)), indices] = out[n]
                out[n] = dense
        finally:
            for f in handles.values():
                f.close()
        return out

    def state_names(self, name):
        return [state for kind, n, state in self._parsed if kind == OPTIMIZER and n == name]

    def _read(self, key, handles):
        meta = self.tensors[key]
        shard = self.dir / shard_name(meta["shard"])
        if meta["shard"] not in handles:
            try:
                handles[meta["shard"]] = h5py.File(shard, "r")
            except OSError as exc:
                raise CheckpointError(f"{shard}: not a readable HDF5 file "
                                      f"({str(exc).splitlines()[0]}): the shard is damaged") from None
        try:
            arr = handles[meta["shard"]][key][()]
        except (OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{shard}: tensor {key} unreadable ({str(exc).splitlines()[0]})") from None
        if not intact(arr, meta):
            raise CheckpointError(f"{shard}: tensor {key} is damaged (SHA-256, shape or dtype differs from the index)")
        return arr

    def _check_shard(self, k):
        """The one check of shard k that verify and load share: present, and its file's SHA-256 as the
        index says; where it differs, the damaged tensor is named (else the HDF5 metadata is)."""
        if k in self._checked:
            return
        shard = self.dir / shard_name(k)
        if not shard.is_file():
            raise CheckpointError(f"{shard}: missing")
        if _file_sha256(shard) != self.shard_sha256.get(shard.name):
            handles = {}
            try:
                for key, meta in self.tensors.items():
                    if meta["shard"] == k:
                        self._read(key, handles)
            finally:
                for f in handles.values():
                    f.close()
            raise CheckpointError(f"{shard}: SHA-256 differs from the index, outside tensor data "
                                  "(HDF5 metadata is damaged)")
        self._checked.add(k)

    def load(self, names=None):
        """(params, opt_state) of ``names`` (default: all): each shard they come from is checked
        whole, as ``verify`` does, and each tensor against its own SHA-256."""
        names = self.param_names if names is None else list(names)
        missing = [n for n in names if model_key(n) not in self.tensors]
        if missing:
            raise CheckpointError(f"{self.dir}: no parameter {missing[0]!r} in this checkpoint")
        keys = [model_key(n) for n in names] + [state_key(n, s) for n in names for s in self.state_names(n)]
        for k in sorted({self.tensors[key]["shard"] for key in keys}):
            self._check_shard(k)
        handles = {}
        try:
            params = {n: self._read(model_key(n), handles) for n in names}
            state = {n: {s: self._read(state_key(n, s), handles) for s in self.state_names(n)} for n in names}
        finally:
            for f in handles.values():
                f.close()
        return params, state

    def verify(self):
        """Check the whole checkpoint as ``load`` does; raise CheckpointError naming the damaged file."""
        for k in range(self.num_shards):
            self._check_shard(k)

    def info(self):
        model_keys = {model_key(n) for n in self.param_names}
        shards = []
        for k in range(self.num_shards):
            path = self.dir / shard_name(k)
            if not path.is_file():
                raise CheckpointError(f"{path}: missing")  # as verify says it
            keys = [key for key, m in self.tensors.items() if m["shard"] == k]
            shards.append({"name": path.name, "bytes": path.stat().st_size,
                           "tensors": len(keys),
                           "parameters": int(sum(np.prod(self.tensors[key]["shape"]) for key in keys
                                                 if key in model_keys))})
        return {"path": str(self.dir), "step": self.step, "format_version": self.format_version,
                "num_shards": self.num_shards, "shards": shards,
                "n_params": int(sum(s["parameters"] for s in shards)),
                "n_tensors": len(self.param_names), "n_tensors_in_all": len(self.tensors),  # with optimizer state
                "sparse_tensors": len(self.sparse_names()),
                "optimizer_states": sorted({s for n in self.param_names for s in self.state_names(n)}),
                "loader_state": self.loader_state, "numerics": self.numerics, "params_yaml": self.params_yaml}

    def convert(self, to, output):
        """Write the weights (parameter names as keys) as ``npz``, ``h5`` or a torch ``state_dict``
        (a Hugging Face directory is ``data_tools.hf.to_hf``'s).

        Sparse weights are written dense (``[out, in]``, zeros off the pattern), as PyTorch expects.
        """
        if to == "torch":
            try:
                import torch
            except ImportError:
                raise CheckpointError("--to torch: PyTorch is not installed (pip install torch); "
                                      "use --to npz or --to h5") from None
        params = self.dense(self.load()[0])
        if to == "npz":
            with open(output, "wb") as f:
                np.savez(f, **params)
        elif to == "h5":
            with h5py.File(output, "w") as f:
                for name, value in params.items():
                    f.create_dataset(name, data=value)
        elif to == "torch":
            torch.save({k: torch.from_numpy(v) for k, v in params.items()}, output)
        else:
            raise CheckpointError(f"--to: expected npz, h5 or torch, got {to!r}")
        return output
