"""The input pipeline: preprocessing throughput, and the loader against raw h5py reads of the same files.

    wse bench input [--json PATH] [--data DIR] [--batch_size B] [--repeats R]

Without ``--data`` it first preprocesses the standard-library corpus (byte tokenizer,
max_seq_length 256) with 1 and then 2 processes, timing each (input MB/s), and checks that both
outputs are identical. The loader (one worker, in order and shuffled) is timed over one full
epoch against a raw ``h5py`` read of every file's ``data`` in the same run; bytes are those of
the int32 examples delivered.
"""
import tempfile
import time
from pathlib import Path

import h5py

from bench.harness import machine, median_seconds, table
from data_tools.dataset import Dataset, Loader
from data_tools.preprocess import preprocess_text


def add_arguments(parser):
    parser.add_argument("--data", metavar="DIR", help="an existing LM dataset (default: build one from stdlib)")
    for flag in ("--batch_size", "--batch-size"):
        parser.add_argument(flag, dest="batch_size", type=int, default=32, help="loader batch size")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")


def _epoch(data, batch_size, shuffle):
    loader = Loader(data, batch_size, shuffle=shuffle, seed=1)
    try:
        for _ in range(-(-loader.n_local // batch_size)):
            loader.next_batch()
    finally:
        loader.close()


def _raw(files):
    for path in files:
        with h5py.File(path, "r") as f:
            f["data"][()]


def run(args):
    if args.batch_size < 1 or args.repeats < 1:
        raise ValueError(f"--batch_size and --repeats must be >= 1, got {args.batch_size} and {args.repeats}")
    result = {"benchmark": "input", "machine": machine(), "batch_size": args.batch_size, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            pre = {}
            for procs in (1, 2):
                out = Path(tmp) / f"stdlib_p{procs}"
                t0 = time.perf_counter()
                params = preprocess_text(["stdlib"], out, 256, processes=procs, samples_per_file=2048, progress=False)
                pre[procs] = (time.perf_counter() - t0, params)
            same = all((Path(tmp) / "stdlib_p1" / s["name"]).read_bytes() ==
                       (Path(tmp) / "stdlib_p2" / s["name"]).read_bytes() for s in pre[1][1]["files"])
            mb = pre[1][1]["input_bytes"] / 1e6
            result["preprocess"] = {"input_mb": mb, "tokens": pre[1][1]["n_tokens"],
                                    "seconds_1_process": pre[1][0], "seconds_2_processes": pre[2][0],
                                    "mb_per_s_1_process": mb / pre[1][0], "mb_per_s_2_processes": mb / pre[2][0],
                                    "outputs_identical": same}
            data = Path(tmp) / "stdlib_p1"
        ds = Dataset(data)
        nbytes = ds.n_examples * int(ds.example_shape[0] * ds.example_shape[1]) * 4
        t_raw = median_seconds(lambda: _raw(ds.files), args.repeats, warmup=1)
        t_seq = median_seconds(lambda: _epoch(data, args.batch_size, False), args.repeats, warmup=1)
        t_shuf = median_seconds(lambda: _epoch(data, args.batch_size, True), args.repeats, warmup=1)
    result.update({
        "n_examples": ds.n_examples, "files": len(ds.files), "mb": nbytes / 1e6,
        "median_seconds": {"raw_h5py": t_raw, "loader": t_seq, "loader_shuffled": t_shuf},
        "examples_per_s": {"raw_h5py": ds.n_examples / t_raw, "loader": ds.n_examples / t_seq,
                           "loader_shuffled": ds.n_examples / t_shuf},
        "mb_per_s": {"raw_h5py": nbytes / 1e6 / t_raw, "loader": nbytes / 1e6 / t_seq,
                     "loader_shuffled": nbytes / 1e6 / t_shuf},
        "loader_fraction_of_raw": t_raw / t_seq,
        "shuffled_fraction_of_raw": t_raw / t_shuf,
    })
    return result


def report(result):
    lines = []
    if "preprocess" in result:
        p = result["preprocess"]
        lines.append(f"preprocess stdlib ({p['input_mb']:.1f} MB, {p['tokens']:,} tokens): "
                     f"{p['mb_per_s_1_process']:.2f} MB/s with 1 process, {p['mb_per_s_2_processes']:.2f} MB/s "
                     f"with 2; outputs identical: {p['outputs_identical']}")
    eps, mbs, t = result["examples_per_s"], result["mb_per_s"], result["median_seconds"]
    rows = [[name, f"{t[key]:.3f}", f"{eps[key]:,.0f}", f"{mbs[key]:.1f}"]
            for name, key in (("raw h5py read", "raw_h5py"), ("loader, in order", "loader"),
                              ("loader, shuffled", "loader_shuffled"))]
    lines += [f"one epoch of {result['n_examples']:,} examples in {result['files']} files ({result['mb']:.1f} MB), "
              f"batch {result['batch_size']}, median of {result['repeats']}",
              table(rows, ["", "s", "examples/s", "MB/s"]),
              f"loader / raw h5py: {result['loader_fraction_of_raw']:.2f} in order, "
              f"{result['shuffled_fraction_of_raw']:.2f} shuffled"]
    return "\n".join(lines)
