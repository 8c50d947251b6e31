"""`wse serve`: a trained model behind an OpenAI-compatible HTTP API (pyapi.serve)."""


def _cmd_serve(args):
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec("aiohttp") is None:
        raise ValueError("the optional 'aiohttp' package is not installed (pip install 'wse-cluster[serve]')")
    from pyapi.serve import Limits, Server

    api_key = args.api_key or os.environ.get("WSE_API_KEY") or None
    given = {k: getattr(args, k) for k in ("max_prompt_tokens", "max_tokens", "max_streams")}
    cluster = None if args.num_csx is None else {"num_csx": args.num_csx, "placement": args.placement,
                                                 "stream": sys.stderr}
    server = Server.load(args.model, args.checkpoint_path, api_key=api_key, cluster=cluster,
                         limits=Limits(**{k: v for k, v in given.items() if v is not None}))
    if api_key is None and args.host not in ("127.0.0.1", "::1", "localhost"):
        print(f"wse serve: warning: --host {args.host} without an API key: whoever reaches the port can use the "
              "model (give --api_key or WSE_API_KEY)", file=sys.stderr)
    server.run(args.host, args.port,
               on_ready=lambda url: print(f"serving {server.name} on {url} ({server.describe()})", flush=True))
    print(f"wse serve: stopped serving {server.name}", flush=True)
    return 0


def add_serve(sub, chosen):
    p = sub.add_parser("serve", help="serve a trained model over an OpenAI-compatible HTTP API",
                       description="Serve a model_dir (its latest checkpoint), a checkpoint or a Hugging Face "
                                   "directory at /v1/completions (and /v1/chat/completions when its tokenizer has "
                                   "a chat template), with continuous batching of the requests of the moment. "
                                   "Prints one line when ready; SIGINT or SIGTERM stops it.")
    p.add_argument("model", help="a model_dir, a checkpoint directory, or a Hugging Face model directory; its "
                                 "directory's name is the model's name in the API")
    p.add_argument("--checkpoint_path", help="a checkpoint of the model_dir other than its latest")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine "
                                                       "only; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=8000, help="the port (default 8000; 0: a free one, printed when ready)")
    p.add_argument("--api_key", help="require 'Authorization: Bearer KEY' (or set WSE_API_KEY, which other users' "
                                     "ps does not show)")
    p.add_argument("--max_prompt_tokens", type=int, help="longest prompt taken, in tokens (default: the model's "
                                                         "positions minus one)")
    p.add_argument("--max_tokens", type=int, help="most tokens a request may ask per prompt (default: the model's "
                                                  "positions minus one)")
    p.add_argument("--max_streams", type=int, help="sequences generating at once over all requests (a request of "
                                                   "k prompts takes k); a request beyond gets 429 (default 16)")
    p.add_argument("--num_csx", type=int, help="generate on this many emulated CS-2s (an inference job of MPI "
                                               "ranks, held while the server runs; restarted if a rank fails); "
                                               "default: in this process, with the same tokens")
    p.add_argument("--placement", choices=("resident", "streamed"), help="with --num_csx: keep the weights on the "
                                                                         "wafers or stream them from MemoryX every "
                                                                         "pass (default: resident when they fit)")
    p.set_defaults(func=_cmd_serve)
