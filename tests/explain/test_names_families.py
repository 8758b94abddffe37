"""Names of the collectives a model with a local/global layer pattern and tied embeddings adds (the op
names `meshlm explain` saw for a gemma-like test model, pattern LG, on --mesh_dim=2,2,2,1)."""

from meshlm.explain.names import readable


def test_pattern_layers_and_the_tied_head_are_named():
    assert readable("jvp()/while/body/eval_jaxpr/squeeze") == "forward of layers/weights of one layer of the pattern"
    assert (
        readable("transpose(jvp())/while/body/jit(dynamic_index_in_dim)/squeeze")
        == "backward of layers/weights of one layer of the pattern"
    )
    assert readable("jvp()/transpose") == "forward of lm_head (the tied embedding table)"
