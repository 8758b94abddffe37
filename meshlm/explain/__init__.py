"""`meshlm explain`: the layouts, memory and collectives a strategy gives the train step (see `analysis`),
and with `--pp` its pipeline stages, schedule and stage transfers (see `pipeline`)."""

from meshlm.explain.analysis import (  # noqa: F401
    boundaries,
    collectives,
    layout,
    param_rows,
    picture,
    state_memory,
    write_png,
)
