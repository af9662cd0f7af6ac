"""One forward pass per step for every scheduled token of every sequence, packed into one row.

The runner computes the Hugging Face model's layers with the model's own weights and numerics,
in fewer, larger ops: q|k|v and gate|up are one matmul each (fused_weights.py), rotary cos/sin
come from tables made once by the model's rotary module (rotary.py), and each layer stores its
new keys and values with one write. Every matmul goes through linear.py, which picks the kernel
once per weight (oneDNN prepacked in bf16 on CPU, int8 with `quantization="int8"`, plain
`F.linear` in float32, bit-equal to the model's own), in calls cut by the step's row groups where
AMX needs it (`call_ranges`). The work between the matmuls is step_ops.py's: compiled loops on CPU
in bf16 (layer_kernels.py), PyTorch ops elsewhere; a step whose rows all decode runs its layers
in one native call where every piece has a native kernel (kernels/decode_layers.py: the same
kernels, the same bits). In float32 greedy answers equal the
model's own `generate` token for token (tested). Attention and the KV cache are ours: keys and
values live in fixed-size blocks (`PagedKVCache`), each sequence in the blocks of its table (the
scheduler's block_manager.py hands them out); prompt rows attend over their sequence's keys in
tiles fixed by position (prefill_attention.py), generated rows through their block tables at the
cost of their true lengths (decode_attention.py; paged_attention.py on CPU). Both make a row's
result independent of the others in the step (batch invariance, tested in bf16 too), and which
path a row takes depends only on its position and its prompt's length, so a row computed again
(a prefix-cache miss, a preempted sequence) gets the same bits.
Logits are computed only at each sequence's last scheduled token, and only where a token is
sampled.

Measured (bench notes in docs/benchmarks.md): a decode step is bound by streaming the weights
from memory; capturing it with `torch.compile` on CPU gave no gain (and 30 s of compile), so
there is none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from tritonllm.kernels import decode_layers, layer_kernels, native, paged_attention, prefill_attention
from tritonllm.engine.fused_weights import fuse_layer
from tritonllm.engine.kv_cache import PagedKVCache
from tritonllm.kernels.linear import Call, call_ranges, linear, nbytes, prepare
from tritonllm.kernels.numba_helpers import as_numpy
from tritonllm.kernels.prefill_attention import PREFILL_TILE
from tritonllm.kernels.quantization import resolve_quantization
from tritonllm.engine.rotary import RotaryTables
from tritonllm.engine.step_ops import KernelOps, StepLayout, TorchOps, rms_norm

# Decoder-only models with the Llama layout (pre-norm, rotary, GQA, gated MLP). Qwen3 adds
# per-head q/k norms, which the runner applies when present.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Chunk:
    blocks: list[int]  # the sequence's KV block table
    token_ids: list[int]
    start: int  # position of token_ids[0] in the sequence
    wants_logits: bool
    prompt_end: int | None = None  # the sequence's prompt length (None: the chunk is all prompt)
    all_logits: bool = False  # logits of every row, not only the last (prompt logprobs)

    def paths(self, offset: int) -> tuple[tuple[int, int] | None, list[int]]:
        """(first row, rows) of the chunk's prefill-path rows, or None, and the packed indices of its
        decode-path rows. Rows at or past the prompt's end go the decode path, as they did when
        generated; so does a prompt's last row alone in its tile: cut at that tile's start, the same
        row comes as a 1-token chunk, and it must be computed the same way (batch invariance)."""
        n = len(self.token_ids)
        prompt_rows = n if self.prompt_end is None else max(0, min(n, self.prompt_end - self.start))
        if prompt_rows > 1 and (self.start + prompt_rows) % PREFILL_TILE == 1:
            prompt_rows -= 1
        if prompt_rows < 2:
            return None, list(range(offset, offset + n))
        return (offset, prompt_rows), list(range(offset + prompt_rows, offset + n))


def logit_rows(chunk: Chunk, end: int) -> range:
    """The rows of a chunk ending at row `end` whose logits the step returns."""
    if chunk.all_logits:
        return range(end + 1 - len(chunk.token_ids), end + 1)
    return range(end, end + 1) if chunk.wants_logits else range(0)


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported by the in-flight runner; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(config, "use_sliding_window", False) or (
        model_type == "mistral" and getattr(config, "sliding_window", None)
    ):
        raise ValueError("sliding-window attention is not supported by the in-flight runner")


class ModelRunner:
    def __init__(self, model, num_slots: int, max_model_len: int, quantization: str | None = None,
                 num_blocks: int = 0, block_size: int = 64, batch_invariant: bool = True):
        """num_slots: rows of a decode step at most (max_num_seqs); num_blocks: KV blocks of the pool
        with the null block (0: room for num_slots sequences of max_model_len, see `slot_blocks`);
        batch_invariant: cut the matmuls' rows where the kernel needs it for every row to get the same
        bits in any step (`call_ranges`); false: one call a weight a step."""
        check_supported(model.config)
        self.model = model
        self.config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.quantization = resolve_quantization(quantization, self.dtype, self.device)
        base = model.model
        self.embed = base.embed_tokens
        # The matmul weights in the form linear.py multiplies fastest; norms, embeddings and biases stay.
        self.layers = [replace(w, **{name: prepare(getattr(w, name), self.quantization, num_slots)
                                     for name in ("qkv", "o", "gate_up", "down")})
                       for w in map(fuse_layer, base.layers)]
        self.lm_head_weight = prepare(model.lm_head.weight, self.quantization, num_slots)
        self.batch_invariant = batch_invariant
        self.row_block = getattr(self.lm_head_weight, "row_block", None)  # every prepared weight's
        # The longest call of prompt tiles that keeps every layer weight's bits (linear.py).
        self.tile_rows = min((getattr(getattr(w, name), "tile_rows", None) or 0 for w in self.layers
                              for name in ("qkv", "o", "gate_up", "down")), default=0) or None
        # What a decode step streams from memory at least: every matmul weight once.
        self.weight_bytes = nbytes(self.lm_head_weight) + sum(
            nbytes(getattr(w, name)) for w in self.layers for name in ("qkv", "o", "gate_up", "down"))
        self.act = base.layers[0].mlp.act_fn
        self.eps = base.norm.variance_epsilon
        self.norm = base.norm
        attn = base.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = self.config.num_attention_heads
        self.num_kv_heads = self.config.num_key_value_heads
        self.scaling = attn.scaling
        self.max_model_len = max_model_len
        self.blocks_per_slot = -(-max_model_len // block_size)
        self.cache = PagedKVCache(len(self.layers), num_blocks or num_slots * self.blocks_per_slot + 1, block_size,
                                  self.num_kv_heads, self.head_dim, self.dtype, self.device,
                                  lane_blocks=self.blocks_per_slot)
        # Decode rows through paged_attention.py where it runs, else PyTorch's flash kernel (benchmarks set it).
        self.paged_decode = paged_attention.available(self.dtype, self.device)
        self.native_attention = native.kernel() is not None  # fixed at load, as the linears' choice is
        if self.paged_decode:
            paged_attention.warm_up(self.dtype)
        # Whole prompt tiles share attention calls only where that keeps their bits here (checked once).
        self.prefill_call_rows = prefill_attention.shared_call_rows(self.num_heads, self.num_kv_heads, self.head_dim,
                                                                    self.dtype, str(self.device))
        self.rotary = RotaryTables(base.rotary_emb, max_model_len, self.num_heads, self.num_kv_heads,
                                   self.dtype, self.device)
        # The work between the matmuls: compiled kernels where they run (CPU, bf16), else PyTorch ops
        # (step_ops.py; benchmarks set it).
        self.cpu_kernels = layer_kernels.available(self.dtype, self.device, getattr(self.config, "hidden_act", ""))
        # The native twins of layer_kernels.py's loops where the native kernels load (the same bits, tested).
        self.layer_ops = native.kernel() or layer_kernels
        if self.cpu_kernels:
            if self.layer_ops is layer_kernels:
                layer_kernels.warm_up()
            self.rotary_cos, self.rotary_sin = as_numpy(self.rotary.cos), as_numpy(self.rotary.sin)
            self.norm_weights = {id(w): as_numpy(w) for lw in self.layers for w in (lw.input_norm, lw.post_norm)}
        # A step whose rows all decode runs its layers in one native call where every piece has a
        # native kernel (decode_layers.py: the same kernels and bits as the loop); None: the loop.
        self.decode_layers = (decode_layers.build(self.layers, self.cache.layers, self.rotary.cos, self.rotary.sin,
                                                  self.num_heads, self.num_kv_heads, self.head_dim, self.eps,
                                                  self.scaling)
                              if self.cpu_kernels and self.native_attention else None)

    def slot_blocks(self, slot: int) -> list[int]:
        """The blocks of lane `slot`: a fixed table, at home (benchmarks, tests)."""
        first = 1 + slot * self.blocks_per_slot
        return list(range(first, first + self.blocks_per_slot))

    def numpy_weight(self, weight: torch.Tensor):
        """A norm weight of a layer as the kernels read it (views made once)."""
        return self.norm_weights[id(weight)]

    def layout(self, chunks: list[Chunk]) -> StepLayout:
        step = StepLayout()
        for c in chunks:
            n, first = len(c.token_ids), len(step.ids)
            prefill, decodes = c.paths(first)
            if prefill is not None:
                step.prompt_chunks.append((*prefill, c))
                row, end = prefill[0], prefill[0] + prefill[1]
                while row < end:  # the prompt's tiles (prefill_attention.py): always the same rows
                    tile_end = min(end, row + PREFILL_TILE - (c.start + row - first) % PREFILL_TILE)
                    step.row_groups.append((row, tile_end))
                    row = tile_end
            step.row_groups.extend((row, row + 1) for row in decodes)
            for row in decodes:
                step.decode_rows.append(row)
                step.decode_lengths.append(c.start + row - first + 1)
                step.decode_tables.append(c.blocks)
            step.ids.extend(c.token_ids)
            step.positions.extend(range(c.start, c.start + n))
            step.write_index.extend(self.cache.token_index(c.blocks, range(c.start, c.start + n)))
            step.ends.append(len(step.ids) - 1)
        return step

    def qk_norm(self, qkv: torch.Tensor, w) -> torch.Tensor:
        """Qwen3: each head of q and k normalised before rotary."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = qkv.view(qkv.shape[0], -1, self.head_dim)
        return torch.cat([rms_norm(qkv[:, :heads], w.q_norm, self.eps),
                          rms_norm(qkv[:, heads:heads + kv_heads], w.k_norm, self.eps),
                          qkv[:, heads + kv_heads:]], dim=1).view(qkv.shape[0], -1)

    def layer_loop(self, layout: StepLayout, hidden: torch.Tensor):
        """The decoder layers a piece a call: (hidden, the last layer's output, not yet added)."""
        ops = (KernelOps if self.cpu_kernels else TorchOps)(self, layout)
        # How the matmuls cut the rows (linear.py): for batch invariance, or all in one call.
        calls = (call_ranges(layout.row_groups, self.row_block, self.tile_rows) if self.batch_invariant
                 else [Call(0, len(layout.ids), len(layout.ids))])
        delta = None
        for layer_idx, w in enumerate(self.layers):
            hidden, h = ops.add_norm(hidden, delta, w.input_norm)
            qkv = linear(h, w.qkv, w.qkv_bias, calls)
            if w.q_norm is not None:
                qkv = self.qk_norm(qkv, w)
            hidden, h = ops.add_norm(hidden, linear(ops.attention(qkv, layer_idx), w.o, w.o_bias, calls), w.post_norm)
            delta = linear(ops.act_mul(linear(h, w.gate_up, calls=calls)), w.down, calls=calls)
        return hidden, delta

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run the chunks; return float32 logits in chunk order: every row of an `all_logits` chunk,
        the last row of any other chunk that wants logits."""
        layout = self.layout(chunks)
        hidden = self.embed(torch.tensor(layout.ids, device=self.device))  # (T, hidden)
        if self.decode_layers is not None and layout.decode_rows and not layout.prompt_chunks:
            tables, lengths, order = paged_attention.decode_rows(layout.decode_lengths, layout.decode_tables,
                                                                 self.num_kv_heads)
            delta = self.decode_layers.forward(hidden, np.asarray(layout.positions, np.int64),
                                               np.asarray(layout.write_index, np.int64), tables, lengths, order)
        else:
            hidden, delta = self.layer_loop(layout, hidden)
        hidden = hidden + delta
        last = [row for end, c in zip(layout.ends, chunks) for row in logit_rows(c, end)]
        if not last:
            return torch.empty(0, self.config.vocab_size)
        picked = self.norm(hidden[torch.tensor(last, device=self.device)])
        whole = None if self.batch_invariant else [Call(0, len(last), len(last))]  # None: calls of row_block rows
        return linear(picked, self.lm_head_weight, self.model.lm_head.bias, whole).float()

    def decode_ceiling_step(self, lengths: list[int]) -> torch.Tensor:
        """One decode step for every slot at the given lengths: the runner's speed limit (benchmarks)."""
        chunks = [Chunk(self.slot_blocks(slot), [0], length, True) for slot, length in enumerate(lengths)]
        return self.forward(chunks)

