"""The attention kernels `--attention` names; `meshlm.ops.kernels` dispatches them (`auto`: the
backend's own choice)."""

KERNELS = ("auto", "blockwise", "dense", "cudnn", "triton", "splash")
