"""Power budgets: per inventory group a budget in watts, schedules and overrides, and the
controller that keeps each group under its budget by moving GPUs' power limits.

- `units`: watts as people write them (`32kW`), parsed strictly;
- `config`: the `power:` section of the settings (budgets, windows, floors, tuning);
- `budgets`: which budget holds for a group now (override, window, base);
- `allocate`: the pure allocation of one group's budget over its GPUs;
- `controller`: telemetry in, limit changes out, with hysteresis, steps and dwell;
- `engine`: the controller inside the engine (its loop, intents, KV records, the stage
  that keeps other rules off budgeted GPUs).

The `power` command is gpuops/ops/power.py; `gpuops bench power` is gpuops/bench/power.py.

May import: bus, decide, inventory, match, record.
"""
