"""What is being planned: one training job (model, batch, sequence, devices) and its shape on one device.

`Job` holds the global figures; `job.local(mesh_shape)` the figures one device sees on that mesh:
its rows and tokens per micro-batch and its shard of heads, MLP width and vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import jax.numpy as jnp

from meshlm.mesh import MeshShape, check_shape_fits
from meshlm.models.configs import ModelConfig
from meshlm.plan.pipeline import PipelineFlags, problem as pipeline_problem

# meshlm.models.llama.attend switches from dense to blockwise (flash) attention at this length when
# the sequence is not split; with sp > 1 attention is RingAttention.
BLOCKWISE_MIN_LEN, BLOCKWISE_MULTIPLE = 1024, 512


@dataclass(frozen=True)
class Job:
    """A training step to place: `cfg` carries dtype, param_dtype and remat."""

    cfg: ModelConfig
    batch_size: int  # global sequences per step (all devices, all micro-batches)
    seq_len: int
    n_devices: int
    grad_accum: int = 1
    pipeline: PipelineFlags = field(default_factory=PipelineFlags)  # used on meshes with pp > 1

    @property
    def tokens(self) -> int:
        """Tokens per step, globally."""
        return self.batch_size * self.seq_len

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element (compute dtype)."""
        return jnp.dtype(self.cfg.dtype).itemsize

    @property
    def param_bytes(self) -> int:
        """Bytes of one parameter, gradient or optimizer-moment element."""
        return jnp.dtype(self.cfg.param_dtype).itemsize

    def problem(self, shape: MeshShape) -> str | None:
        """Why this mesh cannot run the job (the checks `meshlm train` makes), or None."""
        c = self.cfg
        if shape.pp > 1:
            found = pipeline_problem(self.pipeline, shape, c.n_layers, self.batch_size, self.grad_accum)
            if found:
                return found
        found = check_shape_fits(shape, batch_size=self.batch_size, seq_len=self.seq_len, n_heads=c.n_heads,
                                 n_kv_heads=c.n_kv_heads, mlp_dim=c.mlp_dim, vocab_size=c.vocab_size)
        if found is None and (self.batch_size // self.grad_accum) % shape.data:
            found = (f"{self.batch_size // self.grad_accum} rows per micro-batch are not divisible by "
                     f"dp×fsdp = {shape.data}")
        if found is None:
            for name, size in (("d_model", c.d_model),):
                if size % (shape.fsdp * shape.sp):
                    found = f"{name} = {size} is not divisible by fsdp×sp = {shape.fsdp * shape.sp}"
        return found

    def local(self, shape: MeshShape) -> "Local":
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
        return self.cfg.n_kv_heads // self.shape.tp

    @property
    def mlp(self) -> int:
        return self.cfg.mlp_dim // self.shape.tp

    @property
    def vocab(self) -> int:
        return self.cfg.vocab_size // self.shape.tp

    @cached_property
    def attention(self) -> str:
        """'ring', 'blockwise' or 'dense': which kernel `meshlm.models.llama.attend` picks."""
        if self.shape.sp > 1:
            return "ring"
        t = self.job.seq_len
        return "blockwise" if t >= BLOCKWISE_MIN_LEN and t % BLOCKWISE_MULTIPLE == 0 else "dense"

    # Weight elements of one layer, in this device's tp shard (before fsdp sharding).
    @property
    def w_qkv(self) -> int:
        c = self.cfg
        return c.d_model * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim // self.shape.tp

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
    def w_layer(self) -> int:
        return self.w_qkv + self.w_out + self.w_mlp_in + self.w_mlp_out

    @property
    def w_table(self) -> int:
        """Elements of the embedding table (or the output head) in this device's tp shard."""
        return self.cfg.vocab_size * self.cfg.d_model // self.shape.tp
