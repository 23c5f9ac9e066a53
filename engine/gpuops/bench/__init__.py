"""Every benchmark and soak (`gpuops bench ...`): the product reads and runs without this
folder, and nothing outside it imports it (the CLI finds its commands by entry point).

May import: act, bus, cli, decide, intake, inventory, match, ops, power, record, scale, sim,
spine.
"""
