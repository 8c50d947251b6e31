"""`wse data preprocess|inspect|verify`: the HDF5 datasets a run reads."""
import argparse

from data_tools import COMPRESSIONS, DEFAULT_COMPRESSION
from pyapi.cli.options import print_json_or_lines
# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).


def _cmd_data_preprocess(args):
    from data_tools.preprocess import preprocess_arrays, preprocess_text
    from wse_core.errors import ConfigError

    if args.format == "arrays":
        if len(args.input) != 1:
            raise ConfigError("--format arrays: expected one --input FILE.npz")
        params = preprocess_arrays(args.input[0], args.output_dir, samples_per_file=args.samples_per_file,
                                   compression=args.compression, overwrite=args.overwrite)
    else:
        if args.max_seq_length is None:
            raise ConfigError("--max_seq_length: required for text inputs")
        params = preprocess_text(args.input, args.output_dir, args.max_seq_length, tokenizer=args.tokenizer,
                                 samples_per_file=args.samples_per_file, processes=args.processes,
                                 seed=args.seed, jsonl_key=args.jsonl_key, compression=args.compression,
                                 overwrite=args.overwrite)
    from wse_core.checks import plural

    summary = f"wrote {params['n_examples']:,} examples in {plural(len(params['files']), 'file')} to {args.output_dir}"
    if params["format"] == "lm":
        summary += (f" ({params['n_tokens']:,} tokens, {params['input_bytes'] / 1e6:.1f} MB in "
                    f"{params['seconds']:.1f} s = {params['input_bytes'] / 1e6 / params['seconds']:.2f} MB/s)")
    print(summary)
    return 0


def _cmd_data_inspect(args):
    from data_tools.dataset import inspect_dataset

    print_json_or_lines(inspect_dataset(args.dir), args.json)
    return 0


def _cmd_data_verify(args):
    from data_tools.lmdata import verify_dataset

    from wse_core.checks import plural

    s = verify_dataset(args.dir)
    print(f"{args.dir}: ok ({s['format']}, {plural(s['files'], 'file')}, {s['n_examples']:,} examples)")
    return 0


#: `wse data preprocess --help`: what comes in, what goes out.
PREPROCESS = """Tokenize text (or take arrays) into the HDF5 shards a run reads, with a data_params.json beside them.

Text inputs are .txt files (one document each), .jsonl files (one document per line, in the "text"
field or --jsonl_key), directories (searched recursively for both), glob patterns, and 'stdlib':
the .py sources of this Python's standard library, a corpus every machine has offline. Each
document is followed by the end-of-text token; the token stream is cut into examples of
--max_seq_length inputs whose labels are the inputs shifted by one, so every token is predicted
once, and the last example is padded (masked out of the loss). --seed N shuffles the examples
before they are written. The output is the same for any --processes.

With --format arrays, one .npz file holding features [n, ...] and labels [n] becomes a dataset of
n examples (for the fc_mlp model)."""
_DIR_HELP = "a dataset's directory (its .h5 files and data_params.json)"


def add_data(sub, chosen):
    p = sub.add_parser("data", help="prepare, inspect and verify HDF5 datasets",
                       description="Prepare, inspect and verify HDF5 datasets (Model Zoo LMData layout).")
    data_sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True,
                                help="`wse data ACTION --help` says more")
    dp = data_sub.add_parser("preprocess", help="tokenize text (or arrays) into HDF5 shards",
                             description=PREPROCESS, formatter_class=argparse.RawDescriptionHelpFormatter)
    dp.add_argument("--input", nargs="+", required=True, metavar="PATH",
                    help="files (.txt, .jsonl), directories, globs, or 'stdlib'; with --format arrays one .npz")
    dp.add_argument("--output_dir", required=True, metavar="DIR", help="where the .h5 files and data_params.json go")
    dp.add_argument("--max_seq_length", type=int, metavar="S", help="tokens per example (text inputs)")
    dp.add_argument("--tokenizer", default="byte", help="'byte' (default) or a Hugging Face tokenizer.json")
    dp.add_argument("--samples_per_file", type=int, metavar="K",
                    help="examples per .h5 file (default: about 64 MiB of examples per file)")
    dp.add_argument("--processes", type=int, default=1, metavar="P", help="tokenize with P processes")
    dp.add_argument("--seed", type=int, help="shuffle the examples with this seed (default: keep order)")
    dp.add_argument("--jsonl_key", default="text", help="field of the .jsonl records holding the text")
    dp.add_argument("--compression", default=DEFAULT_COMPRESSION, choices=list(COMPRESSIONS),
                    help=f"HDF5 compression of the examples (default {DEFAULT_COMPRESSION}: fastest to write and read, "
                    "see `wse bench input`)")
    dp.add_argument("--format", default="text", choices=["text", "arrays"],
                    help="text (default): documents to tokenize; arrays: an .npz of features and labels")
    dp.add_argument("--overwrite", action="store_true", help="replace a dataset already in --output_dir")
    dp.set_defaults(func=_cmd_data_preprocess)
    dp = data_sub.add_parser("inspect", help="files, examples, tokens, vocabulary, one decoded example",
                             description="Print what a dataset holds: its format, files, examples, tokens, "
                                         "vocabulary and tokenizer, and one example decoded.")
    dp.add_argument("dir", metavar="DIR", help=_DIR_HELP)
    dp.add_argument("--json", action="store_true", help="print JSON")
    dp.set_defaults(func=_cmd_data_inspect)
    dp = data_sub.add_parser("verify", help="check every file; exit 1 naming the first fault",
                             description="Read every file of a dataset and check its examples (shapes, types, "
                                         "token ids within the vocabulary) against data_params.json; exit 1 "
                                         "naming the first fault.")
    dp.add_argument("dir", metavar="DIR", help=_DIR_HELP)
    dp.set_defaults(func=_cmd_data_verify)
