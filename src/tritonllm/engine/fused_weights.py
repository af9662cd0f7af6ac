"""A decoder layer's weights, rearranged once at load for fewer, larger ops per step.

q, k and v projections become one matrix (one matmul instead of three), gate and up become one
(one instead of two). The values are the model's own, concatenated: nothing is approximated.
The Hugging Face modules keep working: their weights become views into the fused matrices, so
no memory is doubled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # (q_heads + 2 kv_heads) * head_dim rows: q, then k, then v
    qkv_bias: torch.Tensor | None  # Qwen2 has q/k/v biases
    q_norm: torch.Tensor | None  # Qwen3 normalises each head of q and k
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate rows, then up rows
    down: torch.Tensor


def _fuse(linears, name: str) -> torch.Tensor | None:
    """Concatenate the `name` tensors (weight or bias) of `linears`; make theirs views of the result."""
    parts = [getattr(linear, name) for linear in linears]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.detach() for p in parts], dim=0)
    offset = 0
    for linear, part in zip(linears, parts):
        view = fused[offset:offset + part.shape[0]]
        setattr(linear, name, torch.nn.Parameter(view, requires_grad=False))
        offset += part.shape[0]
    return fused


def _weight(module, name: str = "weight") -> torch.Tensor | None:
    value = getattr(module, name, None) if module is not None else None
    return value.detach() if value is not None else None


def fuse_layer(layer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    return LayerWeights(
        input_norm=_weight(layer.input_layernorm),
        qkv=_fuse(qkv, "weight"),
        qkv_bias=_fuse(qkv, "bias"),
        q_norm=_weight(getattr(attn, "q_norm", None)),
        k_norm=_weight(getattr(attn, "k_norm", None)),
        o=_weight(attn.o_proj),
        o_bias=_weight(attn.o_proj, "bias"),
        post_norm=_weight(layer.post_attention_layernorm),
        gate_up=_fuse((mlp.gate_proj, mlp.up_proj), "weight"),
        down=_weight(mlp.down_proj),
    )
