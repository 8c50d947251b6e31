"""What several commands share: an option under both spellings, a training job's arguments, the
runconfig overrides they make, and output as JSON or aligned lines."""


def opt(parser, name, **kwargs):
    """Add an option under both spellings: --output_dir and --output-dir."""
    names = [name] + ([name.replace("_", "-")] if "_" in name else [])
    kwargs.setdefault("dest", name.lstrip("-"))
    parser.add_argument(*names, **kwargs)


def job_args(parser, model_dir=True):
    """What every command that takes a training job takes: PARAMS and the overrides of its runconfig."""
    parser.add_argument("params", metavar="PARAMS", help="params YAML file")
    opt(parser, "--num_csx", type=int, metavar="N", help="override runconfig.num_csx")
    opt(parser, "--execution_strategy", choices=["weight_streaming", "pipeline", "auto"],
        help="override runconfig.execution_strategy")
    if model_dir:
        opt(parser, "--model_dir", metavar="DIR", help="override runconfig.model_dir")
    parser.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a params value (repeatable)")


def overrides(args):
    """--set, plus the options that are shorthands for a runconfig key."""
    out = list(args.set or [])
    for key in ("num_csx", "execution_strategy"):
        if getattr(args, key, None) is not None:
            out.append(f"runconfig.{key}={getattr(args, key)}")
    return out


def print_json_or_lines(obj, as_json):
    import json

    if as_json:
        print(json.dumps(obj, indent=2))
    else:
        width = max(map(len, obj), default=0) + 1
        for key, value in obj.items():
            print(f"{key:<{width}} {value}")
