"""The script of examples/torch_script_before.py trained on a rudra-async server: start one
(`rudra-async server --protocol async --lr 0.05 --momentum 0.9`), then run this script with
its address, e.g. `python examples/torch_script_after.py tcp://127.0.0.1:7000 5`. Any
number of copies may run at once: they are the learners.
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rudra_async.torch as rt


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 20)
    y = (x @ torch.randn(20, 3)).argmax(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = rt.DistributedOptimizer(model, sys.argv[1], optimizer=optimizer)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 5):
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step(loss=loss, samples=len(xb))
        print(f"epoch {epoch}: loss {loss.item():.4f}")
    optimizer.close()
    accuracy = (model(x).argmax(1) == y).float().mean().item()
    print(f"accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
