"""Tests for meshlm.train.metrics: FLOPs formula, peak table, probe, logger outputs, console output."""

import io
import json
import math
import struct
import time

import pytest
from rich.console import Console

from meshlm.errors import UsageError
from meshlm.flops import detect_peak_flops, matmul_probe, model_flops_per_token, step_flops
from meshlm.models.configs import ModelConfig
from meshlm.train.metrics import MetricsLogger, TrainProgress, print_metrics_line, resolve_peak

# vocab 256, d_model 64, 2 layers, 8 heads (4 kv) x head_dim 8, mlp 128.
CFG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, mlp_dim=128, max_seq_len=512)


def test_flops_per_token_by_hand_untied_and_tied():
    # Per layer: wq 64*64 + wk 64*32 + wv 64*32 + wo 64*64 + mlp 3*64*128 + 2 norms of 64 = 36992.
    # Two layers + final norm 64 + head 64*256 = 90432 (the input embedding table is not counted).
    n = 2 * (4096 + 2048 + 2048 + 4096 + 24576 + 128) + 64 + 16384
    assert n == 90432
    # Attention forward per token per layer: 2 matmuls * 2 * seq 128 * 8 heads * 8 = 32768; x3 for training, x2 layers.
    attn_full = 3 * 2 * 32768
    tied = CFG.replace(tie_embeddings=True)
    assert tied.num_params() < CFG.num_params()  # tying removes parameters ...
    for cfg in (CFG, tied):  # ... but not FLOPs: the tied head's matmul still runs
        assert model_flops_per_token(cfg, 128, causal=False) == 6 * n + attn_full == 739200
        assert model_flops_per_token(cfg, 128, causal=True) == 6 * n + attn_full // 2 == 640896
    assert step_flops(CFG, 128, tokens=1024) == 640896 * 1024
    # Attention is the only term that grows with the sequence length.
    assert model_flops_per_token(CFG, 256) - model_flops_per_token(CFG, 128) == attn_full // 2
    with pytest.raises(UsageError):
        model_flops_per_token(CFG, 0)


@pytest.mark.parametrize(
    "kind, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
        ("NVIDIA H100 80GB HBM3", "float32", 494.7e12),  # TF32 tensor cores, not the bf16 peak
        ("NVIDIA H100 PCIe", "bfloat16", 756e12),
        ("NVIDIA H200", "bfloat16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
        ("NVIDIA A100-SXM4-40GB", "float32", 156e12),
        ("TPU v4", "bfloat16", 275e12),
        ("TPU v5 lite", "bfloat16", 197e12),
        ("TPU v5e", "float32", 197e12),
        ("TPU v5p", "bfloat16", 459e12),
        ("TPU v5", "bfloat16", 459e12),
        ("TPU v6 lite", "bfloat16", 918e12),
    ],
)
def test_detect_peak_flops_table(kind, dtype, peak):
    got, source = detect_peak_flops(kind, dtype)
    assert got == peak
    assert kind in source and ("NVIDIA" in source or "Cloud TPU" in source)


@pytest.mark.parametrize("kind", ["cpu", "TPU v4 lite", "NVIDIA GeForce RTX 3090", "Tesla V100-SXM2-16GB"])
def test_detect_peak_flops_unknown(kind):
    assert detect_peak_flops(kind, "bfloat16") is None


def test_matmul_probe_and_resolve_peak():
    t0 = time.perf_counter()
    flops = matmul_probe("float32", size=256, seconds=0.2)
    assert math.isfinite(flops) and flops > 1e8  # any CPU of this century does > 0.1 GFLOP/s
    assert time.perf_counter() - t0 < 15
    assert resolve_peak(3.5, "bfloat16") == (3.5e12, "--peak_tflops=3.5")
    with pytest.raises(UsageError):
        resolve_peak(0.0, "bfloat16")
    peak, source = resolve_peak(None, "float32")  # CPU here: measured
    assert math.isfinite(peak) and peak > 0 and "measured" in source


def _tfrecords(path):
    """Yield the payloads of a TFRecord file (TensorBoard event files are TFRecords)."""
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        yield data[pos + 12 : pos + 12 + length]
        pos += 12 + length + 4


def _tb_scalars(tb_dir):
    from tensorboardX.proto import event_pb2

    out = {}
    for f in tb_dir.iterdir():
        for rec in _tfrecords(f):
            ev = event_pb2.Event.FromString(rec)
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_logger_jsonl_tensorboard_png(tmp_path):
    out = tmp_path / "run"
    logger = MetricsLogger(
        out,
        flops_per_token=1e6,
        peak_flops_per_device=2e12,
        n_devices=4,
        total_steps=30,
        log_every=10,
        title="test model on fsdp=4",
    )
    assert logger.should_log(10) and logger.should_log(30) and not logger.should_log(11)
    m = logger.log(10, loss=2.5, tokens=8000, seconds=2.0, extra={"lr": 1e-3, "grad_norm": 0.5})
    assert m["tokens_per_s"] == pytest.approx(4000.0)
    assert m["tflops_per_device"] == pytest.approx(1e6 * 4000 / 4 / 1e12)
    assert m["mfu"] == pytest.approx(m["tflops_per_device"] * 1e12 / 2e12)
    logger.log(20, loss=2.0, tokens=6000, seconds=1.0, extra={"lr": 5e-4, "grad_norm": 0.25})
    logger.log(30, loss=float("nan"), tokens=6000, seconds=1.0)
    logger.close()
    logger.close()  # idempotent

    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}")) for line in lines]
    assert [r["step"] for r in rows] == [10, 20, 30]
    for r in rows:
        assert {"step", "loss", "tokens_per_s", "tflops_per_device", "mfu"} <= r.keys()
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 2.0)
    assert rows[1]["lr"] == 5e-4 and rows[1]["grad_norm"] == 0.25 and rows[1]["tokens_per_s"] == 6000
    assert rows[2]["loss"] is None  # NaN is written as null

    scalars = _tb_scalars(out / "tb")
    assert [s for s, _ in scalars["loss"]] == [10, 20]  # the NaN loss is not sent to TensorBoard
    assert scalars["loss"][1][1] == pytest.approx(2.0)
    assert {"mfu", "tokens_per_s", "tflops_per_device", "lr", "grad_norm"} <= scalars.keys()

    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_a_failed_run_closes_its_files_and_draws_nothing(tmp_path):
    """An error inside `closed_on_error` (a step that fails to trace) closes the event and metrics files,
    so the process ends with the error's one line and no writer thread's traceback; the error goes on."""
    out = tmp_path / "run"
    logger = MetricsLogger(
        out, flops_per_token=1e6, peak_flops_per_device=1e12, n_devices=1, total_steps=10, log_every=1
    )
    with pytest.raises(RuntimeError, match="step failed"), logger.closed_on_error():
        logger.log(1, loss=3.0, tokens=100, seconds=1.0)
        raise RuntimeError("step failed")
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert [s for s, _ in _tb_scalars(out / "tb")["loss"]] == [1]  # flushed by the close
    assert not (out / "loss.png").exists()
    logger.close()  # still safe afterwards: nothing left to close, nothing drawn
    assert not (out / "loss.png").exists()


def test_disabled_logger_writes_nothing(tmp_path):
    out = tmp_path / "run"
    logger = MetricsLogger(
        out, flops_per_token=1e6, peak_flops_per_device=1e12, n_devices=1, total_steps=10, log_every=1, enabled=False
    )
    m = logger.log(1, loss=1.0, tokens=100, seconds=1.0)
    assert m["tokens_per_s"] == 100  # still computed for the caller
    logger.close()
    assert not out.exists()


def test_progress_and_metrics_line_not_a_tty(capsys):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=120)
    m = {"step": 5, "loss": 1.23456, "tokens_per_s": 12345.6, "tflops_per_device": 0.5, "mfu": 0.25, "lr": 3e-4}
    with TrainProgress(10, console=console) as bar:
        for step in range(1, 11):
            bar.update(step, m if step % 5 == 0 else None)
            if step % 5 == 0:
                bar.print_metrics(m)
    text = buf.getvalue()
    assert "step      5 | loss 1.2346 | 12,346 tok/s | 0.500 TFLOP/s/dev | MFU 25.0% | lr 3.00e-04" in text
    assert "10/10" in text and "\x1b[" not in text  # final bar, no escape codes
    assert len(text.splitlines()) <= 4  # two metric lines and one final bar: no flood

    with TrainProgress(10, enabled=False) as bar:
        bar.update(3, m)
        bar.print_metrics(m)
    print_metrics_line(m)  # module console follows sys.stdout
    assert capsys.readouterr().out.count("loss 1.2346") == 1
