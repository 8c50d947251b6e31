"""The input pipeline: preprocessing against the tokenizer alone and a plain h5py write; loading against raw h5py.

    wse bench input [--json PATH] [--data DIR] [--mb 50] [--batch_size B] [--repeats R]

Without ``--data`` it builds a corpus of ``--mb`` MB (the standard library's sources, repeated
with variations: swapped case, lines reversed, ... so that no two copies are alike) as .jsonl
shards, then for the byte tokenizer and for a GPT-2-style byte-level BPE ``tokenizer.json``
trained here on the corpus's first 8 MB (no network):

* tokenizer only: the same documents in the same batches, encoded, nothing written;
* preprocessing (``max_seq_length`` 256, default compression) with 1 and 2 processes, outputs
  compared byte for byte; for the byte tokenizer also 1 process held to one core, and each
  compression (MB/s, size on disk);
* a plain h5py write of the very arrays preprocessing wrote (uncompressed, same chunks, no
  checksum) — the floor for writing them at all.

Then one epoch of the byte dataset (or ``--data``) is read in batches: raw h5py (every file's
``data`` in one read), the loader in order and shuffled. Rates are input text MB/s for writing,
example MB/s for reading; every figure is the median of ``--repeats`` runs in this process.
"""
import json
import os
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np

from bench.harness import machine, median_seconds, table
from data_tools import COMPRESSIONS, DEFAULT_COMPRESSION
from data_tools.dataset import Dataset, GlobalStream
from data_tools.documents import discover_inputs, stdlib_sources
from data_tools.lmdata import chunk_rows
from data_tools.preprocess import _init_worker, _tokenize, plan_jobs, preprocess_text
from wse_core.errors import ConfigError

SEQ = 256
VARIANTS = (lambda t: t, str.swapcase, lambda t: "\n".join(reversed(t.splitlines())),
            lambda t: "\n".join(line[::-1] for line in t.splitlines()), lambda t: t.replace("    ", "\t"))


def add_arguments(parser):
    parser.add_argument("--data", metavar="DIR", help="an existing LM dataset: time reading it only")
    parser.add_argument("--mb", type=float, default=50.0, help="size of the generated corpus in MB (default 50)")
    parser.add_argument("--batch_size", type=int, default=32, help="loader batch size")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")


def make_corpus(out, mb, shard_mb=8):
    """``mb`` MB of text as .jsonl shards: the stdlib's sources, each pass through them varied."""
    out.mkdir(parents=True, exist_ok=True)
    texts = [p.read_bytes().decode("utf-8", "replace") for p in stdlib_sources()]
    total = shard = 0
    f = None
    try:
        for r in range(1_000_000):
            for t in texts:
                if total >= mb * 1e6:
                    return
                if f is None or shard >= shard_mb * 1e6:
                    if f:
                        f.close()
                    f = open(out / f"corpus-{total // int(shard_mb * 1e6):04d}.jsonl", "w")
                    shard = 0
                line = json.dumps({"text": VARIANTS[r % len(VARIANTS)](t)}) + "\n"
                f.write(line)
                total += len(line.encode())
                shard += len(line.encode())
    finally:
        if f:
            f.close()


def train_bpe(corpus, path, vocab_size=8192, mb=8):
    """A GPT-2-style tokenizer (byte-level BPE, <|endoftext|>) trained on the corpus's first ``mb`` MB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        n = 0
        for f in sorted(corpus.glob("*.jsonl")):
            for line in open(f):
                doc = json.loads(line)["text"]
                n += len(doc)
                yield doc
                if n > mb * 1e6:
                    return

    tok.train_from_iterator(texts(), trainer)
    tok.save(str(path))


def _tokenizer_only(jobs, tokenizer):
    from data_tools.tokenizers import get_tokenizer

    _init_worker(get_tokenizer(tokenizer), "text")
    for job in jobs:
        _tokenize(job)


def _plain_write(examples, rows, out):
    """The floor: the same arrays written with h5py, chunked alike, no filter, no checksum."""
    out.mkdir(exist_ok=True)
    for i, lo in enumerate(range(0, len(examples), rows)):
        part = examples[lo:lo + rows]
        with h5py.File(out / f"plain-{i:05d}.h5", "w") as f:
            f.create_dataset("data", data=part, chunks=(min(len(part), chunk_rows(part.shape[1:])), *part.shape[1:]))


def _one_core(fn):
    """``fn()`` with this thread (and the threads it starts) held to one core."""
    if not hasattr(os, "sched_getaffinity"):
        return fn()
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        return fn()
    finally:
        os.sched_setaffinity(0, cores)


def _same_files(a, b):
    names = sorted(p.name for p in a.glob("*.h5"))
    return names == sorted(p.name for p in b.glob("*.h5")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def _preprocessing(corpus, tmp, tokenizer, repeats, extra):
    """Tokenizer-only and preprocessing rates for one tokenizer; returns its result dict."""
    files = discover_inputs([corpus])
    jobs = plan_jobs(files)
    mb = sum(f.stat().st_size for f in files) / 1e6
    out = {p: tmp / f"{Path(tokenizer).stem}_p{p}" for p in (1, 2)}

    def run(processes, compression=DEFAULT_COMPRESSION, dest=None):
        return preprocess_text([corpus], dest or out[processes], SEQ, tokenizer=tokenizer, processes=processes,
                               compression=compression, overwrite=True, progress=False)

    t = {"tokenizer_only": median_seconds(lambda: _tokenizer_only(jobs, tokenizer), repeats, warmup=0),
         "preprocess_1_process": median_seconds(lambda: run(1), repeats, warmup=0),
         "preprocess_2_processes": median_seconds(lambda: run(2), repeats, warmup=0)}
    params = json.loads((out[1] / "data_params.json").read_text())
    r = {"tokenizer": params["tokenizer"] if tokenizer == "byte" else "byte-level BPE, trained here",
         "vocab_size": params["vocab_size"], "input_mb": mb, "tokens": params["n_tokens"],
         "examples": params["n_examples"], "files": len(params["files"]),
         "outputs_identical_1_and_2_processes": _same_files(out[1], out[2])}
    # What is no longer needed goes at once: datasets left behind fill the page cache with dirty
    # pages, and the disk's writeback then slows every later write (by 3x here).
    shutil.rmtree(out[2])
    if extra:  # the byte tokenizer: the floor of writing these arrays, one core, each compression
        examples = Dataset(out[1]).read(0, params["n_examples"])
        rows = params["files"][0]["n_examples"]
        t["plain_h5py_write"] = median_seconds(lambda: _plain_write(examples, rows, tmp / "plain"), repeats, warmup=0)
        shutil.rmtree(tmp / "plain")
        del examples
        t["preprocess_1_process_1_core"] = median_seconds(lambda: _one_core(lambda: run(1)), repeats, warmup=0)
        r["compression"] = {}
        for c in COMPRESSIONS:
            dest = tmp / f"byte_{c}"
            seconds = median_seconds(lambda: run(1, c, dest), repeats, warmup=0)
            ds = Dataset(dest)
            read = median_seconds(lambda: _raw(ds.files), repeats, warmup=0)
            r["compression"][c] = {"preprocess_mb_per_s": mb / seconds,
                                   "disk_mb": sum(f.stat().st_size for f in ds.files) / 1e6,
                                   "raw_read_mb_per_s": _example_mb(ds) / read}
            shutil.rmtree(dest)
    r["median_seconds"] = t
    r["mb_per_s"] = {k: mb / v for k, v in t.items()}
    r["preprocess_vs_tokenizer_only"] = t["tokenizer_only"] / t["preprocess_1_process"]
    r["speedup_2_processes"] = t["preprocess_1_process"] / t["preprocess_2_processes"]
    if extra:
        r["preprocess_vs_plain_write"] = t["plain_h5py_write"] / t["preprocess_1_process"]
        r["speedup_2_processes_vs_1_core"] = t["preprocess_1_process_1_core"] / t["preprocess_2_processes"]
    return r, out[1]


def _raw(files):
    for path in files:
        with h5py.File(path, "r") as f:
            f["data"][()]


def _example_mb(ds):
    return ds.n_examples * int(np.prod(ds.example_shape)) * 4 / 1e6


def _epoch(data, batch_size, shuffle):
    stream = GlobalStream(data, shuffle=shuffle, seed=1)
    try:
        for start in range(0, stream.n, batch_size):
            stream.read(start, min(batch_size, stream.n - start))
    finally:
        stream.close()


def run(args):
    if args.batch_size < 1 or args.repeats < 1 or args.mb <= 0:
        raise ConfigError(f"--batch_size, --repeats and --mb must be positive, got {args.batch_size}, "
                          f"{args.repeats} and {args.mb}")
    result = {"benchmark": "input", "machine": machine(), "batch_size": args.batch_size, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = args.data
        if data is None:
            corpus = tmp / "corpus"
            make_corpus(corpus, args.mb)
            result["byte"], data = _preprocessing(corpus, tmp, "byte", args.repeats, extra=True)
            try:
                train_bpe(corpus, tmp / "gpt2-bpe.json")
            except ImportError:
                result["bpe"] = None  # the optional tokenizers package is not installed
            else:
                result["bpe"], bpe_data = _preprocessing(corpus, tmp, str(tmp / "gpt2-bpe.json"), args.repeats,
                                                         extra=False)
                shutil.rmtree(bpe_data)
        ds = Dataset(data)
        mb = _example_mb(ds)
        t = {"raw_h5py": median_seconds(lambda: _raw(ds.files), args.repeats, warmup=1),
             "loader_in_order": median_seconds(lambda: _epoch(data, args.batch_size, False), args.repeats, warmup=1),
             "loader_shuffled": median_seconds(lambda: _epoch(data, args.batch_size, True), args.repeats, warmup=1)}
    result.update({
        "n_examples": ds.n_examples, "files": len(ds.files), "mb": mb, "median_seconds": t,
        "mb_per_s": {k: mb / v for k, v in t.items()},
        "in_order_vs_raw": t["raw_h5py"] / t["loader_in_order"],
        "shuffled_vs_raw": t["raw_h5py"] / t["loader_shuffled"],
    })
    return result


def _report_preprocessing(name, r):
    m = r["mb_per_s"]
    rows = [["tokenizer only", f"{m['tokenizer_only']:.1f}", "1.00"],
            ["preprocess, 1 process", f"{m['preprocess_1_process']:.1f}", f"{r['preprocess_vs_tokenizer_only']:.2f}"],
            ["preprocess, 2 processes", f"{m['preprocess_2_processes']:.1f}",
             f"{m['preprocess_2_processes'] / m['tokenizer_only']:.2f}"]]
    if "plain_h5py_write" in m:
        rows.insert(0, ["plain h5py write of the same arrays", f"{m['plain_h5py_write']:.1f}",
                        f"{m['plain_h5py_write'] / m['tokenizer_only']:.2f}"])
        rows.append(["preprocess, 1 process on 1 core", f"{m['preprocess_1_process_1_core']:.1f}",
                     f"{m['preprocess_1_process_1_core'] / m['tokenizer_only']:.2f}"])
    lines = [f"{name} tokenizer (vocabulary {r['vocab_size']:,}): {r['input_mb']:.1f} MB of text, {r['tokens']:,} "
             f"tokens, {r['examples']:,} examples of {SEQ} in {r['files']} files",
             table(rows, ["", "input MB/s", "vs tokenizer only"])]
    summary = f"preprocess / tokenizer only: {r['preprocess_vs_tokenizer_only']:.2f}"
    if "preprocess_vs_plain_write" in r:
        summary += f"; preprocess / plain h5py write: {r['preprocess_vs_plain_write']:.2f}"
    summary += f"; 2 processes / 1: {r['speedup_2_processes']:.2f}x"
    if "speedup_2_processes_vs_1_core" in r:
        summary += f" (/ 1 process on 1 core: {r['speedup_2_processes_vs_1_core']:.2f}x)"
    lines.append(summary + f"; outputs identical: {r['outputs_identical_1_and_2_processes']}")
    if "compression" in r:
        rows = [[c, f"{v['preprocess_mb_per_s']:.1f}", f"{v['disk_mb']:.0f}", f"{v['raw_read_mb_per_s']:.0f}"]
                for c, v in r["compression"].items()]
        lines.append(table(rows, ["--compression", "preprocess MB/s", "disk MB", "raw read MB/s"]))
    return lines


def report(result):
    lines = []
    for key, name in (("byte", "byte"), ("bpe", "GPT-2 BPE")):
        if result.get(key):
            lines += _report_preprocessing(name, result[key]) + [""]
        elif key in result:
            lines += [f"{name} tokenizer: skipped (pip install tokenizers)", ""]
    m, t = result["mb_per_s"], result["median_seconds"]
    rows = [[name, f"{t[key]:.3f}", f"{m[key]:.0f}"]
            for name, key in (("raw h5py read", "raw_h5py"), ("loader, in order", "loader_in_order"),
                              ("loader, shuffled", "loader_shuffled"))]
    lines += [f"one epoch of {result['n_examples']:,} examples in {result['files']} files ({result['mb']:.0f} MB), "
              f"batch {result['batch_size']}, median of {result['repeats']}",
              table(rows, ["", "s", "MB/s"]),
              f"loader / raw h5py: {result['in_order_vs_raw']:.2f} in order, {result['shuffled_vs_raw']:.2f} shuffled"]
    return "\n".join(lines)
