"""Shared by tests that need a tiny model whose greedy outputs differ between prompts."""

import torch


def spread_weights(model, seed: int, std: float = 0.15) -> None:
    """Re-draw every matrix at `std`: at HF's init scale (0.02) a tiny model's logits are nearly flat
    and greedy decoding repeats one token for every prompt, which makes comparisons vacuous."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std, generator=gen)
