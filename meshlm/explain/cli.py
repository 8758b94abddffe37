"""`meshlm explain [every meshlm train flag] [--tensor=PATH] [--png=FILE] [--json]`.

Builds the placement and compiles the train step exactly as `meshlm train` would, without data or
training, and prints what came out (see `meshlm.explain.analysis`)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from meshlm.errors import UsageError


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _parser():
    from meshlm.cli import _Parser, _add_dataclass_flags
    from meshlm.train.loop import TrainConfig

    p = _Parser(prog="meshlm explain", description="Show the parameter layouts, memory and collectives of a "
                "strategy's train step (takes every meshlm train flag).")
    _add_dataclass_flags(p, TrainConfig)
    out = p.add_argument_group("explain")
    out.add_argument("--tensor", metavar="PATH", help="draw how this parameter lies on the devices [default: the "
                     "first layer group's mlp/gate]")
    out.add_argument("--png", metavar="FILE", help="also draw it as a PNG")
    out.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    return p


def run(argv: list[str]) -> int:
    from meshlm.cli import _split_model_overrides
    from meshlm.train.loop import TrainConfig

    argv, overrides = _split_model_overrides(argv)
    args = vars(_parser().parse_args(argv))
    tensor, png, as_json = args.pop("tensor"), args.pop("png"), args.pop("json")
    cfg = TrainConfig(**args, model_overrides=overrides)
    cfg.validate()
    from meshlm.train.loop import configure_devices

    configure_devices(cfg.devices)
    report = explain(cfg, tensor, png)
    if as_json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print_report(report)
    return 0


def explain(cfg, tensor: str | None = None, png: str | None = None) -> dict:
    """Everything `meshlm explain` shows, as one dict (specs and shapes as text)."""
    import jax

    from meshlm import mesh as meshlib
    from meshlm.explain import analysis as A
    from meshlm.models.configs import resolve_model
    from meshlm.models.placement import place
    from meshlm.train.loop import choose_strategy, resolve_dtype
    from meshlm.train.optimizer import OptimizerConfig, make_optimizer
    from meshlm.train.step import compile_step

    if cfg.pp > 1:
        raise UsageError("meshlm explain does not show pipelined steps yet; leave out --pp")
    model_cfg = resolve_model(cfg.model or "tiny", cfg.model_overrides).replace(
        dtype=resolve_dtype(cfg.dtype), param_dtype=cfg.param_dtype, remat=cfg.remat)
    shape = meshlib.resolve_mesh_shape(cfg.mesh_dim, cfg.mp_mesh_dim, cfg.fsdp, jax.device_count())
    meshlib.validate_mesh_shape(shape, batch_size=cfg.batch_size, seq_len=cfg.seq_len, n_heads=model_cfg.n_heads,
                                n_kv_heads=model_cfg.n_kv_heads, mlp_dim=model_cfg.mlp_dim, vocab_size=model_cfg.vocab_size)
    strategy, rules = choose_strategy(cfg, shape, model_cfg.n_layers)
    placement = place(model_cfg, meshlib.build_mesh(shape, jax.devices()[: shape.n_devices]), strategy, rules)
    rows = A.param_rows(placement)
    tensor = tensor or next((r["path"] for r in rows if r["path"].endswith("mlp/gate")), rows[0]["path"])
    picture = A.picture(placement, tensor)
    optimizer = make_optimizer(OptimizerConfig(clip_norm=cfg.clip_norm, weight_decay=cfg.weight_decay))
    step, grads, batch = compile_step(placement, optimizer, cfg.batch_size, cfg.seq_len, cfg.grad_accum)
    report = {
        "mesh_dim": str(shape), "strategy": strategy.name,
        "groups": [{"layers": g.key, "strategy": g.strategy.name} for g in placement.groups],
        "parameters": [{**r, "shape": list(r["shape"]), **{k: str(r[k]) for k in ("spec", "grad_spec", "opt_spec")}}
                       for r in rows],
        "memory": A.state_memory(placement, step, grads, batch),
        "collectives": [dict(kind=c.kind, axes=list(c.axes), payload_bytes=c.payload_bytes, count=c.count,
                             total_bytes=c.total_bytes, where=c.where) for c in A.collectives(step.as_text(), placement)],
        "boundaries": [{**b, "spec_before": str(b["spec_before"]), "spec_after": str(b["spec_after"]),
                        "forward": [c.__dict__ for c in b["forward"]], "backward": [c.__dict__ for c in b["backward"]]}
                       for b in A.boundaries(placement, cfg.batch_size // cfg.grad_accum, cfg.seq_len)],
        "tensor": tensor, "picture": picture,
    }
    if png:
        report["png"] = str(A.write_png(placement, tensor, png))
    return report


def print_report(r: dict, file=sys.stdout) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file, width=200)
    groups = ", ".join(f"layers {g['layers']}: {g['strategy']}" for g in r["groups"])
    console.print(f"--mesh_dim={r['mesh_dim']} strategy {r['strategy']}" + (f" ({groups})" if groups else ""))
    t = Table(title="parameters (per device)", title_justify="left")
    for col in ("path", "shape", "PartitionSpec", "grads / optimizer state", "bytes/device", "from"):
        t.add_column(col)
    for p in r["parameters"]:
        other = "" if p["grad_spec"] == p["spec"] == p["opt_spec"] else f"{p['grad_spec']} / {p['opt_spec']}"
        t.add_row(p["path"], str(tuple(p["shape"])), p["spec"], other, f"{p['bytes']:,}", p["source"])
    console.print(t)
    m = r["memory"]
    line = (f"memory per device (compiled): params + optimizer state {_mib(m['params+opt_state'])}, "
            f"gradients {_mib(m['grads'])}, total {_mib(m['total'])}; Ψ = {m['n_params']:,} parameters, "
            f"N = {m['data_devices']} data devices")
    console.print(line)
    if "formula" in m:
        f = m["formula"]
        console.print(f"ZeRO stage {r['strategy'].rsplit('zero', 1)[-1]} formula: {_mib(f['total'])} (params "
                      f"{_mib(f['params'])} + grads {_mib(f['grads'])} + optimizer state {_mib(f['opt_state'])}); "
                      f"compiled / formula = {m['total'] / f['total']:.4f}")
    t = Table(title="collectives in the compiled train step (per device, per step)", title_justify="left")
    for col in ("kind", "mesh axes", "bytes each", "times", "total", "where"):
        t.add_column(col)
    merged: dict[tuple, list] = defaultdict(lambda: [0, 0])
    for c in r["collectives"]:
        key = (c["kind"], ",".join(c["axes"]) or "-", c["payload_bytes"], c["where"])
        merged[key][0] += c["count"]
        merged[key][1] += c["total_bytes"]
    for (kind, axes, each, where), (count, total) in sorted(merged.items(), key=lambda kv: -kv[1][1]):
        where = where.replace("closed_call/", "").replace("while/body/", "scan/")
        t.add_row(kind, axes, f"{each:,}", str(count), f"{total:,}", where if len(where) < 100 else where[:45] + "…" + where[-50:])
    console.print(t)
    for b in r["boundaries"]:
        def moves(cs):
            return ", ".join(f"{c['kind']} over {','.join(c['axes'])} {c['payload_bytes']:,} B" for c in cs) or "no collective (a local slice)"
        console.print(f"boundary {b['before']} -> {b['after']}: residual {tuple(b['shape'])} {b['spec_before']} -> "
                      f"{b['spec_after']}; forward: {moves(b['forward'])}; backward: {moves(b['backward'])}")
    console.print(r["picture"], highlight=False, markup=False)
    if "png" in r:
        console.print(f"wrote {r['png']}")
