"""A step's work between its matmuls, two ways with one interface; model_runner.py picks one per step.

- `TorchOps`: PyTorch ops, the model's own numerics (float32 answers equal `generate`'s, tested);
  every device and dtype.
- `KernelOps`: CPU in bfloat16 (the shipped case): layer_kernels.py's compiled loops, or their
  native twins (native/layer_ops.cpp) where the native kernels load, a few calls a layer instead of
  ~30 ops, into buffers made once per step.

Both: `add_norm(hidden, delta, weight)` adds a residual and applies an RMSNorm; `attention(qkv,
layer)` rotates q and k, stores the new keys and values, and attends (decode rows by their true
lengths, prompt rows in tiles, prefill_attention.py); `act_mul(gate_up)` is the gated activation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tritonllm.engine.decode_attention import DecodeAttention
from tritonllm.engine.kv_cache import KVGather
from tritonllm.kernels.numba_helpers import as_numpy
from tritonllm.kernels.paged_attention import PagedDecode
from tritonllm.kernels.prefill_attention import PREFILL_TILE, prefill_attention


@dataclass
class StepLayout:
    """Where every scheduled token of a step sits: its id, position and KV slot, which rows go the
    decode path (their lengths and block tables) and which prompt rows go in tiles."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    write_index: list[int] = field(default_factory=list)  # each token's slot in the flattened pool
    ends: list[int] = field(default_factory=list)  # each chunk's last row
    prompt_chunks: list = field(default_factory=list)  # (first row, rows, chunk)
    decode_rows: list[int] = field(default_factory=list)
    decode_lengths: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    row_groups: list[tuple[int, int]] = field(default_factory=list)  # consecutive: a prompt tile's rows, or one row


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as Llama, Mistral and Qwen compute it: in float32, rounded before the weight.
    `F.rms_norm` without the weight computes a bf16 input in float32 and rounds its result: bit for
    bit the model's own ops (tested on 10^5 values), at a third of the time of upcasting first
    (which took two more ops). With the weight it would apply it before rounding: in bfloat16 that
    moved a near-tied greedy token."""
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


class PrefillRows:
    """The prompt rows of a step, attended in tiles over their sequences' keys (after the write)."""

    def __init__(self, runner, layout: StepLayout):
        self.chunks = layout.prompt_chunks
        self.gathers = [KVGather(runner.cache, [c.blocks], c.start + n, PREFILL_TILE) for _, n, c in self.chunks]
        self.kv_heads, self.scaling, self.call_rows = runner.num_kv_heads, runner.scaling, runner.prefill_call_rows

    def __call__(self, q: torch.Tensor, out: torch.Tensor, layer: int) -> None:
        """q, out: (tokens, heads, dim); out's prompt rows are filled."""
        for (off, n, c), gather in zip(self.chunks, self.gathers):
            out[off:off + n] = prefill_attention(q[off:off + n], gather(layer), c.start, self.kv_heads, self.scaling,
                                                 self.call_rows)


class TorchOps:
    def __init__(self, runner, layout: StepLayout):
        dev = runner.device
        self.runner = runner
        self.index = torch.tensor(layout.write_index, device=dev)
        self.cos, self.sin = runner.rotary.at(torch.tensor(layout.positions, device=dev))  # (T, all heads, dim)
        self.decodes = (DecodeAttention(layout.decode_rows, layout.decode_lengths, layout.decode_tables, runner.cache,
                                        runner.num_kv_heads, runner.scaling, dev,
                                        runner.num_heads // runner.num_kv_heads, runner.head_dim, runner.dtype,
                                        runner.paged_decode, runner.native_attention)
                        if layout.decode_rows else None)
        self.prefill = PrefillRows(runner, layout)

    def add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        """(hidden + delta, rms_norm of it)."""
        if delta is not None:
            hidden = hidden + delta
        return hidden, rms_norm(hidden, weight, self.runner.eps)

    def attention(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        r = self.runner
        heads, dim = r.num_heads, r.head_dim
        qkv = qkv.view(qkv.shape[0], -1, dim)
        # Rotary on q and k; the v heads' table is cos 1, sin 0 (v passes through unchanged).
        qkv = qkv * self.cos + qkv.roll(dim // 2, -1) * self.sin
        q = qkv[:, :heads]
        r.cache.write(layer, self.index, qkv[:, heads:])
        if not self.prefill.chunks:
            out = self.decodes(q, layer)
        else:
            out = torch.empty_like(q)
            if self.decodes is not None:
                out[self.decodes.rows] = self.decodes(q, layer)
            self.prefill(q, out, layer)
        return out.reshape(-1, heads * dim)

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.runner.act(gate) * up


class KernelOps:
    def __init__(self, runner, layout: StepLayout):
        r = self.runner = runner
        tokens, width = len(layout.ids), r.num_heads * r.head_dim
        self.positions = np.asarray(layout.positions, np.int64)
        self.write_index = np.asarray(layout.write_index, np.int64)
        self.decode_rows = np.asarray(layout.decode_rows, np.int64)
        self.decode_of = np.full(tokens, -1, np.int64)
        self.decode_of[self.decode_rows] = np.arange(len(self.decode_rows))
        self.q_decode = np.empty((len(self.decode_rows), width), np.float32)
        self.paged = (PagedDecode(layout.decode_lengths, layout.decode_tables, r.num_kv_heads,
                                  r.num_heads // r.num_kv_heads, r.head_dim, r.scaling, r.dtype,
                                  r.native_attention)
                      if layout.decode_rows else None)
        self.prefill = PrefillRows(runner, layout)
        # Buffers reused by every layer: each is read by the next matmul before it is written again.
        self.q, self.out = torch.empty(tokens, width, dtype=r.dtype), torch.empty(tokens, width, dtype=r.dtype)
        self.normed = torch.empty(tokens, r.config.hidden_size, dtype=r.dtype)
        self.act = torch.empty(tokens, r.config.intermediate_size, dtype=r.dtype)
        self.q_np, self.out_np, self.normed_np, self.act_np = map(as_numpy, (self.q, self.out, self.normed, self.act))

    def add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        """hidden += delta in place; (hidden, rms_norm of it in a buffer of the step)."""
        self.runner.layer_ops.add_rms_norm(as_numpy(hidden), None if delta is None else as_numpy(delta),
                                   self.runner.numpy_weight(weight), self.runner.eps, self.normed_np)
        return hidden, self.normed

    def attention(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        r = self.runner
        r.layer_ops.rotate_and_store(as_numpy(qkv), r.rotary_cos, r.rotary_sin, self.positions, self.write_index,
                                     r.cache.numpy_flat(layer), self.q_np, self.decode_of, self.q_decode, r.num_heads)
        if self.paged is not None:
            queries = self.q_decode.reshape(len(self.decode_rows), r.num_kv_heads, -1, r.head_dim)
            self.paged.run(queries, r.cache.numpy_layer(layer), self.out_np, self.decode_rows)
        if self.prefill.chunks:
            shape = (self.q.shape[0], r.num_heads, r.head_dim)
            self.prefill(self.q.view(shape), self.out.view(shape), layer)
        return self.out

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        self.runner.layer_ops.silu_mul(as_numpy(gate_up), self.act_np)
        return self.act
