"""What the user chose: a preset (`--strategy`), a ZeRO stage (`--zero_stage`) and rules (`--sharding_rules`).

    strategy, rules = choose("fsdp_tp", zero_stage=None, rules_file="rules.toml")
    placement = place(cfg, mesh, strategy, rules)

Layering, bottom to top: the preset's tables (`presets`), the file's [logical] overrides, the ZeRO
stage (`zero`), then per-parameter [[rules]] and per-layer-range [[layers]] (`rules`). Each
[[layers]] preset gets the same [logical] overrides and ZeRO stage as the main one.
"""

from __future__ import annotations

from meshlm.sharding import Strategy
from meshlm.strategy.presets import DEFAULT, PRESETS, preset
from meshlm.strategy.rules import LayerGroup, Rules, load
from meshlm.strategy.zero import check_pipelined, with_zero_stage


def choose(
    strategy: str = "default", zero_stage: int | None = None, rules_file: str | None = None
) -> tuple[Strategy, Rules | None]:
    rules = load(rules_file) if rules_file else None

    def make(name: str) -> Strategy:
        s = preset(name)
        return with_zero_stage(rules.over(s) if rules else s, zero_stage)

    main = make(strategy)
    return main, rules.with_layer_strategies(make) if rules else None


__all__ = ["choose", "DEFAULT", "PRESETS", "preset", "Rules", "LayerGroup", "with_zero_stage", "check_pipelined"]
