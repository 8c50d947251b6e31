"""Scripts of our own that use Cerebras' PyTorch API exactly as real public scripts do, each run as a
user runs it (``python -m pyapi.cstorch SCRIPT``: their ``import cerebras.pytorch`` / ``cerebras_pytorch``
unchanged) on 2 emulated CS-2s with synthetic local data, against eager PyTorch.

Each script follows one public script, named with its repository and commit beside it: the shapes
of their calls (backend, compile, optimizer and schedule, loader, the traced step and what it
returns, closures, checkpoints, executor, loop) are theirs; the models and data are small ones made
here. What they were found to need is listed in docs/user-guide.md's table of Cerebras' API."""
import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional


def run(cwd, script, *args, files=None):
    """Run ``script`` (its text) as ``train.py`` in ``cwd`` beside ``files`` ({name: text}), as a user
    runs a script written for a real system; its stdout lines."""
    cwd.mkdir(parents=True, exist_ok=True)
    for name, text in {"train.py": script, **(files or {})}.items():
        (cwd / name).write_text(text)
    proc = subprocess.run([sys.executable, "-m", "pyapi.cstorch", "train.py", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=600)  # a bound only a hang reaches
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def numbers(lines, prefix):
    """The last field of each line starting with ``prefix`` (after a "=", if it has one), as floats."""
    return [float(line.split()[-1].split("=")[-1]) for line in lines if line.startswith(prefix)]


# -- the docs' custom-training-loop tutorial, as users copied it ------------------------------------
# Follows AsgerWenneb/sem_pytorch_cerebras ai_test.py @ 6b1240f157233fba68bd93068764bb0a93acfc18 (a copy
# of Cerebras' "Writing a custom training loop"): an input function taking keywords, int32 labels (the
# docs' target transform), a two-argument traced step, a step closure printing loss.item(), a
# checkpoint closure saving {"model", "optimizer"} as .mdl, DataExecutor(num_steps, checkpoint_steps),
# a hand-kept global_step; its commented-out ClusterConfig gives the CS-2s.

TUTORIAL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import cerebras.pytorch as cstorch


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, inputs):
        x = torch.flatten(inputs, 1)
        x = F.relu(self.fc1(x))
        return F.relu(self.fc2(x))


def get_torch_dataloader(batch_size, train):
    g = torch.Generator().manual_seed(0 if train else 1)
    images = torch.rand(512, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (512,), generator=g).to(torch.int32)
    dataset = torch.utils.data.TensorDataset(images, labels)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=g)


def main():
    backend = cstorch.backend("CSX", cluster_config=cstorch.distributed.ClusterConfig(
        num_csx=2, max_wgt_servers=1, max_act_per_csx=1, num_workers_per_csx=1))
    torch.manual_seed(0)
    model = Model()
    compiled_model = cstorch.compile(model, backend=backend)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    @cstorch.trace
    def training_step(inputs, targets):
        outputs = compiled_model(inputs)
        loss = loss_fn(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    @cstorch.step_closure
    def print_loss(loss: torch.Tensor, step: int):
        print(f"Train Loss {step}: {loss.item()}")

    @cstorch.checkpoint_closure
    def save_checkpoint(step):
        cstorch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"checkpoint_{step}.mdl")

    training_dataloader = cstorch.utils.data.DataLoader(get_torch_dataloader, batch_size=64, train=True)
    train_executor = cstorch.utils.data.DataExecutor(training_dataloader, num_steps=6, checkpoint_steps=3)
    global_step = 0
    model.train()
    for inputs, targets in train_executor:
        loss = training_step(inputs, targets)
        global_step += 1
        print_loss(loss, global_step)
        save_checkpoint(global_step)


if __name__ == "__main__":
    main()
'''


def test_the_tutorial_as_users_copied_it_trains_on_two_cs2s_as_eager_pytorch(tmp_path):
    import pyapi.cstorch as cstorch

    losses = numbers(run(tmp_path, TUTORIAL), "Train Loss")
    user = {}
    exec(TUTORIAL.replace("import cerebras.pytorch as cstorch", ""), user)
    torch.manual_seed(0)
    model = user["Model"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step, (x, y) in enumerate(user["get_torch_dataloader"](64, True)):
        if step == 6:
            break
        loss = F.cross_entropy(model(x), y.long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5), step
    saved = cstorch.load(tmp_path / "checkpoint_6.mdl")
    for name, w in model.state_dict().items():
        torch.testing.assert_close(saved["model"][name], w, rtol=1e-5, atol=1e-6)
    assert (tmp_path / "checkpoint_3.mdl").exists() and len(losses) == 6


# -- an LM repository's train and eval scripts, in two API generations -------------------------------
# Follows Cerebras/gigaGPT train.py, eval.py, data.py and model.py @ ebc1bbe9efa3bb4c07898c016ec3f88927ec0cab
# (2.5: cerebras.pytorch, ClusterConfig, set_half_dtype, profiler.rate_tracker) and @
# 8b2379b0e914cfb3f5fd1a6b22dc7a73d56183f9 (2.0: cerebras_pytorch, CSConfig, use_bfloat16,
# DataExecutor(cs_config=, writer=), profiler.rate()): parameter groups (decay for matrices only),
# AdamW(correct_bias=True) at a placeholder lr under SequentialLR(LinearLR warm-up, CosineDecayLR),
# clip_grad_norm_ of a generator of the parameters (consumed once: the step runs once), bfloat16 off
# the CPU, `with backend.device`, a model that returns its loss (sum / (B * T), cast to the logits'
# dtype), a one-argument step on a tuple batch of int32 ids, batches sharded over the streamers by
# get_streaming_rank, a checkpoint closure of five keys, resume with enumerate(executor, start=global_step
# + 1), and an eval script of @cstorch.trace @torch.no_grad() that adds the loss tensors in a closure.

GPT_MODEL = '''
import torch
import torch.nn as nn
from dataclasses import dataclass


@dataclass
class GPTConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    sequence_length: int = 16
    heads: int = 2
    num_hidden_layers: int = 2


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(c.hidden_size), nn.LayerNorm(c.hidden_size)
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(c.hidden_size, 4 * c.hidden_size), nn.GELU(),
                                 nn.Linear(4 * c.hidden_size, c.hidden_size))
        self.heads = c.heads

    def forward(self, x, mask):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(h, dim=2)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        att = q @ k.transpose(-2, -1) / (h // self.heads) ** 0.5 + mask
        x = x + self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h))
        return x + self.mlp(self.ln_2(x))


def create_autoregressive_mask(batch_size, num_heads, length, device, dtype):
    r = torch.arange(length, device=device)
    diff = (r[None, :] - r[:, None]).broadcast_to((batch_size, num_heads, length, length)).to(dtype)
    return torch.where(diff > 0, torch.tensor(float("-inf"), dtype=dtype), 0)


class GPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        torch.manual_seed(0)  # (ours: the same initial weights in every process the test starts)
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.sequence_length, config.hidden_size)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids, labels=None):
        batch_size, sequence_length = input_ids.shape
        x = self.wte(input_ids) + self.wpe(torch.arange(sequence_length, device=input_ids.device))
        mask = create_autoregressive_mask(batch_size, self.config.heads, sequence_length, x.device, x.dtype)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.lm_head(self.ln_f(x))
        loss = nn.CrossEntropyLoss(reduction="none")(logits.view(-1, logits.size(-1)), labels.view(-1).long())
        loss = loss.sum() / (batch_size * sequence_length)
        return loss.to(logits.dtype)
'''

GPT_DATA = '''
import numpy as np
import torch

import {package}.distributed as dist


class NumpyMmapDataset(torch.utils.data.Dataset):
    def __init__(self, data_path, sequence_length):
        self.sequence_length = sequence_length
        self.data = np.memmap(data_path, dtype=np.uint16, mode="r")

    def __getitem__(self, i):
        x = self.data[i * self.sequence_length:(i + 1) * self.sequence_length + 1].astype(np.int32)
        return x[:-1], x[1:]

    def __len__(self):
        return (len(self.data) - 1) // self.sequence_length


class Sharder(torch.utils.data.Sampler):
    def __init__(self, data_source):
        self.data_source = data_source
        self.task_id = dist.get_streaming_rank() if dist.is_streamer() else 0
        self.num_tasks = dist.num_streamers() if dist.is_streamer() else 1

    def __iter__(self):
        for i, x in enumerate(self.data_source):
            if i % self.num_tasks == self.task_id:
                yield x

    def __len__(self):
        n = len(self.data_source)
        return n // self.num_tasks + (self.task_id < n % self.num_tasks)


def get_dataloader(data_path, sequence_length, batch_size, seed=0):
    gen = torch.Generator()
    gen.manual_seed(seed)
    dataset = NumpyMmapDataset(data_path, sequence_length)
    sampler = torch.utils.data.RandomSampler(dataset, generator=gen)
    sampler = Sharder(torch.utils.data.BatchSampler(sampler, batch_size, drop_last=True))
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
'''

GPT_CONFIG = '''
import sys
from dataclasses import dataclass
{config_import}
from model import GPTConfig


@dataclass
class RunConfig:
    backend: str = "CSX"
    out_dir: str = "out"
    dataset: str = "."
    checkpoint_path: str = None
    sequence_length: int = 16
    batch_size: int = 8
    num_steps: int = 4
    checkpoint_steps: int = 2
    seed: int = 1
    learning_rate: float = 1e-2
    warmup_steps: int = 2
    decay_steps: int = 6
    weight_decay: float = 0.1
    adam_epsilon: float = 1e-8
    max_gradient_norm: float = 1.0
    execute_crd_memory_gi: int = 32
    compile_crd_memory_gi: int = 50


def parse_args():
    run = RunConfig(**dict(arg.split("=", 1) for arg in sys.argv[1:]))
    return GPTConfig(), run, {cluster}
'''

GPT_TRAIN = '''
import os
from dataclasses import asdict
from pathlib import Path

import torch

import {package} as cstorch
from configuration import parse_args
from data import get_dataloader
from model import GPTModel


def main(model_config, config, cs_config):
    backend = {backend}
    out_dir = Path(config.out_dir)
    if not backend.is_cpu:
        {half}

    with backend.device:
        model = GPTModel(model_config)
    compiled_model = cstorch.compile(model, backend)

    decay_params = [p for p in model.parameters() if p.dim() >= 2]
    no_decay_params = [p for p in model.parameters() if p.dim() < 2]
    param_groups = [{{"params": decay_params, "weight_decay": config.weight_decay}},
                    {{"params": no_decay_params, "weight_decay": 0.0}}]
    optimizer = cstorch.optim.AdamW(param_groups, lr=0.1, weight_decay=config.weight_decay, correct_bias=True,
                                    betas=(0.9, 0.95), eps=config.adam_epsilon)
    lr_scheduler = cstorch.optim.lr_scheduler.SequentialLR(
        optimizer,
        schedulers=[
            cstorch.optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=0.0,
                                                end_learning_rate=config.learning_rate,
                                                total_iters=config.warmup_steps),
            cstorch.optim.lr_scheduler.CosineDecayLR(optimizer, initial_learning_rate=config.learning_rate,
                                                     end_learning_rate=0.1 * config.learning_rate,
                                                     total_iters=config.decay_steps),
        ],
        milestones=[config.warmup_steps],
    )
    all_params = (p for param_group in optimizer.param_groups for p in param_group["params"])

    if config.checkpoint_path is not None:
        state_dict = cstorch.load(config.checkpoint_path)
        model.load_state_dict(state_dict["model"])
        if "optimizer" in state_dict:
            optimizer.load_state_dict(state_dict["optimizer"])
        if "lr_scheduler" in state_dict:
            lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        global_step = state_dict.get("global_step", 0)
    else:
        global_step = 0
    {knobs}

    @cstorch.checkpoint_closure
    def save_checkpoint(step):
        checkpoint_path = out_dir.joinpath(f"checkpoint_{{step}}.mdl")
        state_dict = {{
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "global_step": step,
            "model_config": asdict(model_config),
        }}
        cstorch.save(state_dict, checkpoint_path)

    @cstorch.trace
    def training_step(batch):
        input_ids, labels = batch
        loss = compiled_model(input_ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(all_params), config.max_gradient_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        return loss

    {writer_import}
    writer = SummaryWriter(log_dir=out_dir.joinpath("train"))

    @cstorch.step_closure
    def log_loss(loss, step):
        rate = {rate}
        global_rate = {global_rate}
        print(f"| Step={{step}}, Rate={{rate:.2f}} samples/sec, GlobalRate={{global_rate:.2f}}, Loss={{loss.item()!r}}")
        writer.add_scalar("loss", loss.item(), step)
        writer.add_scalar("samples_per_second", global_rate, step)

    data_path = os.path.join(config.dataset, "train.bin")
    dataloader = cstorch.utils.data.DataLoader(get_dataloader, data_path, config.sequence_length, config.batch_size,
                                               config.seed)
    executor = cstorch.utils.data.DataExecutor(dataloader, num_steps=config.num_steps - global_step,
                                               checkpoint_steps=config.checkpoint_steps{executor_args})
    for step, batch in enumerate(executor, start=global_step + 1):
        if step > config.num_steps:
            break
        loss = training_step(batch)
        log_loss(loss, step)
        save_checkpoint(step)


if __name__ == "__main__":
    main(*parse_args())
'''

GPT_ERAS = {
    "2.5": dict(package="cerebras.pytorch", backend="cstorch.backend(config.backend, cluster_config=cs_config)",
                config_import="from cerebras.pytorch.distributed import ClusterConfig",
                cluster='ClusterConfig(num_csx=2, mount_dirs=["."], python_paths=["."])',
                half='cstorch.amp.set_half_dtype("bfloat16")',
                knobs="cstorch.backends.csx.debug.execute_crd_memory_gi = config.execute_crd_memory_gi\n"
                      "    cstorch.backends.csx.debug.compile_crd_memory_gi = config.compile_crd_memory_gi",
                writer_import="from cerebras.pytorch.utils.tensorboard import SummaryWriter",
                rate="executor.profiler.rate_tracker.rate", global_rate="executor.profiler.rate_tracker.global_rate",
                executor_args=""),
    "2.0": dict(package="cerebras_pytorch", backend="cstorch.backend(config.backend, use_cs_grad_accum=True)",
                config_import="from cerebras_pytorch.utils import CSConfig",
                cluster='CSConfig(num_csx=2, mount_dirs=["."], python_paths=["."], precision_opt_level=1)',
                half="cstorch.amp.use_bfloat16(True)", knobs="",
                writer_import="SummaryWriter = cstorch.utils.tensorboard.SummaryWriter",
                rate="executor.profiler.rate()", global_rate="executor.profiler.global_rate()",
                executor_args=", cs_config=cs_config, writer=writer"),
}

GPT_EVAL = '''
import os
from pathlib import Path

import torch

import cerebras.pytorch as cstorch
from configuration import parse_args
from data import get_dataloader
from model import GPTModel


def main(model_config, config, cs_config):
    backend = cstorch.backend(config.backend, cluster_config=cs_config)
    out_dir = Path(config.out_dir)
    if not backend.is_cpu:
        cstorch.amp.set_half_dtype("bfloat16")
    with backend.device:
        model = GPTModel(model_config)
    compiled_model = cstorch.compile(model, backend)
    state_dict = cstorch.load(config.checkpoint_path)
    model.load_state_dict(state_dict["model"])
    global_step = state_dict.get("global_step", 0)
    del state_dict

    @cstorch.trace
    @torch.no_grad()
    def eval_step(batch):
        input_ids, labels = batch
        loss = compiled_model(input_ids, labels)
        return loss

    total_loss = 0
    total_steps = 0

    @cstorch.step_closure
    def post_eval_step(loss, step):
        nonlocal total_loss
        nonlocal total_steps
        total_loss += loss
        total_steps += 1

    from cerebras.pytorch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(log_dir=out_dir.joinpath("eval"))
    dataloader = cstorch.utils.data.DataLoader(get_dataloader, os.path.join(config.dataset, "val.bin"),
                                               config.sequence_length, config.batch_size)
    num_steps = len(dataloader)
    executor = cstorch.utils.data.DataExecutor(dataloader, num_steps=num_steps)
    for step, batch in enumerate(executor, start=1):
        if step > num_steps:
            break
        loss = eval_step(batch)
        post_eval_step(loss, step)
    avg_loss = total_loss / total_steps
    writer.add_scalar("loss", avg_loss, global_step)
    print(f"Average eval loss: {avg_loss.item()!r} over {total_steps} steps")


if __name__ == "__main__":
    main(*parse_args())
'''


def gpt_files(era):
    return {"model.py": GPT_MODEL, "data.py": GPT_DATA.format(package=GPT_ERAS[era]["package"]),
            "configuration.py": GPT_CONFIG.format(**GPT_ERAS[era])}


def gpt_eager(tmp_path, steps):
    """(losses, model) of eager PyTorch on the scripts' model and data: the same groups, AdamW, schedule
    and clipping, bfloat16 under torch.autocast; its loss before the final cast to the logits' dtype
    (the cluster computes a unit's values in float32 on 16-bit weights: its loss is not rounded)."""
    user = {}
    exec(GPT_MODEL.replace("return loss.to(logits.dtype)", "return loss"), user)
    data = {}
    exec(GPT_DATA.format(package="pyapi.cstorch"), data)
    model = user["GPTModel"](user["GPTConfig"]())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=0.0, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    epoch = list(data["get_dataloader"](str(tmp_path / "train.bin"), 16, 8, 1))
    for step in range(steps):
        lr = 1e-2 * step / 2 if step < 2 else 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + np.cos(np.pi * (step - 2) / 6))
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, labels = epoch[step % len(epoch)]  # the loader made again when it runs out
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids.long(), labels)
        optimizer.zero_grad()
        loss.float().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses, model


def test_an_lm_repositorys_train_and_eval_scripts_run_on_two_cs2s_in_both_api_generations(tmp_path):
    """gigaGPT's shape: 4 steps (two epochs of two batches) in bfloat16 on 2 CS-2s, eager PyTorch's losses
    (2e-3: 16-bit); stopped at its step-2 checkpoint and resumed, the run ends with the uninterrupted
    run's checkpoint bit for bit (its loader starts again, as gigaGPT's does on a real system: at an
    epoch's end, the batches the uninterrupted run takes); the 2.0-era spelling gives the 2.5 one's
    bits; the eval script's loss is eager's on the trained weights."""
    import pyapi.cstorch as cstorch

    tokens = np.random.default_rng(0).integers(0, 64, 16 * 16 + 1).astype(np.uint16)
    runs = {}
    for name, era, args in (("full", "2.5", ()), ("resumed", "2.5", ("checkpoint_path=../full/out/checkpoint_2.mdl",)),
                            ("old", "2.0", ())):
        where = tmp_path / name
        where.mkdir()
        tokens.tofile(where / "train.bin")
        tokens[: 16 * 16 + 1].tofile(where / "val.bin")
        runs[name] = run(where, GPT_TRAIN.format(**GPT_ERAS[era]), *args, files=gpt_files(era))
    full = numbers(runs["full"], "| Step")
    eager, model = gpt_eager(tmp_path / "full", 4)
    assert full == pytest.approx(eager, rel=2e-3)
    assert numbers(runs["resumed"], "| Step") == full[2:]
    assert numbers(runs["old"], "| Step") == full
    final = [cstorch.load(tmp_path / name / "out" / "checkpoint_4.mdl") for name in ("full", "resumed", "old")]
    for other in final[1:]:
        assert other["global_step"] == 4 and other["lr_scheduler"] == final[0]["lr_scheduler"]
        for key in ("model", "optimizer"):
            flat = [(a, b) for a, b in zip(_leaves(final[0][key]), _leaves(other[key]))]
            assert flat and all(torch.equal(a, b) for a, b in flat), key
    lines = run(tmp_path / "full", GPT_EVAL, "checkpoint_path=out/checkpoint_4.mdl", files=gpt_files("2.5"))
    (line,) = [line for line in lines if line.startswith("Average eval loss")]
    model.load_state_dict(final[0]["model"])
    data = {}
    exec(GPT_DATA.format(package="pyapi.cstorch"), data)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = [model(ids.long(), labels).item() for ids, labels in
                data["get_dataloader"](str(tmp_path / "full" / "val.bin"), 16, 8)]
    assert float(line.split()[3]) == pytest.approx(sum(want) / len(want), rel=2e-3)


def _leaves(state):
    from torch.utils._pytree import tree_leaves

    return [x for x in tree_leaves(state) if isinstance(x, torch.Tensor)]


# -- a site's CNN with BatchNorm, 2.0 era ---------------------------------------------------------------
# Follows EPCCed/reframe-mlperf-epcc cs2/ML/ResNet50/train.py @ 0aff1b6a8f203277d9745270de7449e375f2c055 (EPCC's
# CS-2, whose ReFrame test scrapes its "Processing Speed" line): bottleneck blocks with BatchNorm2d
# in training, cstorch.compile(model, backend="CSX") with no backend made, SGD with momentum, an input
# function of the params dict, a two-argument step that calls cstorch.summarize_scalar, a
# SummaryWriter() without a log_dir, cstorch.utils.CSConfig given to DataExecutor(cs_config=, writer=),
# no step closure, len() of the cstorch DataLoader. (Data: random images and int64 labels, ImageFolder's.)

RESNET = '''
import os
import time

import cerebras_pytorch as cstorch
import torch
import torch.nn as nn


class Bottleneck(nn.Module):
    def __init__(self, channels, width):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, channels, 1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return torch.relu(self.bn3(self.conv3(out)) + x)


class ResNet(nn.Module):
    def __init__(self, num_class=10):
        super().__init__()
        torch.manual_seed(0)  # (ours: the same initial weights in every process the test starts)
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.layers = nn.Sequential(Bottleneck(16, 8), Bottleneck(16, 8))
        self.fc = nn.Linear(16, num_class)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(x, 1).view(x.shape[0], -1))


def get_train_dataloader(params):
    params = params["train_input"]
    g = torch.Generator().manual_seed(3)
    images = torch.randn(64, 3, 16, 16, generator=g)
    labels = torch.randint(0, 10, (64,), generator=g)
    dataset = torch.utils.data.TensorDataset(images, labels)
    return torch.utils.data.DataLoader(dataset, batch_size=params["batch_size"], drop_last=params["drop_last_batch"],
                                       shuffle=params["shuffle"])


def main(config):
    params = {"train_input": {"batch_size": 16, "drop_last_batch": True, "shuffle": False},
              "runconfig": {"max_steps": 4, "checkpoint_steps": 0}}
    model = ResNet()
    compiled_model = cstorch.compile(model, backend="CSX")
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    cerebras_loader = cstorch.utils.data.DataLoader(get_train_dataloader, params)
    criterion = torch.nn.CrossEntropyLoss()

    @cstorch.trace
    def train_step(x, y):
        logits = compiled_model(x)
        loss = criterion(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        cstorch.summarize_scalar("loss", loss)
        return loss

    writer = cstorch.utils.tensorboard.SummaryWriter()
    executor = cstorch.utils.data.DataExecutor(
        cerebras_loader, num_steps=params["runconfig"]["max_steps"],
        checkpoint_steps=params["runconfig"]["checkpoint_steps"], cs_config=cs_config, writer=writer)
    start = time.time()
    for x, y in executor:
        loss = train_step(x, y)
    total_time = time.time() - start
    dataset_size = len(cerebras_loader) * params["train_input"]["batch_size"]
    print(f"Processing Speed: {dataset_size / total_time}")
    print(f"Time For Epoch: {total_time}")
    cstorch.save({"model": model.state_dict()}, "final.mdl")


if __name__ == "__main__":
    cs_config = cstorch.utils.CSConfig(mount_dirs=[os.getcwd()], python_paths=[os.getcwd()], num_workers_per_csx=2,
                                       num_csx=2)
    main(cs_config)
'''


def test_a_sites_resnet_with_batchnorm_trains_on_two_cs2s_as_eager_pytorch_accumulating_micro_batches(tmp_path):
    """EPCC's shape on 2 CS-2s: each micro-batch normalised by its own statistics, eager PyTorch's losses
    when it accumulates the same micro-batches' gradients (BatchNorm sees what each CS-2 sees), and
    the running statistics eager's M sequential updates give; the summaries and the site's lines."""
    import pyapi.cstorch as cstorch

    lines = run(tmp_path, RESNET)
    assert any(line.startswith("Processing Speed: ") for line in lines), lines
    metrics = [json.loads(line) for line in next(tmp_path.glob("cerebras_logs/run_*/model/metrics.jsonl"))
               .read_text().splitlines()]
    losses, m = [r["loss"] for r in metrics], metrics[0]["micro_batches"]
    summaries = [json.loads(line) for line in next(tmp_path.glob("cerebras_logs/run_*/summaries.jsonl"))
                 .read_text().splitlines()]
    assert [s["value"] for s in summaries] == pytest.approx(losses, rel=1e-6)  # the step's float32 loss
    assert list(tmp_path.glob("runs/*/events.out.tfevents.*"))
    user = {}
    exec(RESNET.replace("import cerebras_pytorch as cstorch", ""), user)
    model = user["ResNet"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = user["get_train_dataloader"]({"train_input": {"batch_size": 16, "drop_last_batch": True,
                                                           "shuffle": False}})
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(m), y.chunk(m)):  # the micro-batches, in order
            loss = F.cross_entropy(model(xs), ys) * len(ys) / len(y)
            loss.backward()
            total += loss.item()
        optimizer.step()
        assert losses[step] == pytest.approx(total, rel=1e-5), step
    final = cstorch.load(tmp_path / "final.mdl")["model"]
    for name, value in model.state_dict().items():
        # The convolutions' weight gradients are trees over samples (lower.py), eager's one batched sum: in
        # float32 through BatchNorm and momentum they part by up to 2.0e-5 in 4 steps (measured).
        torch.testing.assert_close(final[name].to(value.dtype), value, rtol=1e-4, atol=5e-5, msg=name)
    assert int(final["layers.0.bn1.num_batches_tracked"]) == 4 * m


# -- mixed precision with a gradient scaler and amp.optimizer_step ---------------------------------------
# Follows Cerebras/modelzoo modelzoo/common/pytorch/run_cstorch_flow.py @ c3a8a691476e0b12d8272021c483ddcfaee432d1
# (Release_2.0.2: configure_optimizer, configure_lr_scheduler, GradScaler(loss_scale="dynamic", ...),
# cstorch.amp.optimizer_step(loss, optimizer, grad_scaler, max_gradient_norm=...) in a step of one
# batch argument, the scaler's state_dict saved as "grad_scaler" and loaded on resume) and
# epautsch/UncertaintyANL cerebras/imagenet/attempt1/training.py @ c943a13067ca4e5273fc813c4d65714d54e9cd94
# (a user's: the same calls, step closures called inside the step, a checkpoint of model, optimizer,
# scaler and global_step), on float16.

AMP = '''
import sys
import torch
import cerebras_pytorch as cstorch


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # (ours: the same initial weights in every process the test starts)
        self.layers = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                          torch.nn.GELU(), torch.nn.Linear(64, 4))

    def forward(self, x):
        return self.layers(x)


def input_fn(batch_size):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3 * batch_size, 32, generator=g)
    x[batch_size] = 1e6  # beyond float16: the second batch's gradients overflow, whatever the scale
    y = torch.randint(0, 4, (3 * batch_size,), generator=g).to(torch.int32)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, drop_last=True)


def main(checkpoint=None, total_steps=6):
    backend = cstorch.backend("CSX", use_cs_grad_accum=True)
    cstorch.amp.use_bfloat16(False)
    model = MLP()
    compiled_model = cstorch.compile(model, backend)
    optimizer = cstorch.optim.configure_optimizer(optimizer_type="SGD", params=model.parameters(), learning_rate=0.05,
                                                  momentum=0.9)
    lr_scheduler = cstorch.optim.configure_lr_scheduler(
        optimizer, {"scheduler": "Linear", "initial_learning_rate": 0.05, "end_learning_rate": 0.01, "total_iters": 6})
    grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0 ** 10, steps_per_increase=3)
    loss_fn = torch.nn.CrossEntropyLoss()
    global_step = 0
    if checkpoint is not None:
        state_dict = cstorch.load(checkpoint)
        model.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optimizer"])
        lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        grad_scaler.load_state_dict(state_dict["grad_scaler"])
        global_step = state_dict["global_step"]
    losses = []

    @cstorch.step_closure
    def accumulate_loss(loss):
        losses.append(loss.item())

    @cstorch.trace
    def training_step(batch):
        inputs, targets = batch
        outputs = compiled_model(inputs)
        loss = loss_fn(outputs, targets)
        cstorch.amp.optimizer_step(loss, optimizer, grad_scaler, max_gradient_norm=1.0)
        lr_scheduler.step()
        accumulate_loss(loss)
        return loss

    @cstorch.step_closure
    def post_training_step(loss, step):
        print(f"step {step} scale {grad_scaler.state_dict().get('loss_scale')} loss {loss.item()!r}")

    @cstorch.checkpoint_closure
    def save_checkpoint(step):
        cstorch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "lr_scheduler": lr_scheduler.state_dict(), "grad_scaler": grad_scaler.state_dict(),
                      "global_step": step}, f"checkpoint_{step}.mdl")

    dataloader = cstorch.utils.data.DataLoader(input_fn, 8)
    executor = cstorch.utils.data.DataExecutor(dataloader, num_steps=total_steps - global_step, checkpoint_steps=3)
    for step, batch in enumerate(executor, start=global_step + 1):
        loss = training_step(batch)
        post_training_step(loss, step)
        save_checkpoint(step)
    print("losses", len(losses))


if __name__ == "__main__":
    main(*sys.argv[1:2])
'''


def test_mixed_precision_with_optimizer_step_resumes_with_its_dynamic_loss_scale(tmp_path):
    """float16 with a dynamic loss scale, a batch whose values overflow float16 every third step:
    eager PyTorch's skipped steps and losses (torch.autocast with torch.amp.GradScaler: 2e-3), the
    scale halving and doubling; stopped at step 3 and resumed from the checkpoint the script saved,
    the rest of the run (its losses, its loss scale, its final state) is the uninterrupted run's."""
    import pyapi.cstorch as cstorch

    full = run(tmp_path / "full", AMP)
    resumed = run(tmp_path / "resumed", AMP, "../full/checkpoint_3.mdl")
    assert [line for line in full if line.startswith("step ")][3:] == [line for line in resumed if line.startswith("step ")]
    # the scaler's state after each step: halved by a skip; the resumed run goes on from step 3's (512, one
    # clean step), where a scale that restarted from 1024 would give 1024, 512, 512
    assert [float(line.split()[3]) for line in full if line.startswith("step ")] == [1024, 512, 512, 512, 256, 256]
    a, b = (cstorch.load(tmp_path / d / "checkpoint_6.mdl") for d in ("full", "resumed"))
    assert a["grad_scaler"] == b["grad_scaler"] and a["lr_scheduler"] == b["lr_scheduler"]
    assert all(torch.equal(x, y) for x, y in zip(_leaves([a["model"], a["optimizer"]]),
                                                   _leaves([b["model"], b["optimizer"]])))
    metrics = [json.loads(line) for line in next((tmp_path / "full").glob("cerebras_logs/run_*/model/metrics.jsonl"))
               .read_text().splitlines()]
    skipped = [r["skipped"] for r in metrics]
    losses = numbers(full, "step ")
    user = {}
    exec(AMP.replace("import cerebras_pytorch as cstorch", ""), user)
    model = user["MLP"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    eager_skipped, batches = [], list(user["input_fn"](8))
    for step in range(6):
        for group in optimizer.param_groups:
            group["lr"] = 0.05 + (0.01 - 0.05) * step / 6
        x, y = batches[step % 3]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y.long())
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        eager_skipped.append(scaler.get_scale() < scale)
        if np.isfinite(loss.item()):
            assert losses[step] == pytest.approx(loss.item(), rel=2e-3), step
        else:  # the batch beyond float16
            assert not np.isfinite(losses[step]), step
    assert skipped == eager_skipped == [False, True, False, False, True, False]


# -- a site's bring-up probe ----------------------------------------------------------------------------
# Follows wilkieolin/nubun cerebras/minimal_probe.py @ 13759138ce18b3928b270af25edf88b922a68963 (an ALCF CS-3
# bring-up probe, --raw-input --opt adamw): ClusterConfig with job labels, a time limit, mount_dirs and
# python_paths; a raw generator of pre-batched (inputs, int32 labels) tuples as the input function;
# AdamW with SequentialLR(LinearLR from 0, CosineDecayLR), the scheduler stepped after zero_grad under a
# Python `if`; a step closure printing loss.item() every step; DataExecutor(num_steps=5); a hand-kept step.

PROBE = '''
import torch
import torch.nn.functional as F
import cerebras.pytorch as cstorch

REPO_ROOT = "."


def main():
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(784, 256)
            self.fc2 = torch.nn.Linear(256, 10)

        def forward(self, x):
            x = torch.flatten(x, 1)
            x = F.relu(self.fc1(x))
            return self.fc2(x)

    cluster_config = cstorch.distributed.ClusterConfig(
        num_csx=2, job_labels=["name=minprobe"], job_time_sec=3600, mount_dirs=[REPO_ROOT], python_paths=[REPO_ROOT])
    backend = cstorch.backend("CSX", cluster_config=cluster_config)
    torch.manual_seed(0)
    model = MLP()
    compiled_model = cstorch.compile(model, backend)
    optimizer = cstorch.optim.AdamW(model.parameters(), lr=3e-4)
    lr = 3e-4
    warmup = cstorch.optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=0.0, end_learning_rate=lr,
                                                 total_iters=500)
    cosine = cstorch.optim.lr_scheduler.CosineDecayLR(optimizer, initial_learning_rate=lr, end_learning_rate=lr * 0.1,
                                                      total_iters=1000)
    lr_scheduler = cstorch.optim.lr_scheduler.SequentialLR(optimizer, schedulers=[warmup, cosine], milestones=[500])

    def input_fn_raw():
        def gen():
            g = torch.Generator().manual_seed(7)  # (ours: the probe draws unseeded)
            for _ in range(7):
                x = torch.randn(64, 1, 28, 28, generator=g)
                y = torch.randint(0, 10, (64,), dtype=torch.int32, generator=g)
                yield (x, y)
        return gen()

    dataloader = cstorch.utils.data.DataLoader(input_fn_raw)
    loss_fn = torch.nn.CrossEntropyLoss()

    @cstorch.trace
    def training_step(inputs, targets):
        outputs = compiled_model(inputs)
        loss = loss_fn(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if lr_scheduler is not None:
            lr_scheduler.step()
        return loss

    @cstorch.step_closure
    def print_loss(loss, step):
        print(f"step {step}: loss={loss.item():.4f}")

    executor = cstorch.utils.data.DataExecutor(dataloader, num_steps=5)
    model.train()
    step = 0
    print("minimal_probe: starting standalone cstorch loop...")
    for inputs, targets in executor:
        loss = training_step(inputs, targets)
        print_loss(loss, step)
        step += 1
    print("minimal_probe: DONE")


if __name__ == "__main__":
    main()
'''


def test_a_sites_bring_up_probe_runs_on_two_cs2s_as_eager_pytorch(tmp_path):
    """The probe's loop on 2 CS-2s: its printed steps, and eager PyTorch's losses (from the run's
    metrics: the probe prints four decimals) under the same warm-up from 0."""
    lines = run(tmp_path, PROBE)
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == [f"step {i}" for i in range(5)]
    assert lines[-1] == "minimal_probe: DONE"
    metrics = [json.loads(line) for line in next(tmp_path.glob("cerebras_logs/run_*/model/metrics.jsonl"))
               .read_text().splitlines()]
    torch.manual_seed(0)
    user = {}
    exec(PROBE.split("    cluster_config")[0].replace("import cerebras.pytorch as cstorch", "") + "    return MLP\n",
         user)
    torch.manual_seed(0)
    model = user["main"]()()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, eps=1e-6, weight_decay=0.0)
    g = torch.Generator().manual_seed(7)
    for step in range(5):
        x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), dtype=torch.int32, generator=g)
        for group in optimizer.param_groups:
            group["lr"] = 3e-4 * step / 500
        loss = F.cross_entropy(model(x), y.long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert metrics[step]["loss"] == pytest.approx(loss.item(), rel=1e-5), step


# -- an operator-compatibility probe: compile only ------------------------------------------------------
# Follows giacomo-brunetta/LASSI-TOOLS compat_tool/checker_cerebras.py @ b366f6fc6f3992dc6cf72de7cbc86121b281a447:
# the precision flag set, ClusterConfig with every sizing field, backend("CSX", artifact_dir=, compile_only=True,
# cluster_config=, compile_dir=), a module in eval mode wrapped to squeeze a batch of one, a forward-only
# step of *batch (no loss, no optimizer, no torch.no_grad), a step closure that only keeps the outputs
# live, DataExecutor(num_steps=1, checkpoint_steps=None, activation_steps=1), the steps counted.

COMPAT = '''
import torch
import cerebras.pytorch as cstorch


class Inner(torch.nn.Module):
    def forward(self, a, b):
        return torch.nn.functional.softmax(a @ b, dim=-1)


class BatchSqueezeModule(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *inputs):
        return self.inner(*(x.squeeze(0) for x in inputs))


class FixedInputDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return torch.randn(4, 8), torch.randn(8, 3)


def check():
    cstorch.backends.csx.precision.optimization_level = 1
    cluster_config = cstorch.distributed.ClusterConfig(num_csx=1, max_wgt_servers=1, max_act_per_csx=1,
                                                       num_workers_per_csx=1, job_time_sec=1800,
                                                       job_labels=["name=lassi-compat"])
    backend = cstorch.backend("CSX", artifact_dir="artifacts", compile_only=True, cluster_config=cluster_config,
                              compile_dir="compile_dir")
    model = cstorch.compile(BatchSqueezeModule(Inner()).eval(), backend)

    def dataloader_factory():
        return torch.utils.data.DataLoader(FixedInputDataset(), batch_size=1)

    dataloader = cstorch.utils.data.DataLoader(dataloader_factory)
    executor = cstorch.utils.data.DataExecutor(dataloader, num_steps=1, checkpoint_steps=None, activation_steps=1)

    @cstorch.trace
    def forward_step(*batch):
        return model(*batch)

    @cstorch.step_closure
    def mark_output(_output):
        pass

    steps = 0
    for batch in executor:
        out = forward_step(*batch)
        mark_output(out)
        steps += 1
    print(f"compat: {steps} step, output {list(out.shape)}")


if __name__ == "__main__":
    check()
'''


def test_an_operator_probe_compiles_only(tmp_path):
    """LASSI-TOOLS' shape: the forward-only step captured (compile only: nothing runs), one step, its
    output's shape, and the flags and fields that mean nothing here taken."""
    lines = run(tmp_path, COMPAT)
    assert lines[-1] == "compat: 1 step, output [4, 3]", lines
    assert any(line.startswith("cstorch: compiled: the evaluation step captured") for line in lines), lines


def test_a_killed_rank_under_the_front_end_is_one_line_of_its_own_type(tmp_path):
    """A rank SIGKILLed under a script's loop: `python -m pyapi.cstorch` says the line `wse fit` says,
    exit code 1, no traceback (it was one ending in RuntimeError; cstorch.JobError still is one). Every
    rank is held at start-up (WSE_TEST_HOLD) when one of them is killed (a rank still starting would
    meet the lost peer, and a peer's error blames a stopped rank)."""
    import os
    import signal
    import time
    from pathlib import Path

    import pyapi.cstorch as cstorch
    from mpi_launch.launcher import job_processes
    from mpi_launch.supervisor import HOLD_ENV

    def events():
        log = next(tmp_path.glob("cerebras_logs/run_*/model/logs/watchdog.log"), None)
        text = log.read_text() if log is not None else ""
        return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines()]  # whole lines

    def held():
        plan = next(tmp_path.glob("cerebras_logs/run_*/model/plan.json"), None)
        return plan is not None and len({e["rank"] for e in events() if e["event"] == "stopped"}) == len(
            json.loads(plan.read_text())["plan"]["roles"])

    assert issubclass(cstorch.JobError, RuntimeError)
    example = Path(__file__).resolve().parents[1] / "examples" / "cstorch_fc.py"
    text = example.read_text()
    assert "micro_batch_size=16)" in text
    # held ranks are stopped ones: only a hang may outlast the time they are given
    (tmp_path / "train.py").write_text(text.replace("micro_batch_size=16)", "micro_batch_size=16, peer_timeout=300)"))
    job = subprocess.Popen([sys.executable, "-m", "pyapi.cstorch", "train.py", "CSX", "2", "2000", "0"], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env={**os.environ, HOLD_ENV: "ready"})
    try:
        deadline = time.monotonic() + 300  # only a hang reaches this
        while not held():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        rank = next(e["rank"] for e in events() if e["event"] == "stopped")
        os.kill(next(e["pid"] for e in events() if e["event"] == "hello" and e["rank"] == rank), signal.SIGKILL)
        _, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    role = json.loads(next(tmp_path.glob("cerebras_logs/run_*/model/plan.json")).read_text())["plan"]["roles"][rank]
    assert job.returncode == 1 and "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith(f"cstorch: rank {rank} ({role} ") and last.endswith(
        "the process died (killed by signal 9 (SIGKILL))"), err
    assert not job_processes(tmp_path)
