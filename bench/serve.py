"""`wse serve` against transformers' generate: requests/s and tokens/s, and the emulated hardware's time per output token.

    wse bench serve [--json PATH] [--requests 16] [--clients 8] [--prompt_tokens 32] [--new_tokens 32] [--num_csx N]

A GPT-2 in the shape of ``wse bench stream``'s (4 layers x 256, 4 heads, byte vocabulary, 256
positions), its weights as training starts them, served by ``wse serve`` (a subprocess, a free
port; with ``--num_csx``, generating on that many emulated CS-2s, an inference job of MPI ranks):
``--clients`` threads send ``--requests`` greedy completions, each a prompt of
``--prompt_tokens`` token ids of the standard library's text and ``max_tokens`` ``--new_tokens``;
the wall time from the first request sent to the last answer. The baseline, in this process on the
same cores: the same weights exported for transformers (``data_tools.hf.to_hf``) and
``GPT2LMHeadModel.generate(do_sample=False)`` on the same prompts, one prompt at a time and all of
them in one call (left-padded), the same end-of-text ending a text early on both sides. Beside them:
the wall clock's time per output token of the server (the run's time over the tokens each client
received, ``--clients`` at a time) and the emulated CS-2's (``wse_core.perf.inference``, serving
``--clients`` sequences at once).
"""
import json
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.harness import machine, table
from wse_core.errors import JobError

#: Seconds the server may take to say it is ready (a bound only a hang reaches).
READY_S = 120
CONFIG = {"name": "gpt2", "vocab_size": 257, "hidden_size": 256, "num_hidden_layers": 4, "num_heads": 4,
          "max_position_embeddings": 256}


def add_arguments(parser):
    parser.add_argument("--requests", type=int, default=16, help="completions requested (default 16)")
    parser.add_argument("--clients", type=int, default=8, help="clients sending them at once (default 8)")
    parser.add_argument("--prompt_tokens", type=int, default=32, help="tokens of each prompt (default 32)")
    parser.add_argument("--new_tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    parser.add_argument("--num_csx", type=int, help="serve on this many emulated CS-2s (default: in the server's "
                                                    "process)")


def _model_dir(where, prompt_tokens, requests):
    """A model_dir of CONFIG at its initial weights, its data byte-tokenized, and the prompts."""
    import numpy as np
    import yaml

    from data_tools.checkpoint import save_checkpoint
    from data_tools.dataset import Dataset
    from data_tools.preprocess import preprocess_text
    from wse_core.models import build_model

    preprocess_text(["stdlib"], where / "data", prompt_tokens, progress=False)
    ds = Dataset(where / "data")
    prompts = [row.tolist() for row in ds.read(0, requests)[:, 0]]
    ds.close()
    model = build_model(CONFIG)
    params = {"train_input": {"data_dir": str(where / "data")}, "model": CONFIG}
    weights = {n: np.asarray(w) for n, w in model.init_params(0).items()}
    path = save_checkpoint(where / "model", 0, [(weights, {})], params_yaml=yaml.safe_dump(params))
    return model, path, prompts


def _serve(model_dir, prompts, new_tokens, clients, num_csx):
    """(wall seconds, completion tokens per request) of the prompts sent by ``clients`` threads."""
    log = open(model_dir.parent / "serve.log", "w+")  # the server's stderr: a file never fills up as a pipe can
    proc = subprocess.Popen([sys.executable, "-m", "pyapi.cli", "serve", str(model_dir), "--port", "0",
                             "--max_streams", str(clients), *(["--num_csx", str(num_csx)] if num_csx else [])],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], READY_S)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("serving "):
            log.seek(0)
            raise JobError(f"wse serve did not start within {READY_S} s: {line}{log.read()[-2000:]}")
        url = line.split(" on ")[1].split(" ")[0] + "/completions"
        todo, done, failed, lock = list(enumerate(prompts)), {}, [], threading.Lock()

        def client():
            while True:
                with lock:
                    if not todo or failed:
                        return
                    k, prompt = todo.pop(0)
                body = json.dumps({"model": "model", "prompt": prompt, "max_tokens": new_tokens,
                                   "temperature": 0}).encode()
                req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=600) as r:
                        done[k] = json.loads(r.read())["usage"]["completion_tokens"]
                except (OSError, ValueError, KeyError) as exc:  # an HTTP error is an OSError too
                    with lock:
                        failed.append(f"request {k}: {exc}")

        threads = [threading.Thread(target=client) for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if failed:
            raise JobError(f"wse serve: {failed[0]}")
        return wall, [done[k] for k in range(len(prompts))]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def _transformers(hf_dir, prompts, new_tokens):
    """(seconds one prompt at a time, tokens made; seconds for all prompts in one call, tokens made)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its loading bar would interleave with the table
    model = transformers.GPT2LMHeadModel.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    kwargs = {"max_new_tokens": new_tokens, "do_sample": False, "eos_token_id": eos, "pad_token_id": eos}

    def made(row, start):
        out = row[start:].tolist()
        return out.index(eos) if eos in out else len(out)

    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), **kwargs)  # warm-up
        t0 = time.perf_counter()
        one = [made(model.generate(torch.tensor([p]), **kwargs)[0], len(p)) for p in prompts]
        alone = time.perf_counter() - t0
        width = max(map(len, prompts))
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        together = time.perf_counter() - t0
    return alone, one, together, [made(row, width) for row in out]


def run(args):
    import torch

    from data_tools.hf import to_hf
    from wse_core.perf.inference import serve as simulate

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        model, path, prompts = _model_dir(where, args.prompt_tokens, args.requests)
        hf_dir = to_hf(path, where / "hf")
        wall, served = _serve(where / "model", prompts, args.new_tokens, args.clients, args.num_csx)
        alone, one, together, batched = _transformers(hf_dir, prompts, args.new_tokens)
    sim = simulate(model, batch=args.clients, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                   num_csx=args.num_csx or 1)
    tokens = sum(served)
    rounds = -(-args.requests // args.clients)  # the requests go through the server this many at a time
    return {
        "machine": machine(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "params": model.num_params(), "requests": args.requests, "clients": args.clients, "num_csx": args.num_csx,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "serve_s": wall, "serve_tokens": tokens, "serve_requests_per_s": args.requests / wall,
        "serve_tokens_per_s": tokens / wall,
        "hf_alone_s": alone, "hf_alone_tokens": sum(one), "hf_alone_tokens_per_s": sum(one) / alone,
        "hf_batched_s": together, "hf_batched_tokens": sum(batched), "hf_batched_tokens_per_s": sum(batched) / together,
        "serve_over_best_hf": (tokens / wall) / max(sum(one) / alone, sum(batched) / together),
        "wall_s_per_token": wall / rounds / max(1, statistics.mean(served)),
        "simulated_s_per_token": sim.tpot_s, "simulated_ttft_s": sim.ttft_s, "simulated_placement": sim.placement,
    }


def report(result):
    m, r = result["machine"], result
    where = f", on {r['num_csx']} CS-2s" if r.get("num_csx") else ""
    rows = [["wse serve, " + f"{r['clients']} clients{where}", f"{r['serve_requests_per_s']:.2f}", f"{r['serve_tokens_per_s']:.0f}",
             f"{r['serve_over_best_hf']:.2f}"],
            ["transformers generate, one prompt at a time", f"{r['requests'] / r['hf_alone_s']:.2f}",
             f"{r['hf_alone_tokens_per_s']:.0f}", ""],
            ["transformers generate, all prompts in one call", f"{r['requests'] / r['hf_batched_s']:.2f}",
             f"{r['hf_batched_tokens_per_s']:.0f}", ""]]
    return "\n".join([
        f"GPT-2 {CONFIG['num_hidden_layers']} layers x {CONFIG['hidden_size']} ({r['params']:,} parameters), "
        f"{r['requests']} greedy completions of {r['prompt_tokens']} + up to {r['new_tokens']} tokens; "
        f"torch {r['torch']} ({r['torch_threads']} threads); {m['cpu']}, {m['cores']} cores",
        table(rows, ["", "requests/s", "tokens/s", "/ best transformers"]),
        f"time per output token: wall clock {r['wall_s_per_token'] * 1e3:.1f} ms ({r['clients']} sequences at once); "
        f"the emulated CS-2 {r['simulated_s_per_token'] * 1e3:.3f} ms (weights {r['simulated_placement']}; "
        f"first token {r['simulated_ttft_s'] * 1e3:.3f} ms)",
    ])
