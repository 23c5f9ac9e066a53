"""gpuops: an event-driven remediation engine for GPU clusters.

The package root holds only the shared vocabulary every folder speaks: models (events,
matches, decisions, intents), settings, errors, clock, subjects, catalog (what each
playbook does), signing, shipped (where rules and playbooks are). The folders are the
flow (bus, intake, match, decide, act, record, inventory), the spine that joins them,
and the feature wings; each folder's docstring says what it may import
(tests/unit/test_layers.py holds every import to it).

May import: power.config (the settings compose the power section), diagnose.results (a
run's outcome carries its graded diagnostics' result).
"""

__version__ = "0.1.0"
