"""The high layer of datasets: ``Dataset`` (a directory as one indexed sequence of examples) and
``Loader`` (what an input worker runs: its files, a seeded shuffle, batches, prefetch, resume).

    loader = Loader("data/train", batch_size=8, worker_id=0, num_workers=2, shuffle=True, seed=1)
    batch = loader.next_batch()          # {"input_ids", "loss_mask", "labels"}: int32 [8, S]
    state = loader.position              # {"epoch": e, "index": i}: store it in a checkpoint
    Loader("data/train", 8, worker_id=0, num_workers=2, shuffle=True, seed=1, position=state)

Worker w reads ``files[w::num_workers]`` of the sorted file list. Its examples form an endless
stream, epoch after epoch; epoch e visits them in file order, or, with ``shuffle``, in the
permutation drawn from (seed, epoch). Batch k is stream examples [k*B, (k+1)*B), so a batch may
span two epochs and no example is dropped; ``position`` is the next example of the stream.
Batches are views into preallocated buffers, valid until the next call of ``next_batch``: copy
a batch you want to keep longer.
"""
import os
import queue
import threading

import numpy as np

from data_tools.errors import DataError
from data_tools.lmdata import (array_data, dataset_format, h5_files, lm_data, open_h5, read_data_params,
                               read_examples)


class _Reader:
    """Open dataset files, kept open with their datasets: looking a dataset up costs as much as a small read."""

    def __init__(self, paths, lm):
        self.paths, self.lm, self.handles = paths, lm, {}

    def _datasets(self, fi):
        import h5py

        if fi not in self.handles:
            try:
                f = h5py.File(self.paths[fi], "r")
            except OSError as exc:
                raise DataError(f"{self.paths[fi]}: not a readable HDF5 file ({str(exc).splitlines()[0]})") from None
            try:
                self.handles[fi] = (f, *((lm_data(self.paths[fi], f),) if self.lm else array_data(self.paths[fi], f)))
            except BaseException:
                f.close()
                raise
        return self.handles[fi][1:]

    def read(self, files, rows, out, labels=None):
        """out[i] (and labels[i]) := example rows[i] of file files[i].

        One h5py call per run of consecutive rows of one file: in order, a run is a whole batch;
        shuffled, runs are single examples (about 50 us each here, cheaper than h5py's point selections).
        """
        breaks = np.flatnonzero((np.diff(files) != 0) | (np.diff(rows) != 1)) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64).tolist()
        stops = np.concatenate([breaks, [len(files)]]).astype(np.int64).tolist()
        for lo, hi in zip(starts, stops):
            fi, r0, r1 = int(files[lo]), int(rows[lo]), int(rows[hi - 1]) + 1
            dsets = self._datasets(fi)
            try:
                out[lo:hi] = dsets[0][r0:r1]
                if labels is not None:
                    labels[lo:hi] = dsets[1][r0:r1]
            except (OSError, ValueError) as exc:
                raise DataError(f"{self.paths[fi]}: examples {r0}..{r1 - 1} unreadable "
                                f"({str(exc).splitlines()[0]}): the file is damaged") from None

    def close(self):
        for h in self.handles.values():
            h[0].close()
        self.handles = {}


class Dataset:
    """A dataset directory, or a list of them (Model Zoo's ``data_dir`` may be either): the sorted
    files of each directory, in the list's order, and a global example index across them."""

    def __init__(self, data_dir):
        dirs = [data_dir] if isinstance(data_dir, (str, os.PathLike)) else list(data_dir)
        if not dirs:
            raise DataError("data_dir: an empty list of dataset directories")
        self.dir = data_dir
        self.files = [f for d in dirs for f in h5_files(d)]
        formats = [dataset_format(d) for d in dirs]
        for d, fmt in zip(dirs[1:], formats[1:]):
            if fmt != formats[0]:
                raise DataError(f"{d}: {fmt} data, where {dirs[0]} holds {formats[0]} data (one dataset, one format)")
        self.format = formats[0]
        params = [read_data_params(d) or {} for d in dirs]
        self.params = dict(params[0])
        if len(dirs) > 1:  # what describes the whole: the largest vocabulary; counts are the files'
            self.params.pop("n_examples", None)
            vocab = [p["vocab_size"] for p in params if "vocab_size" in p]
            if vocab:
                self.params["vocab_size"] = max(vocab)
        self.counts = []
        self.example_shape = None
        for path in self.files:  # the layout of every file (metadata only): a rank must never meet a surprise
            with open_h5(path) as f:
                d = lm_data(path, f) if self.format == "lm" else array_data(path, f)[0]
                if self.example_shape is None:
                    self.example_shape = d.shape[1:]
                elif d.shape[1:] != self.example_shape:
                    raise DataError(f"{path}: dataset '{d.name.lstrip('/')}' examples have shape {d.shape[1:]}, "
                                    f"other files {self.example_shape}")
                self.counts.append(d.shape[0])
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    @property
    def n_examples(self):
        return int(self.offsets[-1])

    def read(self, start, stop):
        """Examples [start, stop) of the whole dataset, in sorted-file order: the raw arrays."""
        parts = []
        for i, path in enumerate(self.files):
            lo, hi = max(start, self.offsets[i]), min(stop, self.offsets[i + 1])
            if lo < hi:
                with open_h5(path) as f:
                    sel = slice(int(lo - self.offsets[i]), int(hi - self.offsets[i]))
                    if self.format == "lm":
                        parts.append(read_examples(path, lm_data(path, f), sel))
                    else:
                        parts.append(tuple(read_examples(path, d, sel) for d in array_data(path, f)))
        if self.format == "lm":
            return np.concatenate(parts) if parts else np.zeros((0, *self.example_shape), np.int32)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


class Loader:
    """Batches for one input worker, read ahead by a background thread."""

    def __init__(self, data_dir, batch_size, *, worker_id=0, num_workers=1, shuffle=False, seed=0,
                 position=None, prefetch=2):
        if batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id: expected 0 <= worker_id < num_workers ({num_workers}), got {worker_id}")
        self.dataset = Dataset(data_dir)
        ds = self.dataset
        mine = list(range(worker_id, len(ds.files), num_workers))
        if not mine:
            raise DataError(f"{data_dir}: {len(ds.files)} files cannot feed input worker {worker_id} "
                            f"of {num_workers}: write more, smaller files (--samples_per_file)")
        self.files = [ds.files[i] for i in mine]
        counts = [ds.counts[i] for i in mine]
        self.n_local = sum(counts)
        if self.n_local == 0:
            raise DataError(f"{data_dir}: the files of input worker {worker_id} hold no examples")
        # (file number, row) of each local example, in file order.
        self._file_of = np.repeat(np.arange(len(counts)), counts)
        self._row_of = np.concatenate([np.arange(c) for c in counts])
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        pos = position or {"epoch": 0, "index": 0}
        if not 0 <= pos["index"] < self.n_local or pos["epoch"] < 0:
            raise ValueError(f"position: {pos} is outside this worker's {self.n_local} examples")
        self._read_pos = (int(pos["epoch"]), int(pos["index"]))
        self._pos = dict(epoch=int(pos["epoch"]), index=int(pos["index"]))
        shape = (batch_size, *ds.example_shape)
        n_buf = prefetch + 2
        if ds.format == "lm":
            self._buffers = [np.empty(shape, np.int32) for _ in range(n_buf)]
        else:
            self._buffers = [(np.empty(shape, np.float32), np.empty(batch_size, np.int32)) for _ in range(n_buf)]
        self._queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="wse-loader", daemon=True)
        self._thread.start()

    def order(self, epoch):
        """Local example numbers in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return np.arange(self.n_local)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_local)

    @property
    def position(self):
        """{"epoch", "index"} of the next example the consumer will receive."""
        return dict(self._pos)

    def _fill(self):
        reader = _Reader(self.files, self.dataset.format == "lm")
        try:
            epoch, index = self._read_pos
            order = self.order(epoch)
            k = 0
            while not self._stop.is_set():
                buf = self._buffers[k % len(self._buffers)]
                k += 1
                picks, picked = [], 0
                while picked < self.batch_size:
                    take = order[index:index + self.batch_size - picked]
                    picks.append(take)
                    picked += len(take)
                    index += len(take)
                    if index == self.n_local:
                        epoch, index = epoch + 1, 0
                        order = self.order(epoch)
                local = np.concatenate(picks)
                files, rows = self._file_of[local], self._row_of[local]
                if isinstance(buf, tuple):
                    reader.read(files, rows, buf[0], buf[1])
                else:
                    reader.read(files, rows, buf)
                item = (buf, {"epoch": epoch, "index": index})
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # hand the failure to the consumer instead of dying silently
            self._queue.put(exc)
        finally:
            reader.close()

    def next_batch(self):
        """The next batch: views into a preallocated buffer, valid until the next call."""
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._stop.set()
            raise item
        buf, self._pos = item[0], item[1]
        if self.dataset.format == "lm":
            return {"input_ids": buf[:, 0], "loss_mask": buf[:, 1], "labels": buf[:, 2]}
        return {"features": buf[0], "labels": buf[1]}

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        while True:
            yield self.next_batch()


def inspect_dataset(data_dir):
    """Files, examples, tokens, vocabulary and one decoded example of a dataset directory."""
    from data_tools.tokenizers import get_tokenizer

    ds = Dataset(data_dir)
    p = ds.params
    info = {"dir": str(data_dir), "format": ds.format, "files": [str(f.name) for f in ds.files],
            "examples_per_file": [int(c) for c in ds.counts], "n_examples": ds.n_examples,
            "example_shape": list(ds.example_shape)}
    if ds.format == "arrays":
        info["num_classes"] = p.get("num_classes")
        return info
    first = ds.read(0, min(1, ds.n_examples))
    info.update(max_seq_length=int(ds.example_shape[-1]), vocab_size=p.get("vocab_size"),
                tokenizer=p.get("tokenizer"), n_tokens=p.get("n_tokens"))
    if info["n_tokens"] is None:  # other tools' files: count the tokens the loss sees
        info["n_loss_tokens"] = int(sum(int((ds.read(i, min(i + 4096, ds.n_examples))[:, 1] != 0).sum())
                                        for i in range(0, ds.n_examples, 4096)))
    if len(first):
        ids = first[0, 0]
        info["example_0_ids"] = [int(i) for i in ids[:32]]
        try:
            tok = get_tokenizer(p.get("tokenizer", "byte"))
            info["example_0_text"] = tok.decode(ids.tolist())
        except DataError as exc:
            info["example_0_text"] = f"(cannot decode: {exc})"
    return info


class GlobalStream:
    """The whole dataset as one endless stream of examples, independent of how it is read.

    Epoch e visits every example once, in sorted-file order, or with ``shuffle`` in the
    permutation drawn from (seed, e) alone. Stream position p is example ``order(p // n)[p % n]``.
    The cluster's input workers read their CS-2's micro-batches from it, so the global batch of
    step t is stream positions [t*B, (t+1)*B) whatever the number of CS-2s and workers.
    """

    def __init__(self, data_dir, *, shuffle=False, seed=0):
        self.dataset = Dataset(data_dir)
        self.shuffle, self.seed = shuffle, seed
        self.n = self.dataset.n_examples
        if self.n == 0:
            raise DataError(f"{data_dir}: the dataset holds no examples")
        self._orders = {}
        self._reader = _Reader(self.dataset.files, self.dataset.format == "lm")

    def order(self, epoch):
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)
                            if self.shuffle else np.arange(self.n)}
        return self._orders[epoch]

    def indices(self, start, count):
        """Dataset example numbers at stream positions [start, start + count)."""
        pos = np.arange(start, start + count, dtype=np.int64)
        out = np.empty(count, np.int64)
        for epoch in np.unique(pos // self.n).tolist():
            sel = pos // self.n == epoch
            out[sel] = self.order(epoch)[pos[sel] % self.n]
        return out

    def read(self, start, count):
        """The examples at stream positions [start, start + count): LM ``[count, 3, S]`` or (features, labels)."""
        ds = self.dataset
        idx = self.indices(start, count)
        files = np.searchsorted(ds.offsets, idx, side="right") - 1
        lm = ds.format == "lm"
        out = np.empty((count, *ds.example_shape), np.int32 if lm else np.float32)
        labels = None if lm else np.empty(count, np.int32)
        self._reader.read(files, idx - ds.offsets[files], out, labels)
        return out if lm else (out, labels)

    def close(self):
        self._reader.close()
