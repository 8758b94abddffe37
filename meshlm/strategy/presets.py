"""Named strategies: each one logical-axis table, in this one place (`--strategy=NAME`).

A table maps logical axes to mesh axes, for parameters and for activations. Mesh axes of size 1 drop
out, so every preset runs on every mesh; a preset decides what each mesh axis is *for*:

    preset        weights' embed   heads/kv/mlp/vocab   batch             length
    default       fsdp, sp         tp                   dp, fsdp          sp (RingAttention)
    dp            —                —                    dp, fsdp, tp, sp  —
    fsdp          dp, fsdp, tp, sp —                    dp, fsdp, tp, sp  —
    fsdp_tp       dp, fsdp, sp     tp                   dp, fsdp, sp      —
    megatron      —                tp                   dp, fsdp, sp      —
    megatron_sp   —                tp                   dp, fsdp, sp      tp between tp regions
    fsdp_sp       fsdp, sp         —                    dp, fsdp          sp (RingAttention)

In every preset `layers` goes over pp; `head_dim` and `lora_rank` stay whole.
"""

from __future__ import annotations

from meshlm.errors import UsageError, closest
from meshlm.sharding import Strategy

ALL = ("dp", "fsdp", "tp", "sp")
_WHOLE = {
    "heads": None,
    "kv_heads": None,
    "mlp": None,
    "vocab": None,
    "head_dim": None,
    "layers": "pp",
    "lora_rank": None,
}
_TP = {**_WHOLE, "heads": "tp", "kv_heads": "tp", "mlp": "tp", "vocab": "tp"}


def _acts(batch, length=None, model=_WHOLE) -> dict:
    return {**model, "batch": batch, "length": length, "cache_length": length, "embed": None, "layers": None}


_MODEL_PARALLEL = {
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "vocab": "tp",
    "head_dim": None,
    "layers": None,
    "lora_rank": None,
}

DEFAULT = Strategy(
    name="default",
    # Weights: embed over fsdp (ZeRO-3) and sp (sequence-parallel ranks hold weight shards too);
    # the stacked layers over pipeline stages when the mesh has a pp axis (meshlm.ops.pipeline).
    params={"embed": ("fsdp", "sp"), **_MODEL_PARALLEL, "layers": "pp"},
    # Activations: batch over the data axes, sequence (and a KV cache's length) over sp, embed whole.
    activations={"batch": ("dp", "fsdp"), "length": "sp", "cache_length": "sp", "embed": None, **_MODEL_PARALLEL},
    doc="batch over (dp, fsdp); length over sp; weights' embed over (fsdp, sp); heads, kv_heads, mlp, vocab over tp",
)

PRESETS: dict[str, Strategy] = {
    s.name: s
    for s in (
        DEFAULT,
        Strategy(
            "dp",
            params={**_WHOLE, "embed": None},
            activations=_acts(ALL),
            doc="plain data parallelism (ZeRO-0): every device a replica; the batch splits over every mesh axis",
        ),
        Strategy(
            "fsdp",
            params={**_WHOLE, "embed": ALL},
            activations=_acts(ALL),
            doc="ZeRO-3 over every device: weights' embed and the batch split over every mesh axis",
        ),
        Strategy(
            "fsdp_tp",
            params={**_TP, "embed": ("dp", "fsdp", "sp")},
            activations=_acts(("dp", "fsdp", "sp"), model=_TP),
            doc="fsdp over dp, fsdp and sp; Megatron tensor parallelism (heads, kv_heads, mlp, vocab) over tp",
        ),
        Strategy(
            "megatron",
            params={**_TP, "embed": None},
            activations=_acts(("dp", "fsdp", "sp"), model=_TP),
            doc="Megatron tensor parallelism over tp; weights replicated over the data axes dp, fsdp, sp",
        ),
        Strategy(
            "megatron_sp",
            params={**_TP, "embed": None},
            activations=_acts(("dp", "fsdp", "sp"), "tp", model=_TP),
            shared=frozenset({"length", "cache_length"}),
            doc="megatron plus sequence parallelism: between the tensor-parallel regions (norms, residual) "
            "activations split their length over tp; attention and MLP gather it back",
        ),
        Strategy(
            "fsdp_sp",
            params={**_WHOLE, "embed": ("fsdp", "sp")},
            activations=_acts(("dp", "fsdp"), "sp"),
            doc="fsdp over fsdp and sp, the sequence over sp with RingAttention; no tensor parallelism",
        ),
    )
}


def unknown_preset(name: str) -> str | None:
    """Why `name` is no preset ("unknown preset; ...", a near name and the presets), or None for a preset.
    The caller says where the name came from (--strategy, a rules file's [[layers]])."""
    if name in PRESETS:
        return None
    close = closest(name, PRESETS, cutoff=0.6)
    return f"unknown preset; {f'did you mean {close}? ' if close else ''}choose one of {', '.join(PRESETS)}"


def preset(name: str) -> Strategy:
    if problem := unknown_preset(name):
        raise UsageError(f"--strategy={name}: {problem}")
    return PRESETS[name]
