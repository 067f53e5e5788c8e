"""A plain PyTorch training script: a small classifier on synthetic data.

examples/torch_script_after.py is the same script trained on a rudra-async server; the two
differ in a handful of lines (tests/test_examples.py checks that they do, and runs both).
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 20)
    y = (x @ torch.randn(20, 3)).argmax(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 5):
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}")
    accuracy = (model(x).argmax(1) == y).float().mean().item()
    print(f"accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
