"""`wse checkpoint info|verify|convert|from-hf`: checkpoints, read, checked and written in other formats."""
from pyapi.cli.options import print_json_or_lines
# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).


def _tensors(params, in_all):
    """What info and verify say of a checkpoint's tensors: the parameters', and with the rest (the
    optimizer's state, sparse patterns) when there is more: ``52 tensors (156 in all, with the optimizer's state)``."""
    from wse_core.checks import plural

    return plural(params, "tensor") + (f" ({in_all:,} in all, with the optimizer's state)" if in_all != params else "")


def _cmd_checkpoint_info(args):
    from data_tools.checkpoint import Checkpoint

    info = Checkpoint(args.path).info()
    if not args.json:
        info["shards"] = ", ".join(f"{s['name']} ({s['parameters']:,} params, {s['bytes']:,} B)"
                                   for s in info["shards"])
        info["n_tensors"] = _tensors(info["n_tensors"], info.pop("n_tensors_in_all"))
        info["params_yaml"] = f"{len(info['params_yaml'].splitlines())} lines"
        if info["numerics"]:
            from wse_core.numerics import describe

            info["numerics"] = describe(info["numerics"])
    print_json_or_lines(info, args.json)
    return 0


def _cmd_checkpoint_verify(args):
    from data_tools.checkpoint import Checkpoint

    ckpt = Checkpoint(args.path)
    ckpt.verify()
    from wse_core.checks import plural

    print(f"{ckpt.dir}: ok (step {ckpt.step}, {plural(ckpt.num_shards, 'shard')}, "
          f"{_tensors(len(ckpt.param_names), len(ckpt.tensors))})")
    return 0


def _cmd_checkpoint_convert(args):
    if args.to == "hf":
        from data_tools.hf import to_hf

        out = to_hf(args.path, args.output)
    else:
        from data_tools.checkpoint import Checkpoint

        out = Checkpoint(args.path).convert(args.to, args.output)
    print(f"wrote {out}")
    return 0


def _cmd_checkpoint_from_hf(args):
    import yaml

    from data_tools.hf import from_hf

    path, model = from_hf(args.path, args.output)
    print(f"wrote {path} (step 0, weights only: the optimizer starts fresh)")
    print("a run starts from it with `wse fit PARAMS --checkpoint_path " f"{path}` and this model section in PARAMS:")
    print(yaml.safe_dump({"model": model}, sort_keys=False), end="")
    return 0


_PATH_HELP = "a model_dir (its latest checkpoint), a checkpoint directory or its index.h5"


def add_checkpoint(sub, chosen):
    p = sub.add_parser("checkpoint", help="inspect, verify and convert checkpoints",
                       description="Inspect, verify and convert checkpoints (a model_dir, a checkpoint "
                                   "directory or its index.h5).")
    ck_sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True,
                              help="`wse checkpoint ACTION --help` says more")
    cp = ck_sub.add_parser("info", help="step, shards, tensors, loader position",
                           description="Print what a checkpoint holds: its step, its shards and their sizes, the "
                                       "tensors, where the data loader stood, and the numerics environment and "
                                       "params of the run that wrote it.")
    cp.add_argument("path", metavar="PATH", help=_PATH_HELP)
    cp.add_argument("--json", action="store_true", help="print JSON")
    cp.set_defaults(func=_cmd_checkpoint_info)
    cp = ck_sub.add_parser("verify", help="check SHA-256 of every shard; exit 1 naming the damaged tensor",
                           description="Check every shard of a checkpoint against the SHA-256 sums written with "
                                       "it; exit 1 naming the damaged tensor.")
    cp.add_argument("path", metavar="PATH", help=_PATH_HELP)
    cp.set_defaults(func=_cmd_checkpoint_verify)
    cp = ck_sub.add_parser("convert", help="write the weights as npz, h5, a torch state_dict or a Hugging Face "
                                           "directory",
                           description="Write a checkpoint's weights in another format: one .npz or .h5 file, a "
                                       "PyTorch state_dict, or a directory transformers loads (--to hf).")
    cp.add_argument("path", metavar="PATH", help=_PATH_HELP)
    cp.add_argument("--to", required=True, choices=["npz", "h5", "torch", "hf"],
                    help="hf: a directory with config.json and model.safetensors (GPT2LMHeadModel, LlamaForCausalLM) "
                         "and the training data's tokenizer (AutoTokenizer)")
    cp.add_argument("--output", required=True, metavar="FILE", help="the file (with --to hf, the directory) to write")
    cp.set_defaults(func=_cmd_checkpoint_convert)
    cp = ck_sub.add_parser("from-hf", help="a checkpoint a run can start from, from a Hugging Face model directory",
                           description="Read DIR (config.json, *.safetensors of a GPT2LMHeadModel or "
                                       "LlamaForCausalLM) and write a step-0, weights-only checkpoint into "
                                       "--output (a model_dir); print the model section a run on it needs.")
    cp.add_argument("path", metavar="DIR", help="a Hugging Face model directory")
    cp.add_argument("--output", required=True, metavar="MODEL_DIR", help="the model_dir to write the checkpoint into")
    cp.set_defaults(func=_cmd_checkpoint_from_hf)
