"""A training script written for Cerebras' PyTorch API, as its "custom training loop" tutorial has it
(an FC model on MNIST-like data, made here), run on 2 emulated CS-2s: the one line that differs from
a script for a real system is the import. Run it from the repository's root:

    python examples/cstorch_fc.py [CSX|CPU] [num_csx] [num_steps] [checkpoint_steps]
"""
import sys

import torch

import pyapi.cstorch as cstorch  # on a real system: import cerebras.pytorch as cstorch


class FC(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)


def input_fn(batch_size):
    """28x28 "digits": noise around one of ten fixed patterns; the label is the pattern."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.rand(10, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (4096,), generator=g)
    images = patterns[labels] + 0.5 * torch.randn(4096, 1, 28, 28, generator=g)
    dataset = torch.utils.data.TensorDataset(images, labels)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=g)


def main(kind="CSX", num_csx=2, num_steps=50, checkpoint_steps=50):
    torch.manual_seed(0)
    backend = cstorch.backend(kind, num_csx=num_csx, micro_batch_size=16)   # "CPU": the same bits, in this process
    model = FC()
    compiled = cstorch.compile(model, backend)
    optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()

    @cstorch.trace
    def training_step(inputs, targets):
        loss = loss_fn(compiled(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    @cstorch.step_closure
    def print_loss(loss, step):
        print(f"step {step}: loss {loss.item()!r}")

    @cstorch.checkpoint_closure
    def save_checkpoint(step):
        cstorch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"checkpoint_{step}.h5")
        print(f"saved checkpoint_{step}.h5")

    train_dataloader = cstorch.utils.data.DataLoader(input_fn, 64)
    executor = cstorch.utils.data.DataExecutor(train_dataloader, num_steps=num_steps,
                                               checkpoint_steps=checkpoint_steps)
    for step, (inputs, targets) in enumerate(executor, start=1):
        loss = training_step(inputs, targets)
        print_loss(loss, step)
        save_checkpoint(step)
    return model


if __name__ == "__main__":
    main(*sys.argv[1:2], *map(int, sys.argv[2:5]))
