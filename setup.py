"""The build step pyproject.toml cannot say: ship the site-shaped folders in the wheel.

rules/, playbooks/, schemas/, inventories/example/, tests/rules/ and examples/ stay at the
top of the repository (that is what a site looks like, and people edit them there); a
wheel carries a copy under gpuops/_shipped/, where gpuops/shipped.py finds it. An
editable install needs no copy: shipped.py reads the checkout.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# Keep in step with gpuops.shipped.PARTS (tests/e2e/test_install.py checks the wheel).
PARTS = ("rules", "playbooks", "schemas", "inventories/example", "tests/rules", "examples")


class BuildPyWithShipped(build_py):
    """build_py, then the shipped folders copied into the build tree."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "gpuops" / "_shipped"
        # A stale copy would keep files deleted from the repository since the last build.
        shutil.rmtree(target, ignore_errors=True)
        for part in PARTS:
            shutil.copytree(
                HERE / part,
                target / part,
                ignore=shutil.ignore_patterns(".*", "__pycache__", "*.pyc", "*.retry"),
            )


setup(cmdclass={"build_py": BuildPyWithShipped})
