"""`meshlm train [flags]`: every flag is a field of meshlm.config.TrainConfig, grouped by section."""

from __future__ import annotations

from meshlm.cli.flags import Parser, add_section_flags, split_model_overrides, train_config


def parser() -> Parser:
    p = Parser(prog="meshlm train", description="Train a LLaMA-family model on a dp,fsdp,tp,sp device mesh.")
    add_section_flags(p)
    return p


def run(argv: list[str]) -> int:
    from meshlm import distributed
    from meshlm.train.loop import train

    raw = list(argv)
    argv, overrides = split_model_overrides(argv)
    flags = parser()
    cfg = train_config(flags.parse_args(argv), overrides, given=flags.given)
    cluster = distributed.resolve(cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.peer_timeout)
    if cluster.multi_process and not distributed.is_worker():
        return distributed.supervise(["train", *raw], cluster)  # the work runs in a watched child
    summary = train(cfg)
    return 1 if summary.get("diverged") else 0  # stopped at a NaN/Inf loss (the last good checkpoint kept)
