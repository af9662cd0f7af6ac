"""Rotary position tables, computed once by the model's own rotary module and indexed per step.

`at(positions)` gives cos and sin for every head of a fused q|k|v row, so that one expression
rotates q and k and passes v through: x * cos + roll(x, dim/2) * sin. The sin table carries the
sign of rotate_half (-sin on the first half), and the v heads get cos 1, sin 0. The values equal
what the model's own rotary embedding computes: the same module makes them.
"""

from __future__ import annotations

import torch


class RotaryTables:
    def __init__(self, rotary_emb, max_model_len: int, num_heads: int, num_kv_heads: int, dtype, device):
        positions = torch.arange(max_model_len, device=device)[None]
        probe = torch.zeros(1, dtype=dtype, device=device)
        with torch.inference_mode():
            cos, sin = rotary_emb(probe, positions)  # (1, max_model_len, head_dim), in the model's dtype
        half = cos.shape[-1] // 2
        self.cos = cos[0].contiguous()
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).contiguous()
        self.rotated_heads = num_heads + num_kv_heads  # q and k
        self.num_kv_heads = num_kv_heads

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape (tokens, q + k + v heads, head_dim) at these positions."""
        n, dim = positions.shape[0], self.cos.shape[-1]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        ones = cos.new_ones(n, self.num_kv_heads, dim)
        return (torch.cat([cos.expand(n, self.rotated_heads, dim), ones], dim=1),
                torch.cat([sin.expand(n, self.rotated_heads, dim), torch.zeros_like(ones)], dim=1))
