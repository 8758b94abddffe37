"""Backend profiles: what a program runs differently on CPU, GPU and TPU, chosen in one place.

    profile = profile_for("cpu")      # or traced_profile(): the backend of the mesh being traced
    profile.unroll_layers, profile.fused_attention, profile.compiler_options(pipelined=True)

The model, the kernels, the train step and the job ask the profile; none of them compares platform
names. A profile chooses the attention kernels `--attention=auto` tries, the layer loop's unroll, the
form of the projections' and the output head's weight gradients, how the gradient norm is reduced,
the XLA options and flags (`meshlm.platform` reads the environment they depend on) and whether the
host allocator keeps a step's scratch (which `--remat=auto`'s rule then counts on). Why each setting
is what it is, with what was measured, is in docs/kernels.md ("Backend profiles").
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm import platform as runtime

DENSE_ATTENTION_BELOW = 256  # `auto` with no fused kernel: dense attention below this many tokens, blockwise from it


@dataclass(frozen=True)
class Profile:
    """How programs run on one backend (the fields say what they choose; docs/kernels.md says why)."""

    name: str  # "cpu", "gpu" or "tpu"
    fused_attention: tuple[str, ...] = ()  # the kernels `--attention=auto` tries first, in order
    dense_attention_below: int = DENSE_ATTENTION_BELOW  # then dense below this many tokens, else blockwise
    unroll_layers: bool = False  # `--model.scan_unroll=0` runs the whole layer loop unrolled
    float32_weight_gradients: bool = False  # projections' weight gradients leave their matmul in float32
    fence_head_gradient: bool = False  # below float32, the output head's weight gradient behind a barrier
    one_reduction_grad_norm: bool = False  # gradients split over the data axes: their norm in one reduction
    keeps_host_memory: bool = False  # the host allocator keeps a step's freed scratch for the next step
    ring_overlap: bool = True  # a ring step's transfers overlap its compute (else they finish before it)

    def compiler_options(self, *, pipelined: bool = False) -> dict | None:
        """The XLA options a train or eval program compiles with here (None: XLA's defaults)."""
        return runtime.compiler_options(self.name, pipelined=pipelined)

    def xla_flags(self) -> dict[str, str]:
        """{environment variable: flags} set for this backend before it starts."""
        return runtime.xla_flag_preset(self.name)

    def keep_host_memory(self) -> bool:
        """Set the host allocator to keep freed scratch where this backend asks for it; True where set."""
        return self.keeps_host_memory and runtime.keep_host_memory()

    def kept_block_bytes(self) -> float | None:
        """The scratch block kept between steps that `--remat=auto`'s rule counts on
        (`meshlm.plan.fit.auto_policy`): None where the backend keeps none, 0 where the allocator could
        not be set."""
        if not self.keeps_host_memory:
            return None
        return runtime.KEPT_BLOCK_BYTES if self.keep_host_memory() else 0


CPU = Profile(
    "cpu",
    float32_weight_gradients=True,
    fence_head_gradient=True,
    one_reduction_grad_norm=True,
    keeps_host_memory=True,
    ring_overlap=False,
)
GPU = Profile("gpu", fused_attention=("cudnn", "triton"), unroll_layers=True)
TPU = Profile("tpu", fused_attention=("splash",))
PROFILES = {p.name: p for p in (CPU, GPU, TPU)}


def profile_for(platform: str) -> Profile:
    """The profile of a JAX platform name ("cpu", "gpu", "cuda", "rocm", "tpu")."""
    return PROFILES[runtime.platform_kind(platform)]


def traced_profile() -> Profile:
    """The profile of the devices the model is traced for: the active mesh's (a TPU topology compiled
    on a CPU host is a TPU), else those JAX runs on."""
    from meshlm import sharding

    return profile_for(sharding.active_platform())


__all__ = ["Profile", "CPU", "GPU", "TPU", "PROFILES", "profile_for", "traced_profile", "DENSE_ATTENTION_BELOW"]
