"""The high layer of datasets: ``Dataset`` (directories as one indexed sequence of examples) and
``GlobalStream``, the loader: a dataset, or a Model Zoo mixture of several, as one endless stream.

    stream = GlobalStream("data/train", shuffle=True, seed=1)
    ex = stream.read(start, count)       # stream positions [start, start + count): int32 [count, 3, S]
    GlobalStream(mixture=[{"data_dir": "web", "weight": 0.7}, {"data_dir": "code", "weight": 0.3}])

A stream position names one example for ever: the global batch of step t is positions
[t*B, (t+1)*B), whichever input worker reads it, so the stream is the same for any number of
CS-2s and workers and a run resumes exactly from its step (docs/design/data.md "Reading").

Order. The files are read in whole *chunks* (``chunk_rows`` examples, the HDF5 chunk our
preprocessing writes). Epoch e visits every example once: in file order, or with ``shuffle`` the
chunks in a permutation drawn from (seed, e), and the examples of each *window* of
``window`` consecutive chunks of that permutation in a permutation drawn from (seed, e, window
number). So the reads are whole chunks (at raw h5py speed or faster) and the order is random
at two scales: which chunks come together is new each epoch, and within a window every order is
equally likely; two examples more than a window apart in the epoch's chunk order are never in
the same batch window.
"""
import os
import sys
from collections.abc import Mapping

import h5py
import numpy as np

from data_tools.errors import DataError
from data_tools.lmdata import (DATA_PARAMS, array_data, chunk_rows, dataset_format, h5_files, lm_data, open_h5,
                               read_examples, read_meta, tensor_columns, tensor_data)
from wse_core.data import chunk_ok

WINDOW_CHUNKS = 64  # chunks shuffled together (64 MiB of examples): see docs/design/data.md "Reading"


class Dataset:
    """A dataset directory, or a list of them (Model Zoo's ``data_dir`` may be either): the sorted
    files of each directory, in the list's order, and a global example index across them.

    Counts and shapes come from ``data_params.json`` when it lists every file (ours does), so
    opening a dataset reads no HDF5 file; a file is checked against them when first read. Other
    tools' directories are opened file by file, their layout checked at once.
    """

    def __init__(self, data_dir):
        dirs = [data_dir] if isinstance(data_dir, (str, os.PathLike)) else list(data_dir)
        if not dirs:
            raise DataError("data_dir: an empty list of dataset directories")
        self.dir = data_dir
        self.files, self.counts, self.example_shape = [], [], None
        formats, metas = [], []
        for d in dirs:
            files = h5_files(d)
            meta = read_meta(d)
            formats.append(dataset_format(d))
            metas.append(meta)
            if formats[-1] != formats[0]:
                raise DataError(f"{d}: {formats[-1]} data, where {dirs[0]} holds {formats[0]} data "
                                "(one dataset, one format)")
            counts, shape = _listed(meta, files)
            if counts is None:
                counts, shape = self._open_all(files, formats[0])
            if self.example_shape is None:
                self.example_shape = shape
            elif shape != self.example_shape:
                raise DataError(f"{d}: examples have shape {shape}, those of {dirs[0]} {self.example_shape}")
            self.files += files
            self.counts += counts
        self.format = formats[0]
        self.columns = _columns(self.format, self.example_shape, metas[0])
        for d, meta in zip(dirs[1:], metas[1:]):
            if _columns(self.format, self.example_shape, meta) != self.columns:
                raise DataError(f"{d}: its columns differ from those of {dirs[0]}")
        self.params = dict(metas[0])
        if len(dirs) > 1:  # what describes the whole: the largest vocabulary; counts are the files'
            self.params.pop("n_examples", None)
            vocab = [p["vocab_size"] for p in metas if "vocab_size" in p]
            if vocab:
                self.params["vocab_size"] = max(vocab)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self._files = _Files(self.files, self.counts, self.columns, self.format)

    def _open_all(self, files, fmt):
        """Counts and example shape of files with no listing: every file's layout (metadata only)."""
        if fmt == "tensors":
            raise DataError(f"{files[0].parent}: a tensor dataset needs the {DATA_PARAMS} that lists its files")
        counts, shape = [], None
        for path in files:
            with open_h5(path) as f:
                d = lm_data(path, f) if fmt == "lm" else array_data(path, f)[0]
                if shape is None:
                    shape = tuple(d.shape[1:])
                elif tuple(d.shape[1:]) != shape:
                    raise DataError(f"{path}: dataset '{d.name.lstrip('/')}' examples have shape {d.shape[1:]}, "
                                    f"other files {shape}")
                counts.append(int(d.shape[0]))
        return counts, shape

    @property
    def n_examples(self):
        return int(self.offsets[-1])

    def empty(self, n):
        """Arrays for ``n`` examples, one a column."""
        return [np.empty((n, *shape), dtype) for _, dtype, shape in self.columns]

    def read(self, start, stop):
        """Examples [start, stop) of the whole dataset, in sorted-file order: the raw arrays (LM data
        as one array, the other layouts as a tuple of columns)."""
        cols = self.empty(stop - start)
        for i in range(len(self.files)):
            lo, hi = max(start, self.offsets[i]), min(stop, self.offsets[i + 1])
            if lo < hi:
                self._files.read(i, int(lo - self.offsets[i]), int(hi - self.offsets[i]),
                                 [c[lo - start:hi - start] for c in cols])
        return cols[0] if self.format == "lm" else tuple(cols)

    def close(self):
        self._files.close()


def _columns(fmt, example_shape, meta):
    """[(name, dtype, example shape)] of a dataset: the layout's, or a tensor dataset's own."""
    if fmt == "lm":
        return [("data", np.dtype(np.int32), tuple(example_shape))]
    if fmt == "arrays":
        return [("features", np.dtype(np.float32), tuple(example_shape)), ("labels", np.dtype(np.int32), ())]
    return tensor_columns(meta)


def _listed(meta, files):
    """(counts, example shape) from a data_params.json that lists exactly these files, else (None, None)."""
    listed = meta.get("files")
    if not isinstance(listed, list) or not all(isinstance(e, dict) and "name" in e and "n_examples" in e
                                               for e in listed):
        return None, None
    by_name = {e["name"]: int(e["n_examples"]) for e in listed}
    if sorted(by_name) != [f.name for f in files]:
        return None, None
    if meta.get("format", "lm") == "lm" and "max_seq_length" in meta:
        shape = (3, int(meta["max_seq_length"]))
    elif meta.get("format") == "arrays" and "feature_shape" in meta:
        shape = tuple(int(x) for x in meta["feature_shape"])
    elif meta.get("format") == "tensors":
        shape = tensor_columns(meta)[0][2]
    else:
        return None, None
    return [by_name[f.name] for f in files], shape


class _Files:
    """A dataset's files, opened when first read and kept open with their datasets (looking a
    dataset up costs as much as a small read); each checked against what the dataset expects."""

    def __init__(self, files, counts, columns, fmt):
        # What the dataset expects, not the dataset itself: no cycle keeps closed-over files open.
        self.files, self.counts, self.columns, self.format = files, counts, columns, fmt
        self.example_shape = columns[0][2]
        self.handles, self.raw = {}, {}

    def _columns(self, fi):
        if fi not in self.handles:
            path = self.files[fi]
            try:
                f = h5py.File(path, "r")
            except OSError as exc:
                raise DataError(f"{path}: not a readable HDF5 file ({str(exc).splitlines()[0]})") from None
            try:
                cols = ([lm_data(path, f)] if self.format == "lm" else tensor_data(path, f, self.columns)
                        if self.format == "tensors" else list(array_data(path, f)))
                d = cols[0]
                if tuple(d.shape[1:]) != self.example_shape:
                    raise DataError(f"{path}: dataset '{d.name.lstrip('/')}' examples have shape {d.shape[1:]}, "
                                    f"other files {self.example_shape}")
                if d.shape[0] != self.counts[fi]:
                    raise DataError(f"{path}: holds {d.shape[0]} examples but {DATA_PARAMS} says "
                                    f"{self.counts[fi]}: the directory changed after it was written")
            except BaseException:
                f.close()
                raise
            self.handles[fi] = (f, cols)
        return self.handles[fi][1]

    def raw_chunks(self, fi):
        """Rows per chunk if file ``fi``'s chunks can be read raw (LM data, whole-example chunks,
        no filter but Fletcher-32: what our preprocessing writes uncompressed), else 0."""
        if self.format != "lm":
            return 0
        d = self._columns(fi)[0]
        if fi not in self.raw:
            plist = d.id.get_create_plist()
            filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
            ok = (d.chunks is not None and d.chunks[1:] == d.shape[1:]
                  and filters in ([], [h5py.h5z.FILTER_FLETCHER32]) and d.dtype == np.dtype("<i4")
                  and sys.byteorder == "little")  # chunk_ok reads the words little-endian
            self.raw[fi] = (d.chunks[0] if ok else 0, bool(filters))
        return self.raw[fi][0]

    def read_chunk(self, fi, lo, n, flat, at):
        """Chunk at row ``lo`` of file ``fi`` (``n`` rows of it wanted) into bytes [at, ...) of
        ``flat``, raw, its checksum verified here; ``flat`` needs 4 spare bytes past the rows
        (a partial chunk goes through a scratch buffer)."""
        d, (rows, checked) = self._columns(fi)[0], self.raw[fi]
        row_bytes = d.dtype.itemsize * int(np.prod(d.shape[1:]))
        size = rows * row_bytes
        whole = n == rows
        dest = flat[at:at + size + 4] if whole else np.empty(size + 4, np.uint8)
        mask, _ = d.id.read_direct_chunk((lo,) + (0,) * (d.ndim - 1), out=dest)
        path = self.files[fi]
        if mask:  # a filter was skipped when this chunk was written: let HDF5 read it
            flat[at:at + n * row_bytes] = read_examples(path, d, slice(lo, lo + n)).view(np.uint8).reshape(-1)
            return
        if checked and not chunk_ok(dest, 0, size):
            read_examples(path, d, slice(lo, lo + n))  # HDF5 names the fault in the words verify uses
            raise DataError(f"{path}: dataset 'data' unreadable at examples {lo}..{lo + n - 1} "
                            "(Fletcher-32 checksum mismatch): the file is damaged")
        if not whole:
            flat[at:at + n * row_bytes] = dest[:n * row_bytes]

    def read(self, fi, lo, hi, out):
        """Rows [lo, hi) of file ``fi`` into ``out`` (one array per column), straight from HDF5."""
        self.read_blocks(fi, [lo], [hi - lo], out)

    def read_blocks(self, fi, los, ns, out):
        """Row blocks [lo, lo + n) of file ``fi``, in the order given, into ``out`` (one array per
        column); blocks that follow each other in the file are read in one call."""
        runs = []
        for lo, n in zip(np.asarray(los).tolist(), np.asarray(ns).tolist()):
            if runs and runs[-1][0] + runs[-1][1] == lo:
                runs[-1][1] += n
            else:
                runs.append([lo, n])
        for d, o in zip(self._columns(fi), out):
            at = 0
            for lo, n in runs:
                try:
                    d.read_direct(o, np.s_[lo:lo + n], np.s_[at:at + n])
                except (OSError, ValueError, TypeError):  # name the examples of the bad chunk, as verify does
                    read_examples(self.files[fi], d, slice(lo, lo + n))
                    raise
                at += n

    def close(self):
        for f, _ in self.handles.values():
            f.close()
        self.handles = {}


class _Sequence:
    """One dataset's epochs in chunk-window order: stream position p of epoch e -> examples.
    ``seed``: a tuple of ints, (seed,) or, for a mixture's component k, (seed, k)."""

    def __init__(self, dataset, shuffle, seed, window):
        self.ds, self.shuffle, self.seed, self.window = dataset, shuffle, seed, window
        self.n = dataset.n_examples
        self.rows = rows = chunk_rows(dataset.example_shape, 4)
        blocks = [(fi, lo, min(rows, c - lo)) for fi, c in enumerate(dataset.counts) for lo in range(0, c, rows)]
        self.block_file, self.block_lo, self.block_n = np.array(blocks, np.int64).reshape(-1, 3).T
        self._epochs = {}

    def _epoch(self, e):
        """The chunk order of epoch e and the stream position where each window starts."""
        if e not in self._epochs:
            nb = len(self.block_n)
            perm = np.random.default_rng([*self.seed, e]).permutation(nb) if self.shuffle else np.arange(nb)
            cum = np.concatenate([[0], np.cumsum(self.block_n[perm])])
            self._epochs[e] = perm, np.append(cum[::self.window][: -(-nb // self.window)], self.n)
            while len(self._epochs) > 2:  # a batch may straddle two epochs
                self._epochs.pop(next(iter(self._epochs)))
        return self._epochs[e]

    def windows(self, start, count):
        """(epoch, window, offset in window, count) pieces covering stream positions [start, start + count)."""
        pieces, pos, stop = [], start, start + count
        while pos < stop:
            e, p = divmod(pos, self.n)
            _, starts = self._epoch(e)
            k = int(np.searchsorted(starts, p, side="right")) - 1
            take = min(stop - pos, int(starts[k + 1]) - p)
            pieces.append((e, k, p - int(starts[k]), take))
            pos += take
        return pieces

    def load(self, e, k, files, spare=None):
        """Window k of epoch e: (columns in read order, the order to serve them in, the LM flat
        buffer); ``spare``: a flat buffer to reuse."""
        perm, starts = self._epoch(e)
        blocks = perm[k * self.window:(k + 1) * self.window]
        m = int(starts[k + 1] - starts[k])
        lm = self.ds.format == "lm"
        flat = None
        if lm:  # one flat buffer, 4 bytes longer than the rows: raw chunks carry their checksum after them
            size = m * 4 * int(np.prod(self.ds.example_shape)) + 4
            flat = spare[:size] if spare is not None and spare.size >= size else np.empty(size, np.uint8)
            cols = [flat[:-4].view(np.int32).reshape(m, *self.ds.example_shape)]
        else:
            cols = self.ds.empty(m)
        # The window's chunks in file order, each file's run of them read at once where it can be
        # (the shuffle below makes the order of the reads irrelevant to the stream, but it is fixed).
        blocks = blocks[np.lexsort((self.block_lo[blocks], self.block_file[blocks]))]
        files_of = self.block_file[blocks]
        row_bytes = 4 * int(np.prod(self.ds.example_shape))
        at = 0
        for fi in np.unique(files_of).tolist():
            mine = blocks[files_of == fi]
            los, ns = self.block_lo[mine], self.block_n[mine]
            if lm and files.raw_chunks(fi) == self.rows:
                for lo, n in zip(los.tolist(), ns.tolist()):
                    files.read_chunk(fi, lo, n, flat, at * row_bytes)
                    at += n
            else:
                n = int(ns.sum())
                files.read_blocks(fi, los, ns, [c[at:at + n] for c in cols])
                at += n
        # The shuffle within the window is applied as batches are served: a gather that replaces the
        # copy a batch needs anyway.
        order = np.random.default_rng([*self.seed, e, k]).permutation(m) if self.shuffle else None
        return cols, order, flat


class GlobalStream:
    """The training input: a dataset (``data_dir``: a directory or a list) or a Model Zoo
    ``mixture`` (``[{"data_dir": ..., "weight": ...}, ...]``) as one endless stream of examples.

    A mixture's epoch is Model Zoo's: enough examples that every component of weight above 5%
    is seen once, each component contributing ``int(total * weight)`` examples from its own
    stream (shuffled as above, seeded by (seed, component)); which positions of the epoch each
    component fills is a permutation drawn from (seed, epoch), so every stretch of the stream
    holds the components in about the stated proportions.
    """

    def __init__(self, data_dir=None, *, mixture=None, shuffle=False, seed=0, window=WINDOW_CHUNKS):
        if (data_dir is None) == (mixture is None):
            raise DataError("train_input: give one of data_dir or mixture")
        if window < 1:
            raise ValueError(f"window: expected >= 1 chunks, got {window}")
        if mixture is None:
            sources, weights, seeds = [data_dir], [1.0], [(seed,)]
        else:
            sources, weights = _mixture(mixture)
            seeds = [(seed, k) for k in range(len(sources))]
        self.datasets = [Dataset(s) for s in sources]
        for src, ds in zip(sources, self.datasets):
            if ds.n_examples == 0:
                raise DataError(f"{src}: the dataset holds no examples")
            first = self.datasets[0]
            if (ds.format, ds.columns) != (first.format, first.columns):
                raise DataError(f"mixture: {src} holds {ds.format} examples of shape {ds.example_shape}, "
                                f"{sources[0]} {first.format} of shape {first.example_shape}")
        self.dataset = self.datasets[0]
        self.format, self.example_shape = self.dataset.format, self.dataset.example_shape
        self.shuffle, self.seed = shuffle, seed
        self._seqs = [_Sequence(ds, shuffle, s, window) for ds, s in zip(self.datasets, seeds)]
        w = np.asarray(weights, np.float64) / sum(weights)
        big = [ds.n_examples / wk for ds, wk in zip(self.datasets, w) if wk > 0.05]
        total = max(big or [ds.n_examples / wk for ds, wk in zip(self.datasets, w)])
        self.per_epoch = [ds.n_examples if len(w) == 1 else int(total * wk) for ds, wk in zip(self.datasets, w)]
        self.n = sum(self.per_epoch)
        self._mix_epoch, self._labels, self._ranks = None, None, None
        self._cache, self._last = {}, (0, 0, None)

    @property
    def vocab_size(self):
        """The largest vocabulary any component's data_params.json states, or None."""
        vocab = [ds.params["vocab_size"] for ds in self.datasets if "vocab_size" in ds.params]
        return max(vocab) if vocab else None

    def read(self, start, count):
        """The examples at stream positions [start, start + count): LM ``[count, 3, S]`` or (features, labels)."""
        lo, hi, window = self._last
        if lo <= start and start + count <= hi:  # the common case, kept lean: a batch inside the current window
            cols = _serve(window, start - lo, count)
            return cols[0] if self.format == "lm" else tuple(cols)
        cols = self.dataset.empty(count)
        if len(self._seqs) == 1:
            self._fill(0, start, count, cols)
        else:
            at = 0
            while at < count:  # one mixture epoch at a time
                e, p = divmod(start + at, self.n)
                take = min(count - at, self.n - p)
                labels, ranks = self._mixture_epoch(e)
                lab = labels[p:p + take]
                for c in np.unique(lab).tolist():
                    where = np.flatnonzero(lab == c)
                    part = [np.empty((len(where), *col.shape[1:]), col.dtype) for col in cols]
                    self._fill(c, e * self.per_epoch[c] + int(ranks[p + where[0]]), len(where), part)
                    for col, got in zip(cols, part):
                        col[at + where] = got
                at += take
        return cols[0] if self.format == "lm" else tuple(cols)

    def _mixture_epoch(self, e):
        """Which component fills each position of mixture epoch e, and its rank within that component."""
        if self._mix_epoch != e:
            labels = np.repeat(np.arange(len(self._seqs), dtype=np.uint8), self.per_epoch)
            labels = labels[np.random.default_rng([self.seed, e, len(self._seqs)]).permutation(self.n)]
            ranks = np.empty(self.n, np.int64)
            for c in range(len(self._seqs)):
                where = np.flatnonzero(labels == c)
                ranks[where] = np.arange(len(where))
            self._mix_epoch, self._labels, self._ranks = e, labels, ranks
        return self._labels, self._ranks

    def _fill(self, c, start, count, out):
        """Component c's stream positions [start, start + count) into ``out``."""
        at, seq = 0, self._seqs[c]
        for e, k, off, n in seq.windows(start, count):
            window = self._window(c, e, k)
            for o, got in zip(out, _serve(window, off, n)):
                o[at:at + n] = got
            if len(self._seqs) == 1:  # remember where the window lies in the stream, for read's fast path
                lo = e * seq.n + int(seq._epoch(e)[1][k])
                self._last = (lo, lo + len(window[0][0]), window)
            at += n

    def _window(self, c, e, k):
        """A window's examples, kept while batches are served from it (two: a batch may straddle)."""
        key = (c, e, k)
        if key not in self._cache:
            spare = None
            if len(self._cache) >= 2:  # reuse the oldest window's memory: fresh pages cost as much as the read
                spare = self._cache.pop(next(iter(self._cache)))[2]
            self._cache[key] = self._seqs[c].load(e, k, self.datasets[c]._files, spare)
        return self._cache[key]

    def close(self):
        self._cache, self._last = {}, (0, 0, None)
        for ds in self.datasets:
            ds.close()


def _serve(window, off, n):
    """Positions [off, off + n) of a loaded window, as new arrays (one per column)."""
    cols, order, _ = window
    if order is None:
        return [c[off:off + n].copy() for c in cols]
    return [np.take(c, order[off:off + n], axis=0) for c in cols]


def _mixture(mixture):
    """Directories and weights of a Model Zoo ``mixture`` list, checked."""
    if not isinstance(mixture, (list, tuple)) or not mixture:
        raise DataError("mixture: expected a list of {data_dir, weight}")
    sources, weights = [], []
    for i, m in enumerate(mixture):
        if not isinstance(m, Mapping) or "data_dir" not in m or "weight" not in m:
            raise DataError(f"mixture[{i}]: expected data_dir and weight")
        w = m["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
            raise DataError(f"mixture[{i}].weight: expected a number >= 0, got {w!r}")
        if w > 0:  # Model Zoo drops components of weight 0
            sources.append(m["data_dir"])
            weights.append(float(w))
    if not weights:
        raise DataError("mixture: every weight is 0")
    if len(sources) > 255:
        raise DataError(f"mixture: {len(sources)} components; at most 255")
    return sources, weights


def inspect_dataset(data_dir):
    """Files, examples, tokens, vocabulary and one decoded example of a dataset directory."""
    from data_tools.tokenizers import get_tokenizer

    ds = Dataset(data_dir)
    p = ds.params
    info = {"dir": str(data_dir), "format": ds.format, "files": [str(f.name) for f in ds.files],
            "examples_per_file": [int(c) for c in ds.counts], "n_examples": ds.n_examples,
            "example_shape": list(ds.example_shape)}
    if ds.format != "lm":
        if ds.format == "arrays":
            info["num_classes"] = p.get("num_classes")
        else:
            info["columns"] = [f"{name}: {dtype} {list(shape)}" for name, dtype, shape in ds.columns]
        ds.close()
        return info
    first = ds.read(0, min(1, ds.n_examples))
    info.update(max_seq_length=int(ds.example_shape[-1]), vocab_size=p.get("vocab_size"),
                tokenizer=p.get("tokenizer"), n_tokens=p.get("n_tokens"))
    for key in ("pad_id", "eos_id"):
        if key in p:
            info[key] = p[key]
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
    ds.close()
    return info
