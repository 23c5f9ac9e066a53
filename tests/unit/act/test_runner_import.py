"""The first import of ansible-runner, raced by two worker threads (a new executor's
first two batches): the second must not get a Runner before the package is whole."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

# In a fresh interpreter: the first thread's import is held where ansible-runner's
# `__init__` reads its plugins' entry points (the package's last step); the second asks
# for `init_runner` once `ansible_runner.interface` is already loaded, and reports what
# `ansible_runner.plugins` (iterated at every status change) is when it has it.
_RACE = textwrap.dedent(
    """
    import importlib.metadata as md, sys, threading, time
    entry_points = md.entry_points
    def held(**kw):
        if kw.get("group") == "ansible_runner.plugins":
            time.sleep(0.5)
        return entry_points(**kw)
    md.entry_points = held
    from gpuops.act.runner import init_runner
    first = threading.Thread(target=init_runner)
    first.start()
    while "ansible_runner.interface" not in sys.modules:
        time.sleep(0.001)
    init_runner()
    print(type(sys.modules["ansible_runner"].plugins).__name__)
    first.join()
    """
)


def test_a_second_thread_gets_init_runner_only_once_the_package_is_whole() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _RACE],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "engine"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "dict", "a Runner would iterate the plugins subpackage"
