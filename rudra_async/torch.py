"""The PyTorch API: train your own model, data and loss on a rudra-async server.

    import rudra_async.torch as rt

    opt = rt.DistributedOptimizer(model, "tcp://server:7000", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    loader = DataLoader(train_set, batch_size=32, sampler=rt.ShardSampler(train_set))  # this learner's part
    ...
    loss.backward()
    opt.step(loss=loss, samples=len(x))

See :mod:`rudra_async.learner.api` for what is sent (parameters with ``requires_grad``, in
the optimizer's group order; frozen parameters and buffers such as BatchNorm statistics as
the model's state), schedulers and ``state_dict``, and the ``overlap`` option;
:mod:`rudra_async.learner.local_group` for learner groups (``group=LocalGroup(...)``);
:mod:`rudra_async.learner.sampler` for how data is split among learners. The README's "Use
it from your own training script" shows a whole script.
"""

from __future__ import annotations

from .errors import LearnerError
from .learner.api import DistributedOptimizer
from .learner.local_group import LocalGroup
from .learner.sampler import ShardSampler

__all__ = ["DistributedOptimizer", "LearnerError", "LocalGroup", "ShardSampler"]
