"""`meshlm explain`'s tables: every parameter's gradient / optimizer-state layout, collectives summed by
mesh axis and kind (each one with --details), the model's names for where they come from, and the
note on how XLA:CPU writes the FSDP reduce-scatter."""

import io

from meshlm.cli.explain import collective_groups, print_report
from meshlm.explain.names import readable


def test_op_names_read_as_the_model():
    assert (
        readable("transpose(jvp())/while/body/closed_call/bte,ekd->btkd/dot_general")
        == "backward of layers/attn k, v projection (wk, wv)"
    )
    assert (
        readable("jvp()/while/body/closed_call/dot_general") == "forward of layers/attention matmuls (scores, values)"
    )
    assert readable("transpose(jvp(bte,ev->btv))/dot_general") == "backward of lm_head"
    assert readable("jvp(jit(_take))/gather") == "forward of embed lookup"
    fused = readable("transpose(jvp())/while/body/closed_call/(bte,ekd->btkd/dot_general:bthd,hde->bte/dot_general)")
    assert fused == "backward of layers/attn k, v projection (wk, wv), attn output projection (wo)"
    for name in ("transpose(jvp())/while/body/closed_call/mul", "jvp()/reduce_max", "reduce_sum"):
        assert "jvp" not in readable(name) and "while" not in readable(name)


def row(kind, axes, each, count, where):
    return dict(kind=kind, axes=axes, payload_bytes=each, count=count, total_bytes=each * count, where=where, role="")


REPORT = {
    "mesh_dim": "1,4,2,1",
    "strategy": "default",
    "groups": [],
    "platform": "cpu",
    "parameters": [
        dict(
            path="embed",
            shape=[8, 4],
            spec="P('tp', 'fsdp')",
            grad_spec="P('tp', 'fsdp')",
            opt_spec="P('tp', 'fsdp')",
            bytes=16,
            source="table default",
        )
    ],
    "memory": {
        "params+opt_state": 10,
        "grads": 5,
        "grads_from": "compiled",
        "total": 15,
        "n_params": 32,
        "data_devices": 4,
    },
    "collectives": [
        row("all-gather", ["fsdp"], 100, 2, "forward of layers/attention matmuls (scores, values)"),
        row("all-reduce", ["tp"], 10, 3, "forward of layers/attn output projection (wo)"),
        row("all-reduce", ["fsdp"], 500, 1, "backward of layers/attention matmuls (scores, values)"),
        row("all-gather", ["fsdp"], 50, 2, "backward of layers/attention matmuls (scores, values)"),
    ],
    "boundaries": [],
    "picture": "",
}


def printed(**kw):
    out = io.StringIO()
    print_report(REPORT, file=out, **kw)
    return out.getvalue()


def test_grads_and_optimizer_state_column_is_filled():
    line = next(l for l in printed().splitlines() if "embed" in l and "table default" in l)
    assert line.count("P('tp', 'fsdp')") == 3, line


def test_collectives_are_summed_by_axis_and_kind_biggest_first():
    groups = collective_groups(REPORT["collectives"])
    assert [(g["axes"], g["kind"], g["total_bytes"], g["count"]) for g in groups] == [
        ("fsdp", "all-reduce", 500, 1),
        ("fsdp", "all-gather", 300, 4),
        ("tp", "all-reduce", 30, 3),
    ]
    out = printed()
    assert "by mesh axis and kind" in out and "830" in out  # the total row
    assert "bytes each" not in out
    detail = printed(details=True)
    assert "bytes each" in detail and detail.count("all-gather") == 2


def test_cpu_fsdp_gradient_all_reduce_is_explained():
    assert "XLA:CPU compiles the FSDP gradients' reduce-scatter as an all-reduce" in printed()
    assert "XLA:CPU" not in (lambda: (REPORT.update(platform="gpu"), printed(), REPORT.update(platform="cpu"))[1])()
