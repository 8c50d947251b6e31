"""A user's PyTorch model through the Cerebras-API front-end: step time on 1 CS-2 against eager PyTorch.

    wse bench cstorch [--json PATH] [--steps K]

``transformers``' GPT2LMHeadModel in the shape of ``wse bench stream``'s GPT-2 (hidden 256, 4 layers,
4 heads, sequence 128, byte vocabulary; no dropout) trains on the standard-library corpus, global
batch 16, through ``pyapi.cstorch`` on one emulated CS-2 (micro-batch 4): the wall time between
the traced step's returns, the first steps skipped, median of the rest (the steps whose graph the
front-end checks, 2, 3, 5, 9, 17 and the last, cost about 50 ms more here: a few of 21). The baseline, in this
process on the same cores: the same module, batches and ``torch.optim.AdamW`` trained eagerly
(forward, backward, step on the whole batch), timed before and after the front-end's run. Beside
them: the cluster's own step time (metrics.jsonl) and the simulated step of the emulated hardware
that the compiled units' costs give (wse_core.perf).
"""
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import machine, table

SEQ, BATCH, MICRO, SKIP = 128, 16, 4, 3
CONFIG = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 257, "n_positions": SEQ, "resid_pdrop": 0.0,
          "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False}


def add_arguments(parser):
    parser.add_argument("--steps", type=int, default=24, help=f"training steps (the first {SKIP} are skipped)")


def _batches(data, steps):
    import numpy as np
    import torch

    from data_tools.dataset import GlobalStream

    stream = GlobalStream(data)
    try:
        out = []
        for t in range(steps):
            ex = stream.read(t * BATCH, BATCH)
            labels = np.where(ex[:, 1] != 0, ex[:, 2], -100)
            out.append((torch.from_numpy(ex[:, 0]).long(), torch.from_numpy(labels).long()))
        return out
    finally:
        stream.close()


def _lm_loss(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _eager(model, batches):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    times = []
    for ids, labels in batches:
        t0 = time.perf_counter()
        loss = _lm_loss(model(ids).logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[SKIP:]


def _front_end(model, batches, artifacts):
    import pyapi.cstorch as cstorch

    backend = cstorch.backend("CSX", num_csx=1, micro_batch_size=MICRO, artifact_dir=artifacts)
    compiled = cstorch.compile(model, backend)
    optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-3)

    @cstorch.trace
    def training_step(ids, labels):
        loss = _lm_loss(compiled(ids).logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: batches),
                                               num_steps=len(batches))
    returned = []
    for ids, labels in executor:
        training_step(ids, labels)
        returned.append(time.perf_counter())
    return [b - a for a, b in zip(returned, returned[1:])][SKIP - 1:], executor.run.model_dir


def run(args):
    import torch
    import transformers

    from data_tools.preprocess import preprocess_text
    from mpi_launch.rundir import RunDir

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        preprocess_text(["stdlib"], data, SEQ, progress=False)
        batches = _batches(data, args.steps)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
        initial = {k: v.clone() for k, v in model.state_dict().items()}

        def fresh():
            m = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
            m.load_state_dict(initial)
            return m

        before = _eager(fresh(), batches)
        front, model_dir = _front_end(model, batches, Path(tmp) / "artifacts")
        after = _eager(fresh(), batches)
        metrics = RunDir(model_dir).read_metrics()[SKIP:]
    eager = statistics.median(before + after)
    step = statistics.median(front)
    return {
        "machine": machine(), "steps": args.steps, "timed_steps": len(front), "batch_size": BATCH,
        "micro_batch_size": MICRO, "seq": SEQ, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "front_end_step_s": step, "eager_step_s": eager, "front_end_over_eager": step / eager,
        "cluster_step_s": statistics.median(m["step_seconds"] for m in metrics),
        "simulated_step_s": statistics.median(m["sim_step_s"] for m in metrics),
    }


def report(result):
    m = result["machine"]
    rows = [["eager PyTorch, whole batch", f"{result['eager_step_s'] * 1e3:.0f}", "1.00"],
            ["pyapi.cstorch, 1 CS-2", f"{result['front_end_step_s'] * 1e3:.0f}",
             f"{result['front_end_over_eager']:.2f} (goal <= 1.3)"],
            ["  of which the cluster's step", f"{result['cluster_step_s'] * 1e3:.0f}", ""]]
    return "\n".join([
        f"transformers GPT2LMHeadModel, {CONFIG['n_layer']} layers x {CONFIG['n_embd']} ({result['params']:,} "
        f"parameters), seq {result['seq']}, batch {result['batch_size']}, micro-batch {result['micro_batch_size']}; "
        f"median of {result['timed_steps']} steps; torch {result['torch']} ({result['torch_threads']} threads); "
        f"{m['cpu']}, {m['cores']} cores",
        table(rows, ["", "step ms", "/ eager"]),
        f"simulated step of the emulated CS-2 (the compiled units' costs, wse_core.perf): "
        f"{result['simulated_step_s'] * 1e3:.3f} ms",
    ])
