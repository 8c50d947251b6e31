"""The same GPT-2 trained by `wse fit` on 1, 2 and 4 CS-2s, against PyTorch in one process and DDP, in one run.

    wse bench peers [--json PATH] [--steps K] [--num_csx 1,2,4] [--model small|124m] [--micro_batch_size N]

``small`` is ``wse bench stream``'s GPT-2 (hidden 256, 4 layers, 4 heads, sequence 128, byte
vocabulary; 3.3M parameters), ``124m`` GPT-2 small's shape (hidden 768, 12 layers, 12 heads, 1,024
positions, its 50,257-token vocabulary) on sequences of 256, both with GPT-2's tanh GELU; global
batch 16 for both, on the
standard-library corpus (byte tokens), the same batches in the same order on every side.

The wse side is ``wse fit`` with ``micro_batch_size: auto`` (or ``--micro_batch_size``: micro-batches
as the hardware runs them, each streaming the weights again), AdamW (lr 1e-3, weight decay 0.01) and
gradients clipped to norm 1; a step's time is the cluster's own (metrics.jsonl). The baselines,
each in a clean process with PyTorch's defaults (``bench._torch_peers``): transformers'
GPT2LMHeadModel of the same shape with the same optimizer and clipping, in one process on 2
threads, and under ``DistributedDataParallel`` on 2 processes of 1 thread (gloo), each run before
and after the wse runs (a shared machine drifts; the median of both). The first steps of every
run (imports, first-touch allocation) are skipped; samples/s is the batch over the median step.
The figure of merit: wse on 2 CS-2s (two computing ranks on the two cores) over the best PyTorch.
"""
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import machine, numbers, table
from wse_core.errors import ConfigError, JobError

SKIP = 2
BATCH = 16
MODELS = {
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_heads": 4, "vocab_size": 257,
              "max_position_embeddings": 128, "nonlinearity": "gelu_new", "seq": 128},
    "124m": {"hidden_size": 768, "num_hidden_layers": 12, "num_heads": 12, "vocab_size": 50257,
             "max_position_embeddings": 1024, "nonlinearity": "gelu_new", "seq": 256},
}


def add_arguments(parser):
    parser.add_argument("--steps", type=int, default=10, help=f"training steps per run (the first {SKIP} are skipped)")
    parser.add_argument("--num_csx", default="1,2,4", help="comma-separated CS-2 counts")
    parser.add_argument("--model", choices=sorted(MODELS), default="small", help="the GPT-2's size")
    parser.add_argument("--micro_batch_size", default="auto", help="the wse runs' micro-batch size (default: auto)")


def _hf_config(m):
    return {"n_layer": m["num_hidden_layers"], "n_embd": m["hidden_size"], "n_head": m["num_heads"],
            "vocab_size": m["vocab_size"], "n_positions": m["max_position_embeddings"], "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "activation_function": m["nonlinearity"], "bos_token_id": 0,
            "eos_token_id": 0, "use_cache": False}


def _batches(data, steps, dst, config):
    """Write the run's batches (ids, labels with -100 where the loss mask is 0) for PyTorch's side."""
    import numpy as np

    from data_tools.dataset import GlobalStream

    stream = GlobalStream(data)
    try:
        ex = [stream.read(t * BATCH, BATCH) for t in range(steps)]
    finally:
        stream.close()
    ids = np.stack([e[:, 0] for e in ex])
    labels = np.stack([np.where(e[:, 1] != 0, e[:, 2], -100) for e in ex])
    np.savez(dst, ids=ids, labels=labels, config=json.dumps(config))


def _torch(src, tmp, mode):
    """Step seconds of PyTorch's run in ``mode`` (single or ddp), the skipped steps dropped."""
    dst = Path(tmp) / f"torch_{mode}.json"
    proc = subprocess.run([sys.executable, "-m", "bench._torch_peers", str(src), str(dst), mode],
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise JobError(f"PyTorch {mode} run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(dst.read_text())["seconds"][SKIP:]


def _wse(data, model, tmp, num_csx, steps, micro_batch_size):
    """Step seconds of ``wse fit`` on ``num_csx`` CS-2s (metrics.jsonl), the skipped steps dropped."""
    from mpi_launch.rundir import RunDir
    from pyapi.job import Job
    from pyapi.params import validate

    model_dir = Path(tmp) / f"csx{num_csx}"
    params = validate({
        "train_input": {"data_dir": str(data), "batch_size": BATCH, "micro_batch_size": micro_batch_size,
                        "shuffle": False},
        "model": {"name": "gpt2", **{k: v for k, v in model.items() if k != "seq"}},
        "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3, "weight_decay": 0.01,
                      "max_gradient_norm": 1.0},
        "runconfig": {"max_steps": steps, "num_csx": num_csx, "num_wgt_servers": 1, "num_workers_per_csx": 1,
                      "model_dir": str(model_dir), "log_steps": steps},
    })
    with open(Path(tmp) / f"fit{num_csx}.log", "w") as out:
        Job(params).fit(stream=out)
    metrics = RunDir(model_dir).read_metrics()
    return [m["step_seconds"] for m in metrics[SKIP:]], params.train_input.micro_batch_size


def _micro_batch_size(text):
    """``--micro_batch_size``: "auto" or a positive integer (the params check its range)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--micro_batch_size: expected auto or an integer, got {text!r}") from None


def run(args):
    from data_tools.preprocess import preprocess_text

    counts = numbers(args.num_csx, "--num_csx")
    if args.steps <= SKIP or not counts or min(counts) < 1:
        raise ConfigError(f"--steps must be > {SKIP} and --num_csx positive integers")
    model = MODELS[args.model]
    result = {"benchmark": "peers", "machine": machine(), "model": args.model, "shape": model, "batch_size": BATCH,
              "steps": args.steps, "timed_steps": args.steps - SKIP, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        print("preprocessing the standard-library corpus ...", file=sys.stderr, flush=True)
        preprocess_text(["stdlib"], data, model["seq"], progress=False)
        src = Path(tmp) / "batches.npz"
        _batches(data, args.steps, src, _hf_config(model))
        torch_times = {"single": [], "ddp": []}
        for mode in torch_times:
            print(f"PyTorch {mode} ...", file=sys.stderr, flush=True)
            torch_times[mode] += _torch(src, tmp, mode)
        for n in counts:
            print(f"wse fit with num_csx={n} ...", file=sys.stderr, flush=True)
            times, mbs = _wse(data, model, tmp, n, args.steps, _micro_batch_size(args.micro_batch_size))
            result["runs"][f"wse {n}"] = {"step_s": statistics.median(times), "num_csx": n, "micro_batch_size": mbs}
        for mode in torch_times:
            print(f"PyTorch {mode} again ...", file=sys.stderr, flush=True)
            torch_times[mode] += _torch(src, tmp, mode)
    result["runs"]["torch single"] = {"step_s": statistics.median(torch_times["single"]), "layout": "1 x 2 threads"}
    result["runs"]["torch ddp"] = {"step_s": statistics.median(torch_times["ddp"]), "layout": "2 x 1 thread"}
    for r in result["runs"].values():
        r["samples_per_s"] = BATCH / r["step_s"]
    best = max(result["runs"]["torch single"]["samples_per_s"], result["runs"]["torch ddp"]["samples_per_s"])
    for r in result["runs"].values():
        r["over_best_torch"] = r["samples_per_s"] / best
    return result


def report(result):
    m, s = result["machine"], result["shape"]
    rows = []
    for name, r in result["runs"].items():
        how = r.get("layout") or f"{r['num_csx']} CS-2 rank{'s' if r['num_csx'] > 1 else ''}, micro-batch {r['micro_batch_size']}"
        rows.append([name, how, f"{r['step_s'] * 1e3:.0f}", f"{r['samples_per_s']:.1f}", f"{r['over_best_torch']:.2f}"])
    return "\n".join([
        f"GPT-2 {result['model']} ({s['num_hidden_layers']} layers x {s['hidden_size']}, vocabulary {s['vocab_size']}), "
        f"seq {s['seq']}, global batch {result['batch_size']}; median of {result['timed_steps']} steps "
        f"(PyTorch: of two runs); {m['cpu']}, {m['cores']} cores",
        table(rows, ["run", "layout", "step ms", "samples/s", "/ best PyTorch"]),
    ])
