"""The model's names for where a collective comes from, instead of JAX's op names.

XLA's metadata names an operation by the JAX transforms around it and the primitive, e.g.
`transpose(jvp())/while/body/closed_call/bte,ekd->btkd/dot_general`: the backward (`transpose`) of
the forward (`jvp`), inside the scan over the layers (`while/body`), of the einsum that projects keys
and values. `readable` turns that into "backward of layers/attn k, v projection (wk, wv)"; a fused
operation (`(a:b:c)`) lists each of its parts once.
"""

from __future__ import annotations

import re

from meshlm.ops.linear import gradient_specs

# The model's einsums (meshlm/models/llama.py, meshlm/models/loss.py) and what they compute.
# Each projection is `meshlm.ops.linear`: its forward einsum, and in the backward the einsums of the input's
# and of the weight's gradient.
_PROJECTIONS = {
    "bte,ehd->bthd": "attn q projection (wq)",
    "bte,ekd->btkd": "attn k, v projection (wk, wv)",
    "bthd,hde->bte": "attn output projection (wo)",
    "bte,em->btm": "mlp gate, up projection (gate, up)",
    "btm,me->bte": "mlp down projection (down)",
    "bte,ev->btv": "lm_head",
}
EINSUMS = {
    spec: what for projection, what in _PROJECTIONS.items() for spec in (projection, *gradient_specs(projection))
}
# Primitives without an einsum of their own, by where they sit (inside the layer scan or outside). Every
# projection is a named einsum above, so a bare matmul inside the layers is attention's own (the
# kernels' score and value products, whose einsums are not listed).
IN_LAYERS = {
    "dot_general": "attention matmuls (scores, values)",
    "mul": "norm scales",
    "reduce_sum": "norm / attention sums",
    "reduce_max": "attention softmax",
    "convert_element_type": "weights cast to the compute dtype",
    # A loop over repeats of a local/global layer pattern takes each layer's weights from the repeat's.
    "squeeze": "weights of one layer of the pattern",
}
OUTSIDE = {
    "transpose": "lm_head (the tied embedding table)",
    "dot_general": "lm_head",
    "mul": "final norm scale",
    "gather": "embed lookup",
    "scatter-add": "embed",
    "reduce_max": "loss softmax",
    "reduce_sum": "loss sums",
    "convert_element_type": "weights cast to the compute dtype",
    "sharding_constraint": "layout change",
    "take_along_axis": "loss (target logits)",
}
# Outside the differentiated function, by the primitive: the explicit collectives of ZeRO stages 0-2 and
# of the pipeline's schedule (meshlm.train.step, meshlm.ops.pipeline), and the optimizer's update.
_SCATTERED = "after the backward: gradients reduce-scattered over the data axes (ZeRO)"
AFTER = {
    "reduce_scatter": _SCATTERED,
    "psum_scatter": _SCATTERED,
    "psum": "after the backward: gradients and loss summed over the data axes",
    "ppermute": "pipeline schedule: activations and gradients passed between stages",
    "add": "optimizer update: the updated shards gathered back",
    "convert_element_type": "weights cast to the compute dtype, before the pipeline schedule",
}
TRANSFORMS = re.compile(r"\b(transpose|jvp|jit|vmap|remat|checkpoint|custom_jvp_call|custom_vjp_call)\(")


def _one(name: str) -> str:
    # A pipeline's schedule wraps the differentiated function in its own loop (`shard_map/while/body/...`):
    # what is inside the first transform is the model's.
    found = TRANSFORMS.search(name)
    if found is None:  # outside the differentiated function
        return AFTER.get(name.rsplit("/", 1)[-1], "after the backward: gradient norm and logged metrics")
    name = name[found.start() :]
    backward = name.startswith("transpose(")
    if scope := re.search(r"boundary \d+-\d+>\d+-\d+", name):  # the layout change between two layer ranges
        return ("backward of " if backward else "forward of ") + scope.group(0)
    layers = "while/body" in name
    parts = [p for p in name.split("/") if p]
    what = ""
    for part in reversed(parts):  # the innermost einsum names the operator best
        inner = TRANSFORMS.sub("", part).rstrip(")")
        if inner in EINSUMS:
            what = EINSUMS[inner]
            break
        if "take_along_axis" in part:
            what = OUTSIDE["take_along_axis"]
            break
        if "_take" in part:
            what = OUTSIDE["gather"]
            break
    if not what:
        prim = parts[-1] if parts else name
        what = (IN_LAYERS if layers else OUTSIDE).get(prim, prim)
    return ("backward of " if backward else "forward of ") + ("layers/" if layers else "") + what


def readable(op_name: str) -> str:
    """The model's name for an XLA op name (several for a fused one, each once, in order)."""
    if not op_name or op_name.startswith("parameter "):
        return op_name
    name = op_name.replace("closed_call/", "")
    if name.startswith("(") and name.endswith(")") and ":" in name:
        pieces = name[1:-1].split(":")
        # A fused group shares its prefix with its first member: `pre/(a:b)` is written `(pre/a:pre/b)`
        # only in part, so each piece takes the first piece's prefix when it has none.
        prefix = pieces[0].rsplit("/", 2)[0] + "/" if pieces[0].count("/") >= 2 else ""
        pieces = [p if "/" in p.split("->")[0] or p.startswith(("jvp(", "transpose(")) else prefix + p for p in pieces]
    elif "/(" in name and name.endswith(")"):
        head, _, body = name.partition("/(")
        pieces = [f"{head}/{p}" for p in body[:-1].split(":")]
    else:
        pieces = [name]
    grouped: dict[str, list[str]] = {}  # "backward of layers/" -> [what, ...], in order, each once
    for piece in pieces:
        text = _one(piece)
        head, sep, what = text.rpartition("layers/") if "layers/" in text else text.partition(" of ")
        key = head + sep
        if what not in grouped.setdefault(key, []):
            grouped[key].append(what)
    return "; ".join(key + ", ".join(whats) for key, whats in grouped.items())


__all__ = ["readable", "EINSUMS"]
