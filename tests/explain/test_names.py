"""Names of compiled collectives as the model calls them."""

from meshlm.explain.names import readable


def test_a_reshard_on_a_layer_loop_edge_is_named_by_its_boundary():
    """JAX 0.12 names the boundary's layout change after the loop it follows; it reads as JAX 0.10's."""
    from meshlm.explain.analysis import _boundary_name

    keys = ["0-0", "1-1"]
    assert _boundary_name("jvp(layers 0-0)/while", keys) == "jvp(boundary 0-0>1-1)/sharding_constraint"
    assert (
        _boundary_name("transpose(jvp(layers 0-0))/while", keys)
        == "transpose(jvp(boundary 0-0>1-1)/sharding_constraint)"
    )
    assert readable(_boundary_name("jvp(layers 0-0)/while", keys)) == "forward of boundary 0-0>1-1"
    for kept in ("jvp(layers 1-1)/while", "jvp(layers 0-0)/while/body/eval_jaxpr/dot_general", ""):
        assert _boundary_name(kept, keys) == kept  # the last range has no boundary after it; body ops keep theirs


def test_collectives_outside_the_differentiated_function_say_what_they_do():
    """ZeRO 0-2's explicit reductions, the pipeline's stage transfers, the optimizer's gather and the
    pipeline-wrapped model ops (the op names `meshlm explain` saw for --zero_stage=2 and --pp=2)."""
    assert (
        readable("shard_map/reduce_scatter")
        == "after the backward: gradients reduce-scattered over the data axes (ZeRO)"
    )
    assert readable("shard_map/psum") == "after the backward: gradients and loss summed over the data axes"
    assert readable("add") == "optimizer update: the updated shards gathered back"
    assert (
        readable("shard_map/while/body/eval_jaxpr/ppermute")
        == "pipeline schedule: activations and gradients passed between stages"
    )
    assert (
        readable("shard_map/while/body/eval_jaxpr/convert_element_type")
        == "weights cast to the compute dtype, before the pipeline schedule"
    )
    assert readable("reduce_sum") == "after the backward: gradient norm and logged metrics"
    assert (
        readable(
            "shard_map/while/body/eval_jaxpr/transpose(jvp())/while/body/eval_jaxpr/checkpoint/bte,btm->em/dot_general"
        )
        == "backward of layers/mlp gate, up projection (gate, up)"
    )
    assert (
        readable("jvp()/while/body/closed_call/convert_element_type")
        == "forward of layers/weights cast to the compute dtype"
    )
