"""`meshlm explain [every meshlm train flag] [--tensor=PATH] [--png=FILE] [--json]`: the report of
meshlm.explain.report, printed as tables (or as one JSON document)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from meshlm.cli.flags import Parser, add_section_flags, split_model_overrides, train_config


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def parser() -> Parser:
    p = Parser(
        prog="meshlm explain",
        description="Show the parameter layouts, memory and collectives of a "
        "strategy's train step (takes every meshlm train flag).",
    )
    add_section_flags(p)
    out = p.add_argument_group("explain")
    out.add_argument(
        "--tensor",
        metavar="PATH",
        help="draw how this parameter lies on the devices [default: the first layer group's mlp/gate]",
    )
    out.add_argument("--png", metavar="FILE", help="also draw it as a PNG")
    out.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    out.add_argument(
        "--details",
        action="store_true",
        help="list every collective by where it comes from, not only the totals per mesh axis and kind",
    )
    return p


def run(argv: list[str]) -> int:
    from meshlm.platform import configure_runtime

    argv, overrides = split_model_overrides(argv)
    flags = parser()
    args = flags.parse_args(argv)
    cfg = train_config(args, overrides, drop=("tensor", "png", "json", "details"), given=flags.given)
    configure_runtime(cfg.devices)
    from meshlm.explain.report import explain

    report = explain(cfg, args.tensor, args.png)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print_report(report, details=args.details)
    return 0


def print_report(r: dict, file=None, details: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=200)  # sys.stdout as it is now (pytest swaps it)
    groups = ", ".join(f"layers {g['layers']}: {g['strategy']}" for g in r["groups"])
    pp = f" --pp={r['pp']}" if r.get("pp", 1) > 1 else ""
    console.print(f"--mesh_dim={r['mesh_dim']}{pp} strategy {r['strategy']}" + (f" ({groups})" if groups else ""))
    t = Table(title="parameters (per device)", title_justify="left")
    for col in ("path", "shape", "PartitionSpec", "grads / optimizer state", "bytes/device", "from"):
        t.add_column(col)
    for p in r["parameters"]:
        other = f"{p['grad_spec']} / {p['opt_spec']}"
        t.add_row(p["path"], str(tuple(p["shape"])), p["spec"], other, f"{p['bytes']:,}", p["source"])
    console.print(t)
    pipe = r.get("pipeline")
    if pipe:
        _print_stages(console, pipe)
    m = r["memory"]
    line = (
        f"memory per device (compiled): params + optimizer state {_mib(m['params+opt_state'])}, gradients "
        f"{_mib(m['grads'])}{' (from their layouts)' if m['grads_from'] == 'layouts' else ''}, total "
        f"{_mib(m['total'])}; Ψ = {m['n_params']:,} parameters{' per stage' if pipe else ''}, "
        f"N = {m['data_devices']} data devices"
    )
    console.print(line)
    if "formula" in m:
        f = m["formula"]
        console.print(
            f"ZeRO stage {r['strategy'].rsplit('zero', 1)[-1]} formula: {_mib(f['total'])} (params "
            f"{_mib(f['params'])} + grads {_mib(f['grads'])} + optimizer state {_mib(f['opt_state'])}); "
            f"compiled / formula = {m['total'] / f['total']:.4f}"
        )
    if pipe:
        _print_stage_memory(console, pipe)
        _print_schedule(console, pipe["schedule"])
    _print_collectives(console, r, details, bool(pipe))
    if pipe:
        _print_transfers(console, pipe["transfers"], pipe["schedule"])
    for b in r["boundaries"]:

        def moves(cs):
            return (
                ", ".join(f"{c['kind']} over {','.join(c['axes'])} {c['payload_bytes']:,} B" for c in cs)
                or "no collective (a local slice)"
            )

        console.print(
            f"boundary {b['before']} -> {b['after']}: residual {tuple(b['shape'])} {b['spec_before']} -> "
            f"{b['spec_after']}; forward: {moves(b['forward'])}; backward: {moves(b['backward'])}"
        )
    console.print(r["picture"], highlight=False, markup=False)
    if "png" in r:
        console.print(f"wrote {r['png']}")


def collective_groups(collectives: list[dict]) -> list[dict]:
    """The collectives summed by (mesh axes, kind[, pipeline role]), the most bytes first; `where`
    names the places that move the most, three at most."""
    groups: dict[tuple, dict] = {}
    for c in collectives:
        key = (",".join(c["axes"]) or "-", c["kind"], c.get("role", ""))
        g = groups.setdefault(
            key,
            {"axes": key[0], "kind": key[1], "role": key[2], "count": 0, "total_bytes": 0, "places": defaultdict(int)},
        )
        g["count"] += c["count"]
        g["total_bytes"] += c["total_bytes"]
        g["places"][c["where"]] += c["total_bytes"]
    out = sorted(groups.values(), key=lambda g: -g["total_bytes"])
    for g in out:
        places = sorted(g.pop("places").items(), key=lambda kv: -kv[1])
        g["where"] = "; ".join(w for w, _ in places[:3]) + (f"; and {len(places) - 3} more" if len(places) > 3 else "")
    return out


def _short(text: str, n: int = 110) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _print_collectives(console, r: dict, details: bool, pipe: bool) -> None:
    from rich.table import Table

    title = "collectives in the compiled train step (per device, per step)"
    if not details:
        t = Table(title=f"{title}, by mesh axis and kind (--details: each one)", title_justify="left")
        for col in ("mesh axes", "kind", "times", "total bytes", "share", "mostly from") + (("role",) if pipe else ()):
            t.add_column(col)
        groups = collective_groups(r["collectives"])
        total = sum(g["total_bytes"] for g in groups) or 1
        for g in groups:
            t.add_row(
                g["axes"],
                g["kind"],
                str(g["count"]),
                f"{g['total_bytes']:,}",
                f"{g['total_bytes'] / total:.0%}",
                _short(g["where"]),
                *((g["role"],) if pipe else ()),
            )
        t.add_row(
            "all",
            "",
            str(sum(g["count"] for g in groups)),
            f"{sum(g['total_bytes'] for g in groups):,}",
            "100%",
            "",
            *(("",) if pipe else ()),
        )
    else:
        t = Table(title=title, title_justify="left")
        for col in ("mesh axes", "kind", "bytes each", "times", "total", "where") + (("role",) if pipe else ()):
            t.add_column(col)
        merged: dict[tuple, list] = defaultdict(lambda: [0, 0])
        for c in r["collectives"]:
            key = (",".join(c["axes"]) or "-", c["kind"], c["payload_bytes"], c["where"], c.get("role", ""))
            merged[key][0] += c["count"]
            merged[key][1] += c["total_bytes"]
        # Grouped by mesh axis and kind (the groups in total-bytes order), the biggest first within each.
        order = {(g["axes"], g["kind"]): i for i, g in enumerate(collective_groups(r["collectives"]))}
        for (axes, kind, each, where, role), (count, total) in sorted(
            merged.items(), key=lambda kv: (order[kv[0][:2]], -kv[1][1])
        ):
            t.add_row(axes, kind, f"{each:,}", str(count), f"{total:,}", _short(where, 140), *((role,) if pipe else ()))
    console.print(t)
    if r.get("platform") == "cpu" and any(
        c["kind"] == "all-reduce" and "fsdp" in c["axes"] and c["where"].startswith("backward")
        for c in r["collectives"]
    ):
        console.print(
            "note: XLA:CPU compiles the FSDP gradients' reduce-scatter as an all-reduce over fsdp (each "
            "device then keeps its shard), so it is listed as all-reduce fsdp here; on GPU and TPU it is "
            "a reduce-scatter, moving half the bytes.",
            highlight=False,
        )


def _print_stages(console, pipe: dict) -> None:
    from rich.table import Table

    s = pipe["schedule"]
    t = Table(
        title=f"pipeline stages: {s['stages']} stages on pp = {s['pp']} ranks"
        + (
            f" ({s['virtual_stages']} virtual stages each, stage k on rank k mod pp)" if s["virtual_stages"] > 1 else ""
        ),
        title_justify="left",
    )
    for col in ("pp rank", "devices", "layers stored", "stages run (layers)", "embed", "final_norm, lm_head"):
        t.add_column(col)
    for row in pipe["stages"]:
        t.add_row(
            str(row["rank"]),
            ",".join(map(str, row["devices"])),
            row["layers_stored"],
            ", ".join(f"{x['stage']} ({x['layers']})" for x in row["stages"]),
            row["embed"],
            row["head"],
        )
    console.print(t)
    console.print(
        "Every rank runs one program: it computes the embedding lookup at every forward clock and the head "
        "(final norm, output projection, loss) at every backward clock, and keeps only the first and last "
        "stage's; the tables' gradients are summed over pp (the 'sum over stages' all-reduce).",
        highlight=False,
    )
    if s["virtual_stages"] > 1:
        console.print(
            f"With virtual stages a rank runs other layers than it stores: every step the stored layers move "
            f"to their stages and the gradients back ({pipe['transfers']['relayout_bytes']:,} B per device over pp: "
            "the collectives marked 'layers to virtual stages').",
            highlight=False,
        )


def _print_stage_memory(console, pipe: dict) -> None:
    from rich.table import Table

    m, s, ranks = pipe["memory"], pipe["schedule"], pipe["schedule"]["ranks"]
    mb = m["microbatch_bytes"]
    console.print(
        f"per stage, per device (compiled; the same on every rank): params + optimizer state "
        f"{_mib(m['params+opt_state'])} = layers {_mib(m['state_layers'])} (the rank's share) + embedding, head and "
        f"counters {_mib(m['state_embedding+head'])} (whole on every rank)",
        highlight=False,
    )
    console.print(
        f"  temporaries {_mib(m['temporaries'])}, of which the stash buffers every rank allocates: "
        f"({s['act_slots']} + 1 trash) activation slots × {_mib(mb)} = {_mib(m['stash_buffer'])} and "
        f"({s['cot_slots']} + 1) cotangent slots = {_mib(m['cotangent_buffer'])}",
        highlight=False,
    )
    t = Table(title=f"activation stash by rank ({s['name']}, {s['microbatches']} microbatches)", title_justify="left")
    for col in ("pp rank", "microbatches in flight (peak)", "stage inputs stashed (peak)", f"× {_mib(mb)} per device"):
        t.add_column(col)
    for r, stash in zip(ranks, m["stash_by_rank"]):
        t.add_row(str(r["rank"]), str(r["in_flight"]), str(r["stash"]), _mib(stash) if stash else "0")
    console.print(t)


def _print_schedule(console, s: dict) -> None:
    console.print(
        f"schedule {s['name']}: pp = {s['pp']}, {s['microbatches']} microbatches"
        + (f", {s['virtual_stages']} virtual stages" if s["virtual_stages"] > 1 else "")
        + f", {s['clocks']} clocks; bubble {s['bubble']:.4f} from the table (a backward costs two forwards), "
        f"(p-1)/(m·v+p-1) = {s['theoretical_bubble']:.4f}",
        highlight=False,
    )
    console.print(
        "F3 forward of microbatch 3, B3 its backward, F3B1 both in one clock, · idle"
        + (", F3.1 on the rank's virtual stage 1" if s["virtual_stages"] > 1 else ""),
        highlight=False,
    )
    console.print(s["picture"], highlight=False, markup=False, soft_wrap=True)


def _print_transfers(console, x: dict, s: dict) -> None:
    c, e = x["compiled"], x["expected"]
    per = x["per_device_bytes"]
    split = (
        f" (split {x['microbatch_bytes'] // per} ways within the stage)" if per and x["microbatch_bytes"] != per else ""
    )
    console.print(
        f"stage transfers (collective-permute over pp, compiled): {c['count']} per step × "
        f"{', '.join(f'{b:,}' for b in c['payload_bytes'])} B = {c['bytes']:,} B per device",
        highlight=False,
    )
    console.print(
        f"  the schedule: one per forward clock (activations, {e['activations']}) + one per backward clock "
        f"(cotangents, {e['cotangents']}) = {e['count']} × one microbatch's stage input "
        f"{tuple(x['microbatch_shape'])}, {x['microbatch_bytes']:,} B, {per:,} B per device as compiled{split}"
        + (f" = {e['bytes']:,} B" if e["bytes"] is not None else ""),
        highlight=False,
    )
    useful = "; ".join(f"rank {u['rank']} {u['activations']} + {u['cotangents']}" for u in x["useful_by_rank"])
    console.print(
        f"  of these, carrying a microbatch (activations + cotangents): {useful}; the others send an idle "
        "clock's trash slot (every rank sends at every clock)",
        highlight=False,
    )
