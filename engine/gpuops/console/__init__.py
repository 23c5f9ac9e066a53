"""The web console: the fleet at a glance, a node's story, what needs a person now.

Served by the engine's HTTP server under /console (docs/console.md).

May import: act, bus, inventory, match, ops, record.
"""

from gpuops.console.latest import Latest
from gpuops.console.web import BudgetSource, Console

__all__ = ["BudgetSource", "Console", "Latest"]
