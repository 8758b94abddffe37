"""Names of compiled collectives as the model calls them."""

from meshlm.explain.names import readable


def test_a_reshard_on_a_layer_loop_edge_is_named_by_its_boundary():
    """JAX 0.12 names the boundary's layout change after the loop it follows; it reads as JAX 0.10's."""
    from meshlm.explain.analysis import _boundary_name

    keys = ["0-0", "1-1"]
    assert _boundary_name("jvp(layers 0-0)/while", keys) == "jvp(boundary 0-0>1-1)/sharding_constraint"
    assert _boundary_name("transpose(jvp(layers 0-0))/while", keys) == \
        "transpose(jvp(boundary 0-0>1-1)/sharding_constraint)"
    assert readable(_boundary_name("jvp(layers 0-0)/while", keys)) == "forward of boundary 0-0>1-1"
    for kept in ("jvp(layers 1-1)/while", "jvp(layers 0-0)/while/body/eval_jaxpr/dot_general", ""):
        assert _boundary_name(kept, keys) == kept  # the last range has no boundary after it; body ops keep theirs
