"""Two loaded states compared the way a resume needs them equal: the same containers and keys,
and every tensor with the same dtype, geometry (shape, stride, storage offset), autograd flag,
conjugate bit and values; numpy arrays by value; anything else by ``==``."""

from __future__ import annotations

import numpy as np
import torch


def same_state(a: object, b: object) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            same_state(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset()
        assert a.requires_grad == b.requires_grad and a.is_conj() == b.is_conj()
        assert torch.equal(a.resolve_conj().detach(), b.resolve_conj().detach())
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert a == b
