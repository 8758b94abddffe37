"""`meshlm.hlo` on hand-written HLO: loop trip counts multiply, the three spellings of replica groups,
payload bytes per kind, and the mesh axes a group spans."""

import jax

from meshlm import hlo
from meshlm.mesh import build_mesh, parse_mesh_dim

TEXT = """HloModule step

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %x = f32[8,4]{1,0} parameter(0)
  %ag = f32[16,4]{1,0} all-gather(f32[8,4]{1,0} %x), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, metadata={op_name="jit(step)/while/body/all_gather"}
  %ar = f32[8,4]{1,0} all-reduce(f32[8,4]{1,0} %x), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  ROOT %t = (s32[], f32[8,4]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8,4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %w = (s32[], f32[8,4]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = bf16[2,4]{1,0} reduce-scatter(bf16[8,4]{1,0} %a), channel_id=3, replica_groups=mesh['dp'=1,'fsdp'=2,'tp'=4]{'tp'}, dimensions={0}
  %cp-start = (f32[8,4]{1,0}, f32[8,4]{1,0}) collective-permute-start(f32[8,4]{1,0} %a), source_target_pairs={{0,4},{4,0}}, metadata={op_name="jit(step)/ppermute"}
  %cp-done = f32[8,4]{1,0} collective-permute-done(%cp-start)
  %one = f32[8,4]{1,0} all-reduce(f32[8,4]{1,0} %a), channel_id=4, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
  ROOT %r = f32[8,4]{1,0} copy(%a)
}
"""


def test_parse_counts_payloads_and_groups():
    got = {c.kind: c for c in hlo.parse_collectives(TEXT) if c.group_size > 1}
    assert set(got) == {"all-gather", "all-reduce", "reduce-scatter", "collective-permute"}
    assert (got["all-gather"].payload_bytes, got["all-gather"].group_size, got["all-gather"].count) == (256, 2, 3)
    assert (got["all-reduce"].payload_bytes, got["all-reduce"].group_size, got["all-reduce"].count) == (128, 4, 3)
    assert (got["reduce-scatter"].payload_bytes, got["reduce-scatter"].group_size) == (64, 4)  # its input, bf16
    assert (got["collective-permute"].payload_bytes, got["collective-permute"].count) == (128, 1)
    assert got["collective-permute"].op_name == "jit(step)/ppermute"
    summary = hlo.summarize(hlo.parse_collectives(TEXT))
    assert summary["all-gather"] == 3 * 256 and summary["all-reduce"] == 3 * 128  # the group of one is left out
    assert summary["total"] == 3 * 256 + 3 * 128 + 64 + 128


def test_on_mesh_names_the_axes_of_each_group():
    mesh = build_mesh(parse_mesh_dim("1,2,4,1", 8), jax.devices()[:8])  # dp, fsdp, tp, sp; sp fastest
    rows = {c.kind: c for c in hlo.on_mesh(TEXT, mesh)}
    assert rows["all-gather"].axes == ("tp",)  # devices 0, 1
    assert rows["all-reduce"].axes == ("fsdp", "tp")  # an iota transposed: 0, 2, 4, 6
    assert rows["reduce-scatter"].axes == ("tp",)
    assert rows["collective-permute"].axes == ("fsdp",) and rows["collective-permute"].op_name == "ppermute"
    assert rows["all-gather"].result_shapes == ((16, 4),) and rows["all-gather"].total_bytes == 3 * 256
    assert len(rows) == 4  # the group of one is left out


# XLA:TPU's spellings: a while without known_trip_count (the bound is in its condition, the start in the
# tuple it takes, the step in its body), operands printed without shapes, async permutes with u32[]
# contexts, and an asynchronous collective fusion whose done-part holds a copy of the all-gather.
TPU_TEXT = """HloModule step

%cond (p: (s32[], f32[8,4])) -> pred[] {
  %p = (s32[], f32[8,4]) parameter(0)
  %limit = s32[]{:T(128)} constant(6)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %limit), direction=LT
}

%start_part (x: bf16[8,4]) -> (bf16[8,4], bf16[16,4], u32[]) {
  %x = bf16[8,4]{1,0:T(8,128)(2,1)} parameter(0)
  %ag = bf16[16,4]{1,0:T(8,128)(2,1)} all-gather(%x), channel_id=7, replica_groups={{0,1},{2,3}}, dimensions={0}
  ROOT %t = (bf16[8,4], bf16[16,4], u32[]) tuple(%x, %ag, %x)
}

%done_part (x: bf16[8,4]) -> bf16[16,4] {
  %x = bf16[8,4]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %ag.1 = bf16[16,4]{1,0:T(8,128)(2,1)} all-gather(%x), channel_id=7, replica_groups={{0,1},{2,3}}, dimensions={0}
}

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %two = s32[]{:T(128)} constant(2)
  %next = s32[]{:T(128)} add(%i, %two)
  %x = f32[8,4]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %cp = (f32[8,4]{1,0:T(8,128)}, f32[8,4]{1,0:T(8,128)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %cpd = f32[8,4]{1,0:T(8,128)} collective-permute-done(%cp)
  %y = bf16[8,4]{1,0:T(8,128)(2,1)} convert(%cpd)
  %async-collective-start.1 = (bf16[8,4], bf16[16,4], u32[]) fusion(%y), kind=kCustom, calls=%start_part
  %async-collective-done.1 = bf16[16,4]{1,0:T(8,128)(2,1)} fusion(%y), kind=kCustom, calls=%done_part
  ROOT %t = (s32[], f32[8,4]) tuple(%next, %cpd)
}

ENTRY %main (a: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0:T(8,128)} parameter(0)
  %zero = s32[]{:T(128)} constant(0)
  %z = s32[]{:T(128)} copy(%zero)
  %t0 = (s32[], f32[8,4]) tuple(%z, %a)
  %w = (s32[], f32[8,4]) while(%t0), condition=%cond, body=%body
  %ar = f32[8,4]{1,0:T(8,128)} all-reduce(%a), channel_id=4, replica_groups=[2,2]<=[4], to_apply=%add
  ROOT %r = f32[8,4]{1,0} copy(%a)
}
"""


def test_tpu_programs_loops_async_permutes_and_collective_fusions():
    got = {c.kind: c for c in hlo.parse_collectives(TPU_TEXT)}
    assert got["collective-permute"].count == 3  # i = 0, 2, 4 < 6
    assert got["collective-permute"].payload_bytes == 128  # what it sends, not sent + received
    assert len([c for c in hlo.parse_collectives(TPU_TEXT) if c.kind == "all-gather"]) == 1  # the start's copy only
    assert (got["all-gather"].payload_bytes, got["all-gather"].count) == (128, 3)
    assert (got["all-reduce"].payload_bytes, got["all-reduce"].count) == (128, 1)
