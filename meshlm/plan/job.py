"""What is being planned: one training job (model, batch, sequence, devices, pipeline flags) and its
shape on one device. The bottom of `meshlm.plan`: every estimator reads these types.

`Job` holds the global figures and `job.problem(mesh_shape)` says why a mesh cannot run it (the checks
`meshlm train` makes); `job.local(mesh_shape)` gives the figures one device sees on that mesh: its
rows and tokens per micro-batch and its shard of heads, MLP width and vocabulary. `PipelineFlags` are
the `--pipeline_schedule`, `--microbatches` and `--virtual_stages` the job uses on meshes with pp > 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import jax.numpy as jnp

from meshlm.errors import UsageError
from meshlm.mesh import MeshShape, check_shape_fits
from meshlm.models.configs import ModelConfig
from meshlm.models.policy import RunPolicy
from meshlm.strategy import DEFAULT

# The layout the memory and cost models compute with: the one strategy they plan.
PLANNED_STRATEGY = DEFAULT.name


@dataclass(frozen=True)
class PipelineFlags:
    """`--pipeline_schedule`, `--microbatches` (None: 2·pp, as `meshlm train`), `--virtual_stages`."""

    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 1

    def microbatches_for(self, pp: int) -> int:
        return self.microbatches or 2 * pp

    def flags(self, pp: int) -> list[str]:
        """The train flags for this pipeline on pp stages (defaults left out)."""
        out = [f"--pp={pp}"]
        if self.schedule != "1f1b":
            out.append(f"--pipeline_schedule={self.schedule}")
        if self.microbatches is not None:
            out.append(f"--microbatches={self.microbatches}")
        if self.virtual_stages != 1:
            out.append(f"--virtual_stages={self.virtual_stages}")
        return out


def pipeline_problem(
    flags: PipelineFlags, shape: MeshShape, n_layers: int, batch_size: int, grad_accum: int
) -> str | None:
    """Why this pipelined mesh cannot run the job (`meshlm train`'s checks of the pipeline flags), or None."""
    return _pipeline_problem(flags, shape.pp, shape.data, n_layers, batch_size, grad_accum)


@lru_cache(maxsize=256)
def _pipeline_problem(
    flags: PipelineFlags, pp: int, data: int, n_layers: int, batch_size: int, grad_accum: int
) -> str | None:
    from meshlm.ops.pipeline import schedule_for_job

    try:
        schedule_for_job(
            flags.schedule, pp, flags.microbatches, flags.virtual_stages, n_layers, batch_size, grad_accum, data
        )
    except UsageError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Job:
    """A training step to place: the model `cfg`, run as `policy` says (dtype, param_dtype, remat)."""

    cfg: ModelConfig
    batch_size: int  # global sequences per step (all devices, all micro-batches)
    seq_len: int
    n_devices: int
    grad_accum: int = 1
    pipeline: PipelineFlags = field(default_factory=PipelineFlags)  # used on meshes with pp > 1
    policy: RunPolicy = field(default_factory=RunPolicy)

    @property
    def tokens(self) -> int:
        """Tokens per step, globally."""
        return self.batch_size * self.seq_len

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element (compute dtype)."""
        return jnp.dtype(self.policy.dtype).itemsize

    @property
    def param_bytes(self) -> int:
        """Bytes of one parameter, gradient or optimizer-moment element."""
        return jnp.dtype(self.policy.param_dtype).itemsize

    def problem(self, shape: MeshShape) -> str | None:
        """Why this mesh cannot run the job (the checks `meshlm train` makes), or None."""
        c = self.cfg
        if shape.pp > 1:
            found = pipeline_problem(self.pipeline, shape, c.n_layers, self.batch_size, self.grad_accum)
            if found:
                return found
        found = check_shape_fits(
            shape,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            n_heads=c.n_heads,
            n_kv_heads=c.n_kv_heads,
            mlp_dim=c.mlp_dim,
            vocab_size=c.vocab_size,
        )
        if found is None and (self.batch_size // self.grad_accum) % shape.data:
            found = (
                f"{self.batch_size // self.grad_accum} rows per micro-batch are not divisible by dp×fsdp = {shape.data}"
            )
        if found is None:
            for name, size in (("d_model", c.d_model),):
                if size % (shape.fsdp * shape.sp):
                    found = f"{name} = {size} is not divisible by fsdp×sp = {shape.fsdp * shape.sp}"
        return found

    def local(self, shape: MeshShape) -> Local:
        return Local(self, shape)


@dataclass(frozen=True)
class Local:
    """One device's share of the job on one mesh (per micro-batch where it matters)."""

    job: Job
    shape: MeshShape

    @property
    def cfg(self) -> ModelConfig:
        return self.job.cfg

    @property
    def policy(self) -> RunPolicy:
        return self.job.policy

    @property
    def rows(self) -> int:
        """Sequences per device per micro-batch."""
        return self.job.batch_size // (self.job.grad_accum * self.shape.data)

    @property
    def length(self) -> int:
        """Tokens of each sequence on this device (the sp shard)."""
        return self.job.seq_len // self.shape.sp

    @property
    def tokens(self) -> int:
        """Tokens per device per micro-batch."""
        return self.rows * self.length

    @property
    def heads(self) -> int:
        return self.cfg.n_heads // self.shape.tp

    @property
    def kv_heads(self) -> int:
        """kv heads on one tp rank: at least one (tp larger than the kv heads gives each rank a copy)."""
        return math.lcm(self.cfg.n_kv_heads, self.shape.tp) // self.shape.tp

    @property
    def mlp(self) -> int:
        return self.cfg.mlp_dim // self.shape.tp

    @property
    def vocab(self) -> int:
        return self.cfg.vocab_size // self.shape.tp

    @cached_property
    def attention(self) -> str:
        """'ring', 'blockwise' or 'dense': which kernel `meshlm.models.decoder.attend` picks on CPU
        (`meshlm.ops.kernels.choose` for --attention=auto; a length off the blocks is padded)."""
        from meshlm.ops.kernels import DENSE_BELOW

        if self.shape.sp > 1:
            return "ring"
        return "blockwise" if self.job.seq_len >= DENSE_BELOW else "dense"

    # Weight elements of one layer, in this device's tp shard (before fsdp sharding).
    @property
    def w_qkv(self) -> int:
        c = self.cfg
        kv = c.n_kv_heads // self.shape.tp if c.n_kv_heads % self.shape.tp == 0 else c.n_kv_heads  # else whole
        return c.d_model * (c.n_heads // self.shape.tp + 2 * kv) * c.head_dim

    @property
    def w_out(self) -> int:
        c = self.cfg
        return c.n_heads * c.head_dim * c.d_model // self.shape.tp

    @property
    def w_mlp_in(self) -> int:
        return 2 * self.cfg.d_model * self.cfg.mlp_dim // self.shape.tp

    @property
    def w_mlp_out(self) -> int:
        return self.cfg.mlp_dim * self.cfg.d_model // self.shape.tp

    @property
    def embed_vectors(self) -> int:
        """[embed] weights of one layer, sharded like its norm scales: two norms, the post-norms, the
        attention output's and the MLP down projection's biases."""
        c = self.cfg
        return 2 + 2 * c.post_norms + c.out_bias + c.mlp_bias

    @property
    def w_small(self) -> int:
        """Elements of one layer's small weights without an embed axis, in this device's tp shard and whole
        on every data rank: q/k/v biases, q/k norm scales, the MLP's gate and up biases."""
        c = self.cfg
        return (
            (self.heads + 2 * self.kv_heads) * c.head_dim * c.qkv_bias
            + 2 * c.head_dim * c.qk_norm
            + (2 * self.mlp * c.mlp_bias)
        )

    @property
    def w_layer(self) -> int:
        return self.w_qkv + self.w_out + self.w_mlp_in + self.w_mlp_out

    @property
    def w_table(self) -> int:
        """Elements of the embedding table (or the output head) in this device's tp shard."""
        return self.cfg.vocab_size * self.cfg.d_model // self.shape.tp
