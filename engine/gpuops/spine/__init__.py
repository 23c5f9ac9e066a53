"""The spine: the one wiring function (build), the pipeline's single entry, the engine's
loops (app), and shadow mode (replay, rule tests) built by the same function.

May import: act, bus, console, decide, diagnose (the topology manifests), http, intake,
inventory, match, ops, power, record, scale, sim.
"""
