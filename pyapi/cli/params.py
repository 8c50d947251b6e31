"""`wse params convert|keys`: Model Zoo params files in the other layout, and each key's fate."""
import json
import sys
import warnings
from pathlib import Path

from pyapi.cli.options import PARAMS_HELP
# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).


def _cmd_params_convert(args):
    import yaml

    from pyapi import modelzoo
    from pyapi.params import read
    from wse_core.errors import ConfigError

    raw = read(args.params)
    if modelzoo.is_trainer_layout(raw):
        out, dropped = modelzoo.flatten(raw)
        if dropped:
            raise ConfigError(f"{args.params}: keys with no place in the flat layout: {', '.join(dropped)}")
        layout = "flat (train_input, model, optimizer, runconfig)"
    else:
        out, dropped = modelzoo.to_trainer(raw)
        if dropped:
            print(f"wse params convert: dropped (no place in the trainer layout): {', '.join(dropped)}",
                  file=sys.stderr)
        layout = "trainer (trainer.init, trainer.fit)"
    text = yaml.safe_dump(out, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output} ({layout} layout)")
    else:
        sys.stdout.write(text)
    return 0


def _cmd_params_keys(args):
    from pyapi.params import ParamsError, check, read

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _, report = check(read(args.params), args.params, args.set)
            error = None
        except ParamsError as exc:
            if exc.report is None:
                raise
            report, error = exc.report, exc
    fates = {report.in_file(path): fate for path, fate in report.fates.items()}  # as the file names its keys
    if args.json:
        print(json.dumps({"fates": fates, "notes": report.notes}, indent=2))
    else:
        width = max(map(len, fates), default=0) + 1
        for path, fate in fates.items():
            print(f"{path:<{width}} {fate}")
        for note in report.notes:
            print(f"note: {note}")
        counts = {}
        for fate in fates.values():
            kind = fate.split(":")[0].split(" (")[0].split(" of ")[0]
            counts[kind] = counts.get(kind, 0) + 1
        print("; ".join(f"{n} {kind}" for kind, n in counts.items()))
    return 1 if error else 0


def add_params(sub, chosen):
    p = sub.add_parser("params", help="read Model Zoo params files: each key's fate, and the other layout",
                       description="Model Zoo's two params layouts (flat: train_input/model/optimizer/runconfig; "
                                   "trainer: trainer.init/trainer.fit) and what wse-cluster does with each key.")
    pa_sub = p.add_subparsers(dest="params_command", metavar="ACTION", required=True,
                              help="`wse params ACTION --help` says more")
    pp = pa_sub.add_parser("convert", help="write PARAMS in the other layout (flat <-> trainer)",
                           description="Write PARAMS in Model Zoo's other layout: a flat file as trainer.init/"
                                       "trainer.fit, a trainer file as train_input/model/optimizer/runconfig. Keys "
                                       "with no place in the other layout are named: dropped with a warning on the "
                                       "way to the trainer layout, refused on the way to the flat one.")
    pp.add_argument("params", metavar="PARAMS", help=PARAMS_HELP)
    pp.add_argument("-o", "--output", metavar="FILE", help="write here (default: standard output)")
    pp.set_defaults(func=_cmd_params_convert)
    pp = pa_sub.add_parser("keys", help="the fate of every key: honoured, tuning (warned) or refused",
                           description="Print each key of PARAMS with its fate; exit 1 if any is refused.")
    pp.add_argument("params", metavar="PARAMS", help=PARAMS_HELP)
    pp.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a params value (repeatable)")
    pp.add_argument("--json", action="store_true", help="print JSON")
    pp.set_defaults(func=_cmd_params_keys)
