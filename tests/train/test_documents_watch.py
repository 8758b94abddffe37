"""The warning for rows that hold more documents than cuDNN's packed attention keeps apart: once, only
where the job runs that kernel."""

import numpy as np

from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.train.diagnostics import DocumentsWatch

CFG = resolve_model("test", {})
POLICY = RunPolicy(dtype="bfloat16", max_documents=3)


def _batch(documents_per_row):
    return {"segment_ids": np.stack([np.arange(16) * n // 16 + 1 for n in documents_per_row])}


def test_warns_once_where_cudnn_packs_documents():
    watch = DocumentsWatch(CFG, POLICY, 16, ring=False, platform="gpu", gpu_capability=9.0)
    assert watch.check(_batch([1, 3])) is None
    line = watch.check(_batch([2, 5]))
    assert "5 documents" in line and "--model.max_documents=3" in line and "\n" not in line
    assert watch.check(_batch([7])) is None  # once


def test_silent_where_another_kernel_runs():
    many = _batch([6])
    assert DocumentsWatch(CFG, POLICY, 16, ring=False, platform="cpu", gpu_capability=None).check(many) is None
    assert DocumentsWatch(CFG, POLICY, 16, ring=False, platform="gpu", gpu_capability=8.0).check(many) is None  # triton
    assert DocumentsWatch(CFG, POLICY, 16, ring=True, platform="gpu", gpu_capability=9.0).check(many) is None  # ring
    forced = POLICY.replace(attention="triton")
    assert DocumentsWatch(CFG, forced, 16, ring=False, platform="gpu", gpu_capability=9.0).check(many) is None
