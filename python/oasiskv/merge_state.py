"""merge_state on torch tensors: the attention over a view merged with the remainder estimate of the blocks it
leaves out, by their log-sum-exps. Shared by the engine adapters (oasiskv.transformers, oasiskv.vllm); needs
torch, which ``import oasiskv`` does not.
"""
from __future__ import annotations

import torch


def merge_state(out, lse, rest, rest_lse):
    """(e^lse out + e^rest_lse rest) / (e^lse + e^rest_lse), with lse from logaddexp: out / rest [..., d],
    lse / rest_lse [...]."""
    total = torch.logaddexp(lse, rest_lse)
    return out * torch.exp(lse - total)[..., None] + rest * torch.exp(rest_lse - total)[..., None]
