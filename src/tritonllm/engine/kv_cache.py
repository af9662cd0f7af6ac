"""Per-layer key/value buffers in fixed-size blocks, preallocated once (the pool of block_manager.py).

Layout per layer: one tensor (2 kv_heads, blocks, block_size, head_dim), keys in the first
kv_heads and values in the rest, so that a step stores its new keys and values with one write.
Attention reads a sequence's keys by gathering its blocks, in table order, into one contiguous
run (`gather`): one copy of what attention reads anyway, ~25 % of a decode call's time measured
here (index_select; advanced indexing took 3x as long). Freeing a block is handing back its id:
nothing is copied or cleared.
"""

from __future__ import annotations

import torch

from tritonllm.engine.block_manager import NULL_BLOCK


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (2 * num_kv_heads, num_blocks, block_size, head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_kv_heads = num_kv_heads
        self.num_blocks = num_blocks
        self.block_size = block_size

    def token_index(self, blocks: list[int], positions: range) -> list[int]:
        """Where each position of a sequence lives in the flattened pool; positions past its table
        go to the null block (padding rows)."""
        size = self.block_size
        return [(blocks[p // size] if p // size < len(blocks) else NULL_BLOCK) * size + p % size
                for p in positions]

    def write(self, layer: int, index: torch.Tensor, key_value: torch.Tensor) -> None:
        """Store (tokens, 2 kv_heads, head_dim) keys then values at each token's `token_index`."""
        kv = self.layers[layer]
        flat = kv.view(kv.shape[0], -1, kv.shape[-1])  # (2 kv_heads, blocks * block_size, head_dim)
        flat.index_copy_(1, index, key_value.transpose(0, 1))

    def gather(self, layer: int, tables: torch.Tensor, num_keys: int) -> torch.Tensor:
        """Keys and values of each table's first `num_keys` positions: (rows, 2 kv_heads, num_keys, dim).
        tables: (rows, blocks) block ids, padded with the null block to cover num_keys."""
        kv = self.layers[layer]
        rows, width = tables.shape
        picked = kv.view(kv.shape[0], self.num_blocks, -1).index_select(1, tables.reshape(-1))
        return picked.view(kv.shape[0], rows, width * self.block_size, kv.shape[-1])[:, :, :num_keys].transpose(0, 1)

    def table_tensor(self, tables: list[list[int]], num_keys: int, device) -> torch.Tensor:
        """(rows, blocks covering num_keys) block ids, each table cut or padded with the null block."""
        width = -(-num_keys // self.block_size)
        return torch.tensor([t[:width] + [NULL_BLOCK] * max(0, width - len(t)) for t in tables], device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * block_size * head_dim * torch.empty(0, dtype=dtype).element_size()
