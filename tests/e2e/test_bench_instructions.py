"""`gpuops bench instructions`: a replay's instructions a GPU sample under callgrind,
steady where CPU time is not: the same tree measured twice reads the same."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import gpuops_argv

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # four replays under valgrind: `make test-slow`
@pytest.mark.skipif(
    shutil.which("valgrind") is None, reason="needs valgrind (scripts/ci-setup.sh installs it)"
)
def test_a_tree_against_itself_reads_the_same_instructions_a_sample() -> None:
    # 800 samples: a process's own count moves by some 300,000 instructions from run to
    # run (its random keys and ids), a percent of a sample's cost over 80 samples.
    argv = ["bench", "instructions", "--gpus", "1600", "--samples", "800", "--rules", "1"]
    done = subprocess.run(
        gpuops_argv(*argv, "--base", str(ROOT / "engine")),
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "the first 800 of 1,600 GPU samples (100 v2 lines)" in done.stdout, done.stdout
    found = re.search(
        r"1 rule: ([\d,]+) instructions a sample; base ([\d,]+) \(([-+]\d+\.\d)%\)", done.stdout
    )
    assert found is not None, done.stdout
    here, base = (int(found.group(i).replace(",", "")) for i in (1, 2))
    # A GPU sample of replay is some 100,000 to 200,000 instructions; the same tree twice
    # differs by the allocator's and the collector's few, not by a percent.
    assert 50_000 < here < 1_000_000 and abs(here - base) / base < 0.01, done.stdout


def test_without_valgrind_it_says_what_to_install(tmp_path: Path) -> None:
    done = subprocess.run(
        gpuops_argv("bench", "instructions", "--gpus", "8", "--samples", "8"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PATH": str(tmp_path), "HOME": str(tmp_path)},
    )
    assert done.returncode != 0
    assert "install it (Debian: valgrind)" in done.stderr + done.stdout


@pytest.mark.slow  # two replays and two engines under valgrind: `make test-slow`
@pytest.mark.skipif(
    shutil.which("valgrind") is None, reason="needs valgrind (scripts/ci-setup.sh installs it)"
)
def test_live_against_replay_prints_both_and_their_ratio() -> None:
    argv = ["bench", "instructions", "--live", "--gpus", "800", "--seconds", "10"]
    done = subprocess.run(
        gpuops_argv(*argv), capture_output=True, text=True, timeout=1800, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "samples: 800 GPU samples (100 v2 lines: 10 nodes x 8 GPUs" in done.stdout, done.stdout
    replay = re.search(r"^replay: ([\d,]+) instructions a GPU sample", done.stdout, re.M)
    live = re.search(
        r"^live: ([\d,]+) instructions a GPU sample \(8 partitions, 6 messages", done.stdout, re.M
    )
    ratio = re.search(r"^live/replay: (\d+\.\d\d)$", done.stdout, re.M)
    assert replay and live and ratio, done.stdout
    r, v = (int(m.group(1).replace(",", "")) for m in (replay, live))
    # Live does what replay does and more (a message read, its MAC checked, pulls, acks):
    # never less, and not ten times more.
    assert 20_000 < r < v < 10 * r, done.stdout
    assert float(ratio.group(1)) == pytest.approx(v / r, abs=0.006)


def test_live_refuses_what_it_would_ignore(tmp_path: Path) -> None:
    done = subprocess.run(
        gpuops_argv("bench", "instructions", "--live", "--base", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "no --samples, --base" in done.stderr
