"""Act: the executor, the ansible-runner bridge, playbook versions and run evidence.

May import: bus, inventory, record, diagnose (a grade run's result, typed).
"""
