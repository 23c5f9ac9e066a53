"""Real peers the playbooks talk to, started on loopback for a test and stopped after it.

Each module starts one real program from the system's packages or PyPI (never a mock of
it): Slurm's slurmctld and slurmd with munge (`slurm`), OpenIPMI's BMC simulator
`ipmi_sim` (`ipmi`), the sushy-tools Redfish emulator (`redfish`). Each is a context
manager for pytest fixtures and a command line (`python -m tests.peers.NAME up|down DIR`,
from the checkout) for molecule's prepare and destroy.
Where the program is not installed the fixture skips, saying which package
scripts/ci-setup.sh installs.
"""
