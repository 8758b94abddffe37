"""The rematerialisation policies `--remat` names, least recomputation (and most memory) first, and
what each keeps for the backward pass. `meshlm.models.decoder` applies them to each layer,
`meshlm.plan.memory` models what they keep and `meshlm.plan.remat` chooses one for `--remat=auto`."""

from __future__ import annotations

# name -> what a layer keeps, as jax's rule (`rules`: jax.checkpoint_policies; `attn`: `checkpoint_name` tags,
# "qkv" the rotated projections, OUT_NAME / LSE_NAME the attention kernel's output and log-sum-exp, tagged
# inside the kernels so the backward never re-runs attention; "attn_proj" the attention's output projection).
_KEPT = {
    "none": lambda rules, attn: None,  # every activation: fastest, most memory
    "save_dots": lambda rules, attn: rules.dots_with_no_batch_dims_saveable,  # matmul outputs only
    "save_attn": lambda rules, attn: rules.save_only_these_names(*attn, "attn_proj"),  # recompute norms, MLP
    "save_qkv_attn": lambda rules, attn: rules.save_only_these_names(*attn),  # and the output projection
    "full": lambda rules, attn: rules.nothing_saveable,  # only the layer input: the whole layer again
}
POLICIES = tuple(_KEPT)


def checkpoint_policy(name: str):
    """jax's checkpoint policy for the policy `name` (None: keep every activation)."""
    import jax

    from meshlm.ops.attention import LSE_NAME, OUT_NAME

    return _KEPT[name](jax.checkpoint_policies, ("qkv", OUT_NAME, LSE_NAME))
