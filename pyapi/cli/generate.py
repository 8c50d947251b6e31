"""`wse generate`: text from a trained model (pyapi.generate)."""
import json
import sys

# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).


def _cmd_generate(args):
    from pyapi.generate import Generator
    from wse_core.checks import plural
    from wse_core.errors import ConfigError

    prompts = list(args.prompt or [])
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:  # a file that is not text is the user's to fix, in a line
            raise ConfigError(f"--prompt_file {args.prompt_file}: {getattr(exc, 'strerror', None) or exc}") from None
    if not prompts:
        raise ConfigError("give a prompt: --prompt TEXT or --prompt_file FILE")
    gen = Generator.load(args.model, args.checkpoint_path)
    new = gen.new_tokens(args.max_new_tokens)
    stream = len(prompts) == 1 and not args.json

    def on_token(k, token, text):
        sys.stdout.write(text)
        sys.stdout.flush()

    cluster = {} if args.num_csx is None else {"num_csx": args.num_csx, "max_streams": len(prompts),
                                                  "placement": args.placement, "peer_timeout": args.peer_timeout,
                                                  "log_dir": args.log_dir, "stream": sys.stderr}
    with gen.engine(**cluster) as engine:
        if args.num_csx is not None:
            print(f"on {plural(args.num_csx, 'CS-2')}: {engine.latency.why}", file=sys.stderr)
        if stream:
            sys.stdout.write(prompts[0])
        done = gen.generate(prompts, new, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, on_token=on_token if stream else None, engine=engine)
    if stream:
        print()
    elif args.json:
        print(json.dumps([{"prompt": c.prompt, "tokens": c.tokens, "text": c.text, "finish_reason": c.finish_reason}
                          for c in done], indent=1))
    else:
        for c in done:
            print(f"{c.prompt}{c.text}")
    for k, c in enumerate(done):  # said when asked for more: finish_reason "length" does not say which limit
        if args.max_new_tokens is not None and c.finish_reason == "length" and len(c.tokens) < new:
            which = f"prompt {k}: " if len(done) > 1 else ""
            print(f"wse generate: {which}stopped at the model's {gen.capacity} positions "
                  f"(model.max_position_embeddings): {len(c.prompt_ids)} of the prompt, {len(c.tokens)} of the "
                  f"{new} new tokens asked", file=sys.stderr)
    return 0


def add_generate(sub, chosen):
    from pyapi.cli.serve import add_job_options

    p = sub.add_parser("generate", help="generate text from a trained model",
                       description="Generate text from a model_dir (its latest checkpoint), a checkpoint or a "
                                   "Hugging Face directory, with the training data's tokenizer; greedy unless "
                                   "--temperature is given. One prompt is printed as its tokens come.")
    p.add_argument("model", metavar="MODEL",
                   help="a model_dir, a checkpoint directory, or a Hugging Face model directory")
    p.add_argument("--checkpoint_path", help="a checkpoint of the model_dir other than its latest")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    p.add_argument("--prompt_file", help="a file of prompts, one per line")
    p.add_argument("--max_new_tokens", type=int, help="tokens to generate per prompt, at most the model's positions "
                                                      "less one (default: 64, as many as the positions leave room for)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above: sampling")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top_p", type=float, default=1.0, help="sample among the likeliest tokens of this total "
                                                            "probability (1: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (the same seed, the same text)")
    p.add_argument("--json", action="store_true", help="print the completions as JSON")
    p.add_argument("--num_csx", type=int, help="run on this many emulated CS-2s (MPI ranks, with MemoryX and "
                                               "SwarmX); default: in this process, with the same tokens")
    p.add_argument("--placement", choices=("resident", "streamed"), help="with --num_csx: keep the weights on the "
                                                                         "wafers or stream them from MemoryX every "
                                                                         "pass (default: resident when they fit)")
    add_job_options(p, "generate", chosen)
    p.set_defaults(func=_cmd_generate)
