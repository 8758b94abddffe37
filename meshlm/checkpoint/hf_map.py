"""The map between meshlm's parameter tree and Hugging Face *ForCausalLM tensors: names and layouts.

One `Leaf` per meshlm parameter says which Hugging Face tensor it comes from ("{i}" is the layer index of a
leaf stacked on a leading [L] axis) and how the layouts relate: every meshlm leaf is a transpose of a reshape
of the Hugging Face tensor, and `Leaf.groups` says which meshlm dimensions each Hugging Face dimension
merges. q_proj [H*D, E] -> wq [E, H, D]; o_proj [E, H*D] -> wo [H, D, E]; gate/up_proj [M, E] -> [E, M];
down_proj [E, M] -> [M, E]; lm_head [V, E] -> [E, V]; q_proj.bias [H*D] -> bq [H, D]. The names are the
same in every family but one: Gemma 2/3's post_attention_layernorm follows attention (post_attn_norm), and
their MLP's input norm is pre_feedforward_layernorm. Norm weights keep the file's values. Both sides apply
RoPE to the two halves of each head ("rotate half"), so q and k need no permutation.

The config.json side of the mapping (validation included) is `meshlm.models.hf_config.from_hf_config`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshlm.models.configs import ModelConfig


@dataclass(frozen=True)
class Leaf:
    """One meshlm parameter and the Hugging Face tensor(s) it comes from (one per layer when stacked)."""

    path: tuple[str, ...]  # ("layers", "attn", "wq")
    hf: str  # Hugging Face name; "{i}" is the layer index
    shape: tuple[int, ...]  # one block: one layer of a stacked leaf, or the whole leaf
    groups: tuple[tuple[int, ...], ...]  # Hugging Face dim k merges these block dims, outermost first
    layers: int = 0  # > 0: stacked on a leading [L] axis

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return (self.layers, *self.shape) if self.layers else self.shape

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[d] for d in g) for g in self.groups)

    @property
    def order(self) -> list[int]:
        """The block dims in Hugging Face order: `to_hf` transposes a block to this, then reshapes."""
        return [d for g in self.groups for d in g]

    def blocks(self) -> Iterator[int | None]:
        """The layer indices of a stacked leaf, or a single None."""
        return iter(range(self.layers)) if self.layers else iter([None])

    def hf_name(self, layer: int | None) -> str:
        return self.hf.format(i=layer)

    def to_meshlm(self, hf: np.ndarray) -> np.ndarray:
        """A view of the Hugging Face tensor in meshlm's layout (no copy)."""
        order = self.order
        return hf.reshape([self.shape[d] for d in order]).transpose(np.argsort(order))

    def to_hf(self, block: np.ndarray) -> np.ndarray:
        return block.transpose(self.order).reshape(self.hf_shape)


def leaves(cfg: ModelConfig) -> list[Leaf]:
    """Every parameter of `meshlm.models.decoder.Decoder` built from cfg, in Hugging Face file order: the
    optional ones (biases, q/k norms, post-norms) where cfg turns them on."""
    E, H, K, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    M, V, L = cfg.mlp_dim, cfg.vocab_size, cfg.n_layers
    vec = ((0,),)
    layer: list[tuple[tuple[str, ...], str, tuple[int, ...], tuple[tuple[int, ...], ...]]] = [
        (("attn_norm", "scale"), "input_layernorm.weight", (E,), vec)
    ]
    for name, proj, heads in (("q", "q_proj", H), ("k", "k_proj", K), ("v", "v_proj", K)):
        layer.append((("attn", f"w{name}"), f"self_attn.{proj}.weight", (E, heads, D), ((1, 2), (0,))))
        if cfg.qkv_bias:
            layer.append((("attn", f"b{name}"), f"self_attn.{proj}.bias", (heads, D), ((0, 1),)))
    layer.append((("attn", "wo"), "self_attn.o_proj.weight", (H, D, E), ((2,), (0, 1))))
    if cfg.out_bias:
        layer.append((("attn", "bo"), "self_attn.o_proj.bias", (E,), vec))
    if cfg.qk_norm:
        layer += [(("attn", f"{n}_norm", "scale"), f"self_attn.{n}_norm.weight", (D,), vec) for n in "qk"]
    if cfg.post_norms:  # Gemma 2/3: a norm after attention, and the MLP's input norm under another name
        layer.append((("post_attn_norm", "scale"), "post_attention_layernorm.weight", (E,), vec))
        layer.append((("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", (E,), vec))
        layer.append((("post_mlp_norm", "scale"), "post_feedforward_layernorm.weight", (E,), vec))
    else:
        layer.append((("mlp_norm", "scale"), "post_attention_layernorm.weight", (E,), vec))
    for name, proj, shape, groups, bias in (
        ("gate", "gate_proj", (E, M), ((1,), (0,)), M),
        ("up", "up_proj", (E, M), ((1,), (0,)), M),
        ("down", "down_proj", (M, E), ((1,), (0,)), E),
    ):
        layer.append((("mlp", name), f"mlp.{proj}.weight", shape, groups))
        if cfg.mlp_bias:
            layer.append((("mlp", f"b_{name}"), f"mlp.{proj}.bias", (bias,), vec))
    out = [Leaf(("embed",), "model.embed_tokens.weight", (V, E), ((0,), (1,)))]
    out += [Leaf(("layers", *p), "model.layers.{i}." + n, s, g, L) for p, n, s, g in layer]
    out.append(Leaf(("final_norm", "scale"), "model.norm.weight", (E,), vec))
    if not cfg.tie_embeddings:
        out.append(Leaf(("lm_head",), "lm_head.weight", (E, V), ((1,), (0,))))
    return out


def hf_tensor_order(cfg: ModelConfig) -> list[tuple[str, Leaf]]:
    """(Hugging Face name, leaf) of every tensor as Hugging Face files hold them: the embeddings, layer 0's
    tensors, layer 1's, ..., the final norm, the head."""
    all_leaves = leaves(cfg)
    tensors = [(leaf.hf_name(None), leaf) for leaf in all_leaves if not leaf.layers and leaf.path == ("embed",)]
    for i in range(cfg.n_layers):
        tensors += [(leaf.hf_name(i), leaf) for leaf in all_leaves if leaf.layers]
    tensors += [(leaf.hf_name(None), leaf) for leaf in all_leaves if not leaf.layers and leaf.path != ("embed",)]
    return tensors


def get_path(tree: Any, path: tuple[str, ...]) -> Any:
    """tree[path[0]][path[1]]...: a leaf of a nested parameter dict."""
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    """Put `value` at `path` in a nested dict, making the inner dicts it needs."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


__all__ = ["Leaf", "leaves", "hf_tensor_order", "get_path", "set_path"]
