"""PyTorch's side of ``bench.peers``, in a clean process with PyTorch's defaults.

``python -m bench._torch_peers IN.npz OUT.json MODE``: IN holds ``ids`` and ``labels`` [steps, batch,
seq] (labels -100 where the loss mask is 0) and ``config`` (the transformers GPT2Config as JSON).
MODE ``single``: one process, 2 threads, the whole batch a step. MODE ``ddp``: two processes of one
thread each (``DistributedDataParallel``, gloo over the loopback), each half of every batch. Both
train transformers' GPT2LMHeadModel with AdamW (lr 1e-3, weight decay 0.01) and gradients clipped
to norm 1, as the wse side does; OUT gets each step's wall seconds (rank 0's for ddp).
It imports nothing of wse_core, so the OpenMP and malloc settings that wse_core makes for its own
kernels do not slow PyTorch down.
"""
import json
import os
import socket
import sys
import time

import numpy as np
import torch


def _train(ids, labels, config, rank=0, world=1):
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    share = ids.shape[1] // world
    times = []
    for x, y in zip(ids, labels):
        t0 = time.perf_counter()
        x = torch.from_numpy(x[rank * share:(rank + 1) * share]).long()
        y = torch.from_numpy(y[rank * share:(rank + 1) * share]).long()
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def _ddp_rank(rank, world, port, src, dst):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        data = np.load(src)
        times = _train(data["ids"], data["labels"], json.loads(str(data["config"])), rank, world)
        if rank == 0:
            with open(dst, "w") as f:
                json.dump({"seconds": times, "threads": 1, "processes": world}, f)
    finally:
        dist.destroy_process_group()


def main(src, dst, mode):
    if mode == "ddp":
        with socket.socket() as s:  # a free port on the loopback for the process group
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_ddp_rank, args=(2, port, src, dst), nprocs=2, join=True)
        return
    torch.set_num_threads(2)
    data = np.load(src)
    times = _train(data["ids"], data["labels"], json.loads(str(data["config"])))
    with open(dst, "w") as f:
        json.dump({"seconds": times, "threads": 2, "processes": 1, "torch": torch.__version__}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
