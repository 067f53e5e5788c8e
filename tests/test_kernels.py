"""The numpy update kernel equals torch.optim.SGD, in place and out of place."""
import numpy as np
import pytest
import torch

from rudra_async import kernels


@pytest.mark.parametrize("momentum, weight_decay, nesterov", [(0.0, 0.0, False), (0.9, 1e-3, False), (0.9, 0.01, True)])
@pytest.mark.parametrize("size", [1, 1000, kernels.BLOCK * 2 + 17])
def test_numpy_kernel_matches_torch_sgd(momentum, weight_decay, nesterov, size):
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(size).astype(np.float32)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.SGD([p], lr=0.05, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    w, v = w0.copy(), np.zeros(size, np.float32)
    for step in range(20):
        grads = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
        scales = [0.5, 0.25, 0.25]
        p.grad = torch.from_numpy(sum(s * g for s, g in zip(scales, grads)).astype(np.float32))
        opt.step()
        out = w if step % 2 else np.empty_like(w)  # alternate in place / out of place
        kernels.apply(w, out, v, grads, scales, 0.05, momentum, weight_decay, nesterov)
        w = out
        np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_kernel_rejects_mismatched_scales():
    w = np.zeros(4, np.float32)
    with pytest.raises(ValueError):
        kernels.apply(w, w, w.copy(), [w], [1.0, 2.0], 0.1)
