"""`bind_module_attributes`: bound names are plain instance attributes and stay consistent
with the module's registries when a name is registered again."""

from __future__ import annotations

import torch
from torch import nn

from sous.models.module_attrs import bind_module_attributes


def test_bound_names_follow_re_registration() -> None:
    outer = nn.Sequential()
    outer.inner = nn.Linear(4, 4)
    outer.inner.register_buffer("table", torch.zeros(3))
    bind_module_attributes(outer)
    inner = outer.inner
    assert vars(outer)["inner"] is inner and vars(inner)["weight"] is inner._parameters["weight"]
    assert vars(inner)["table"] is inner._buffers["table"] and "bias" in vars(inner)
    replacement = nn.Linear(4, 2)
    outer.inner = replacement  # nn.Module.__setattr__ drops the stale binding
    assert outer.inner is replacement and outer._modules["inner"] is replacement
    inner.weight = nn.Parameter(torch.ones(4, 4))
    assert torch.equal(inner.weight, torch.ones(4, 4))
    assert inner._parameters["weight"] is inner.weight
