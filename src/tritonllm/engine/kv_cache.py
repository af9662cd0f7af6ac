"""Per-layer key/value buffers, one slot per running sequence, preallocated once.

Layout per layer: (kv_heads, slots, max_model_len, head_dim). A step writes only the new tokens'
keys/values in place. Attention reads views: one slot's first `length` tokens for a prompt
chunk, or every slot's first `length` tokens at once for the batched decode. Freeing a slot is
returning its index: nothing is copied or cleared.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(self, num_layers: int, num_slots: int, max_model_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_kv_heads, num_slots, max_model_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_model_len = max_model_len

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor) -> None:
        """Store (tokens, kv_heads, head_dim) keys/values at (slot, position) of each token."""
        self.keys[layer][:, slots, positions] = key.transpose(0, 1)
        self.values[layer][:, slots, positions] = value.transpose(0, 1)

    def view(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one slot's first `length` tokens, as (kv_heads, length, head_dim) views."""
        return self.keys[layer][:, slot, :length], self.values[layer][:, slot, :length]

    def all_slots(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's first `length` keys and values, as (slots, kv_heads, length, head_dim) views."""
        return (self.keys[layer][:, :, :length].transpose(0, 1),
                self.values[layer][:, :, :length].transpose(0, 1))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
