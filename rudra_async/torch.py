"""The PyTorch API: train your own model, data and loss on a rudra-async server.

    import rudra_async.torch as rt

    opt = rt.DistributedOptimizer(model, "tcp://server:7000", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ...
    loss.backward()
    opt.step(loss=loss, samples=len(x))

See :mod:`rudra_async.learner.api` for what is sent (parameters with ``requires_grad``, in
the optimizer's group order), what stays local (frozen parameters, buffers such as
BatchNorm statistics) and the ``overlap`` option; the README's "Use it from your own
training script" shows a whole script.
"""

from __future__ import annotations

from .errors import LearnerError
from .learner.api import DistributedOptimizer

__all__ = ["DistributedOptimizer", "LearnerError"]
