"""`wse serve`: a trained model behind an OpenAI-compatible HTTP API (pyapi.serve)."""
import importlib.util
import os
import sys

# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).


def _cmd_serve(args):
    from wse_core.errors import ConfigError

    if importlib.util.find_spec("aiohttp") is None:
        raise ConfigError("the optional 'aiohttp' package is not installed (pip install 'wse-cluster[serve]')")
    from pyapi.serve import Limits, Server

    api_key = args.api_key or os.environ.get("WSE_API_KEY") or None
    given = {k: getattr(args, k) for k in ("max_prompt_tokens", "max_tokens", "max_streams")}
    if args.submit:
        return _submit(args, given, api_key)
    cluster = None if args.num_csx is None else {"num_csx": args.num_csx, "placement": args.placement,
                                                 "peer_timeout": args.peer_timeout, "log_dir": args.log_dir,
                                                 "stream": sys.stderr}
    server = Server.load(args.model, args.checkpoint_path, api_key=api_key, cluster=cluster,
                         limits=Limits.given(given))
    if api_key is None and args.host not in ("127.0.0.1", "::1", "localhost"):
        print(f"wse serve: warning: --host {args.host} without an API key: whoever reaches the port can use the "
              "model (give --api_key or WSE_API_KEY)", file=sys.stderr)
    server.run(args.host, args.port,
               on_ready=lambda url: print(f"serving {server.name} on {url} ({server.describe()})", flush=True))
    print(f"wse serve: stopped serving {server.name}", flush=True)
    return 0


def _submit(args, given, api_key):
    """``wse serve --submit``: the server as a job of the appliance, holding its CS-2s until cancelled."""
    from pyapi.client import Client
    from wse_core.errors import ConfigError

    if args.api_key is not None:
        raise ConfigError("--api_key: not with --submit (the appliance keeps no secrets in its job table); the "
                          "job serves 127.0.0.1 only, or the --host you give")
    if api_key is not None:
        print("wse serve: WSE_API_KEY is not sent with --submit: the job serves without an API key",
              file=sys.stderr)
    if args.num_csx is None:
        raise ConfigError("--submit: give --num_csx, the CS-2s the job holds from the appliance's pool")
    checkpoint = args.checkpoint_path and os.path.abspath(args.checkpoint_path)
    serve = {"model": args.model, "checkpoint_path": checkpoint, "num_csx": args.num_csx, "host": args.host,
             "port": args.port, "placement": args.placement, "peer_timeout": args.peer_timeout,
             "log_dir": args.log_dir and os.path.abspath(args.log_dir), **given}
    handle = Client(args.socket).submit_serve({k: v for k, v in serve.items() if v is not None},
                                              max_restarts=args.max_restarts, name=args.name)
    st = handle.status()
    print(f"job {handle.id}: {st['state']} ({st['num_csx']} CS-2s, serving {handle.model_dir}); its log says where "
          f"(`wse logs {handle.id}`), `wse cancel {handle.id}` stops it")
    return 0


def add_job_options(p, command, chosen):
    """``--peer_timeout`` and ``--log_dir``: the inference job's options of `wse serve` and `wse generate`.
    Their help, which names defaults of a module that loads wse_core, only for the command chosen."""
    timeout = logs = None
    if chosen[:1] == (command,):
        from mpi_launch.inference import KEPT, LOGS, PEER_TIMEOUT

        timeout = (f"with --num_csx: seconds a rank of the inference job may stop answering (its process stopped, "
                   f"or silent beyond twice what its passes so far took) before the job is ended and the fault "
                   f"named; training's runconfig.peer_timeout, with its rule and default ({PEER_TIMEOUT})")
        logs = (f"with --num_csx: where the logs of failed inference jobs are kept, the last {KEPT} (default: "
                f"MODEL/{LOGS})")
    p.add_argument("--peer_timeout", type=int, metavar="SECONDS", help=timeout)
    p.add_argument("--log_dir", help=logs)


def add_serve(sub, chosen):
    p = sub.add_parser("serve", help="serve a trained model over an OpenAI-compatible HTTP API",
                       description="Serve a model_dir (its latest checkpoint), a checkpoint or a Hugging Face "
                                   "directory at /v1/completions (and /v1/chat/completions when its tokenizer has "
                                   "a chat template), with continuous batching of the requests of the moment. "
                                   "Prints one line when ready; SIGINT or SIGTERM stops it.")
    p.add_argument("model", metavar="MODEL", help="a model_dir, a checkpoint directory, or a Hugging Face model "
                                                  "directory; its directory's name is the model's name in the API")
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
    add_job_options(p, "serve", chosen)
    p.add_argument("--submit", action="store_true", help="run the server as a job of the appliance (with "
                                                           "--num_csx): queued, listed by `wse jobs`, stopped by "
                                                           "`wse cancel`, restarted after a fault")
    p.add_argument("--max_restarts", type=int, default=0, help="with --submit: restarts after a fault (default 0)")
    p.add_argument("--name", help="with --submit: the job's name (default: serve MODEL)")
    p.add_argument("--socket", help="with --submit: the appliance's socket (default: $WSE_APPLIANCE_SOCKET, "
                                    "your own appliance, then the machine's)")
    p.set_defaults(func=_cmd_serve)
