"""The physical mesh: parse `--mesh_dim` / `--mp_mesh_dim`, fill `-1`, validate, build the `jax.sharding.Mesh`.

Four axes, always in this order:

    dp    data parallelism: batch split, weights replicated
    fsdp  fully sharded data parallelism (ZeRO-3): batch split, weights/grads/optimizer state sharded
    tp    tensor parallelism: heads, MLP hidden and vocab split
    sp    sequence parallelism: sequence split, attention runs as RingAttention

and a fifth, `pp` (pipeline stages), outside them when `--pp` > 1: the device count is then
pp × dp × fsdp × tp × sp, and a `-1` in `--mesh_dim` is filled after pp is taken out.

Everything here is plain Python until `build_mesh`, so flags are checked before JAX compiles anything.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from meshlm.errors import UsageError

AXES: tuple[str, ...] = ("dp", "fsdp", "tp", "sp")


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the four mesh axes, and of the pipeline axis. `str(shape)` is the `--mesh_dim` that
    reproduces it (with `--pp` beside it when pp > 1)."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    sp: int = 1
    pp: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.dp, self.fsdp, self.tp, self.sp)

    @property
    def n_devices(self) -> int:
        return math.prod(self.sizes) * self.pp

    @property
    def mesh_axes(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The JAX mesh's axis names and sizes: pp outermost when there is a pipeline."""
        return (("pp", *AXES), (self.pp, *self.sizes)) if self.pp > 1 else (AXES, self.sizes)

    @property
    def data(self) -> int:
        """How many ways the batch is split (dp × fsdp)."""
        return self.dp * self.fsdp

    def __str__(self) -> str:
        return ",".join(str(s) for s in self.sizes)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(*self.mesh_axes))

    @property
    def flags(self) -> str:
        """The command-line flags that give this mesh."""
        return f"--mesh_dim={self}" + (f" --pp={self.pp}" if self.pp > 1 else "")


def _parse_int(text: str, what: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise UsageError(
            f"{what}: {text.strip()!r} is not an integer; use positive integers and at most one -1"
        ) from None
    if value == 0 or value < -1:
        raise UsageError(f"{what}: {value} is not a valid axis size; use positive integers and at most one -1")
    return value


def _fill(sizes: list[int], n_devices: int, flag: str, unit: str = "devices") -> list[int]:
    """Replace the one `-1` so the product equals the device count; check the product."""
    if sizes.count(-1) > 1:
        raise UsageError(f"{flag}: only one axis may be -1 (it is inferred from the {n_devices} {unit})")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise UsageError(
                f"{flag}: the other axes multiply to {known}, which does not divide the {n_devices} {unit}"
            )
        sizes = [n_devices // known if s == -1 else s for s in sizes]
    elif known != n_devices:
        raise UsageError(
            f"{flag}: the axes multiply to {known} but there {'is' if n_devices == 1 else 'are'} {n_devices} "
            f"{unit[:-1] if n_devices == 1 else unit}; "
            f"make the product {n_devices} or use -1 for one axis"
            + (f" (or --devices={known} on CPU)" if unit == "devices" else "")
        )
    return sizes


def parse_mesh_dim(text: str, n_devices: int, flag_name: str = "--mesh_dim", pp: int = 1) -> MeshShape:
    """`'1,64,4,1'` (dp,fsdp,tp,sp) or `'fsdp:-1,tp:2'` (named; unnamed axes are 1; `pp:N` too)."""
    flag = f"{flag_name}={text}"
    if pp < 1:
        raise UsageError(f"--pp={pp} must be a positive integer")
    parts = [p for p in text.replace(" ", "").split(",")]
    if not text.strip() or any(p == "" for p in parts):
        raise UsageError(f"{flag}: give four comma-separated sizes dp,fsdp,tp,sp such as 1,8,1,1, or fsdp:-1,tp:2")
    if any(":" in p for p in parts):
        sizes = dict.fromkeys(AXES, 1)
        seen = set()
        for part in parts:
            name, sep, value = part.partition(":")
            if not sep:
                raise UsageError(f"{flag}: mix of named and positional entries; write every entry as axis:size")
            if name == "pp" and flag_name == "--mesh_dim":
                named_pp = _parse_int(value, flag)
                if named_pp == -1 or (pp > 1 and named_pp != pp):
                    raise UsageError(
                        f"{flag}: give pp a size, once (pp:{pp if pp > 1 else 2} or --pp={pp if pp > 1 else 2})"
                    )
                pp = named_pp
                continue
            if name not in AXES:
                raise UsageError(
                    f"{flag}: unknown axis {name!r}; the axes are {', '.join(AXES)}"
                    + (" and pp" if flag_name == "--mesh_dim" else "")
                )
            if name in seen:
                raise UsageError(f"{flag}: axis {name!r} is given twice")
            seen.add(name)
            sizes[name] = _parse_int(value, flag)
        values = list(sizes.values())
    else:
        if len(parts) != len(AXES):
            raise UsageError(
                f"{flag}: expected 4 sizes dp,fsdp,tp,sp, got {len(parts)}; e.g. --mesh_dim=1,{n_devices},1,1"
            )
        values = [_parse_int(p, flag) for p in parts]
    if n_devices % pp:
        raise UsageError(f"--pp={pp} does not divide the {n_devices} devices; use a pp that does")
    unit = (
        "hosts"
        if flag_name == "--dcn_mesh_dim"
        else "devices"
        if pp == 1
        else f"devices per stage (of {n_devices} / pp={pp})"
    )
    dp, fsdp, tp, sp = _fill(values, n_devices // pp, flag, unit)
    return MeshShape(dp, fsdp, tp, sp, pp=pp)


def parse_mp_mesh_dim(text: str, n_devices: int, fsdp: bool = False) -> MeshShape:
    """EasyLM's interface: `--mp_mesh_dim=tp,sp`; the data axis is inferred, and `--fsdp` makes it fsdp."""
    flag = f"--mp_mesh_dim={text}"
    parts = text.replace(" ", "").split(",")
    if len(parts) != 2:
        raise UsageError(f"{flag}: expected 2 model-parallel sizes tp,sp such as 8,1")
    tp, sp = (_parse_int(p, flag) for p in parts)
    if -1 in (tp, sp):  # -1: that axis takes every device the other leaves, so no data parallelism
        tp, sp = _fill([tp, sp], n_devices, flag)
    model = tp * sp
    if n_devices % model:
        raise UsageError(f"{flag}: tp×sp = {model} does not divide the {n_devices} devices")
    data = n_devices // model
    return MeshShape(dp=1, fsdp=data, tp=tp, sp=sp) if fsdp else MeshShape(dp=data, fsdp=1, tp=tp, sp=sp)


def resolve_mesh_shape(
    mesh_dim: str | None, mp_mesh_dim: str | None, fsdp: bool, n_devices: int, pp: int = 1
) -> MeshShape:
    """What the flags mean together. Default: everything on fsdp (the usual best choice)."""
    if mesh_dim and mp_mesh_dim:
        raise UsageError("--mesh_dim and --mp_mesh_dim both given; use one (--mesh_dim=dp,fsdp,tp,sp is the full form)")
    if mp_mesh_dim:
        if pp != 1:
            raise UsageError("--pp goes with --mesh_dim; --mp_mesh_dim has no pipeline axis")
        return parse_mp_mesh_dim(mp_mesh_dim, n_devices, fsdp)
    if fsdp and mesh_dim:
        raise UsageError("--fsdp goes with --mp_mesh_dim; with --mesh_dim put the size in the fsdp entry instead")
    return parse_mesh_dim(mesh_dim or "1,-1,1,1", n_devices, pp=pp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def all_mesh_shapes(n_devices: int) -> list[MeshShape]:
    """Every way of writing n_devices as dp × fsdp × tp × sp."""
    out = []
    for dp, fsdp, tp in itertools.product(_divisors(n_devices), repeat=3):
        if n_devices % (dp * fsdp * tp) == 0:
            out.append(MeshShape(dp, fsdp, tp, n_devices // (dp * fsdp * tp)))
    return out


def check_shape_fits(
    shape: MeshShape,
    *,
    batch_size: int,
    seq_len: int,
    n_heads: int,
    n_kv_heads: int,
    mlp_dim: int,
    vocab_size: int,
) -> str | None:
    """The first reason this mesh cannot run the job, or None."""
    if batch_size < shape.data or batch_size % shape.data:
        return (
            f"global batch size {batch_size} is {'smaller than' if batch_size < shape.data else 'not divisible by'} "
            f"dp×fsdp = {shape.data}"
        )
    # RingAttention balances causal work by giving each sp rank two of 2×sp equal chunks (zigzag order).
    if shape.sp > 1 and seq_len % (2 * shape.sp):
        return f"seq_len {seq_len} is not divisible by 2×sp = {2 * shape.sp} (each ring rank holds two chunks)"
    # kv heads need not divide: with tp larger than them each rank holds a copy of the one its queries use.
    for name, value in (("n_heads", n_heads), ("mlp_dim", mlp_dim), ("vocab_size", vocab_size)):
        if value % shape.tp:
            return f"{name} = {value} is not divisible by tp = {shape.tp}"
    return None


def validate_mesh_shape(shape: MeshShape, **job) -> None:
    """Raise a one-line UsageError naming meshes that would work, if this one cannot run the job."""
    problem = check_shape_fits(shape, **job)
    if problem is None:
        return
    working = [s for s in all_mesh_shapes(shape.n_devices) if check_shape_fits(s, **job) is None]
    # Prefer large fsdp (the usual best), then tp, then sp: the order users should try them in.
    working.sort(key=lambda s: (-s.fsdp, -s.tp, s.sp, s.dp))
    hint = (
        "meshes that work on these "
        + f"{shape.n_devices} devices: "
        + ", ".join(f"--mesh_dim={s}" for s in working[:4])
        if working
        else "no mesh of these devices fits; change the batch size, seq_len or model shape"
    )
    raise UsageError(f"--mesh_dim={shape}: {problem}; {hint}")


def split_over_hosts(shape: MeshShape, n_hosts: int) -> MeshShape:
    """The default `--dcn_mesh_dim`: the hosts go to pipeline stages first, then dp, fsdp, sp and tp
    (the axes with the least traffic cross the slow network)."""
    left, factors = n_hosts, dict.fromkeys(("pp", *AXES), 1)
    for axis in ("pp", "dp", "fsdp", "sp", "tp"):
        f = math.gcd(left, getattr(shape, axis))
        factors[axis], left = f, left // f
    if left != 1:
        raise UsageError(
            f"--mesh_dim={shape} cannot be spread over {n_hosts} hosts (each axis must split evenly "
            "across them); give --dcn_mesh_dim=dp,fsdp,tp,sp with a product of the host count"
        )
    return MeshShape(**factors)


def resolve_hybrid(
    mesh_dim: str | None,
    mp_mesh_dim: str | None,
    fsdp: bool,
    dcn_mesh_dim: str | None,
    n_devices: int,
    n_hosts: int,
    pp: int = 1,
) -> tuple[MeshShape, MeshShape]:
    """(whole mesh, factors across hosts) from the flags.

    With `--dcn_mesh_dim`, `--mesh_dim` is one host's share of the devices and each axis is the
    product of the two; without it, `--mesh_dim` is the whole mesh, spread by `split_over_hosts`."""
    if dcn_mesh_dim is None:
        shape = resolve_mesh_shape(mesh_dim, mp_mesh_dim, fsdp, n_devices, pp)
        return shape, split_over_hosts(shape, n_hosts)
    if pp > 1:
        raise UsageError("--dcn_mesh_dim does not take a pipeline yet: leave it out and the hosts go to pp first")
    if n_devices % n_hosts:
        raise UsageError(
            f"{n_devices} devices do not split evenly over {n_hosts} hosts; give every host the same count"
        )
    local = resolve_mesh_shape(mesh_dim, mp_mesh_dim, fsdp, n_devices // n_hosts)
    dcn = parse_mesh_dim(dcn_mesh_dim, n_hosts, "--dcn_mesh_dim")
    return MeshShape(*(a * b for a, b in zip(local.sizes, dcn.sizes))), dcn


def build_mesh(shape: MeshShape, devices=None, dcn: MeshShape | None = None):
    """The JAX mesh with axes (dp, fsdp, tp, sp), and pp first when there is a pipeline; Auto axis
    types, so XLA propagates shardings.

    `dcn`: how many ways each axis is split across hosts (or TPU slices); each host's devices then
    form a contiguous block of the mesh, so the fast axes' traffic stays inside a host."""
    import jax
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    devices = list(devices if devices is not None else jax.devices())
    if len(devices) != shape.n_devices:
        raise UsageError(f"--mesh_dim={shape} needs {shape.n_devices} devices but {len(devices)} are available")
    names, sizes = shape.mesh_axes
    axis_types = (AxisType.Auto,) * len(names)
    if dcn is None or dcn.n_devices == 1:
        return jax.make_mesh(sizes, names, axis_types=axis_types, devices=devices)
    by_slice = devices[0].platform == "tpu" and getattr(devices[0], "slice_index", None) is not None
    hosts = len({d.slice_index if by_slice else d.process_index for d in devices})  # TPU slices, else processes
    dcn_sizes = (dcn.pp, *dcn.sizes) if shape.pp > 1 else dcn.sizes
    if hosts != dcn.n_devices or any(a % b for a, b in zip(sizes, dcn_sizes)):
        raise UsageError(
            f"--dcn_mesh_dim={dcn} does not fit {hosts} hosts of {len(devices) // max(hosts, 1)} devices "
            f"for the mesh {shape}: its product must be the host count and divide each axis"
        )
    ici = tuple(a // b for a, b in zip(sizes, dcn_sizes))
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn_sizes, devices, process_is_granule=not by_slice)
    return Mesh(np.asarray(grid), names, axis_types=axis_types)
