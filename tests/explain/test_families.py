"""`meshlm explain` on a gemma-like test model: the families' small weights laid out as their axes say
(norm scales and [embed] biases over fsdp, q/k/v biases over tp, q/k norm scales whole) and every
collective named as the model calls it."""

import json

import pytest

from meshlm.cli import main

GEMMA_LIKE = [
    "--model=test", "--model.n_layers=2", "--model.n_kv_heads=4", "--model.post_norms=true",
    "--model.qk_norm=true", "--model.qkv_bias=true", "--model.norm_offset=1.0", "--model.embed_scale=true",
    "--model.mlp_activation=gelu_tanh", "--model.sliding_window=16", "--model.layer_pattern=LG",
    "--model.attn_logit_softcap=50", "--model.final_logit_softcap=30", "--model.tie_embeddings=true",
]  # fmt: skip


@pytest.mark.slow
def test_explain_a_gemma_like_model(capsys):
    flags = ["--devices=8", "--mesh_dim=2,2,2,1", "--batch_size=8", "--seq_len=32", "--dtype=float32", "--json"]
    assert main(["explain", *GEMMA_LIKE, *flags]) == 0
    doc = json.loads(capsys.readouterr().out)
    specs = {p["path"]: p["spec"] for p in doc["parameters"]}
    assert specs["layers/post_attn_norm/scale"] == specs["layers/attn_norm/scale"] == "P(None, 'fsdp')"
    assert specs["layers/attn/bq"] == "P(None, 'tp', None)"
    assert specs["layers/attn/q_norm/scale"] == "P(None, None)"
    names = {c["where"] for c in doc["collectives"]}
    assert not [n for n in names if n.endswith(("/squeeze", " of transpose"))], names
    assert any("weights of one layer of the pattern" in n for n in names)
