"""Gradient comparisons the learner tests share: a list of tensors against a reference list."""

import torch


def rel(a, b) -> float:
    """max |a - b| over the largest |b|, over every tensor of the lists."""
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True)) / max(y.abs().max().item() for y in b)


def grads(model, loss) -> list[torch.Tensor]:
    """d loss / d each trainable parameter (zeros where it does not reach)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [torch.zeros_like(p) if g is None else g
            for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params, strict=True)]
