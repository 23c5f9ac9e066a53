"""`gpuops bench instructions`: what `gpuops replay` costs a GPU sample in instructions.

On a shared VM, CPU time moves by a third between two runs of the same build, so it
cannot show a 5% change; the instructions a process executes barely move. This bench
runs the rulebook bench's replay (its kind of recording, v2 JSON lines, the same 1 and 20
threshold rules, memory stores) under valgrind's callgrind, once on the recording and
once on an empty file, and prints the difference a sample: what the samples cost,
without the start-up (imports, bytecode compiles) both runs share. The recording is
smaller than the rulebook bench's (18,000 GPU samples, not 90,000, to keep callgrind's
runs to minutes) and made alike, ten samples a node, so a tenth of its lines are a
node's first keyframe as there; `--samples` measures only the first of them (the first
lines of a recording are every node's keyframe, the costliest kind).
With `--base`, another checkout's source root (a git worktree of an earlier commit, its
`engine` folder) is measured the same way on the same file, and the change printed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec

from gpuops.bench.replay import record
from gpuops.bench.rulebook import samples
from gpuops.bus import wire
from gpuops.errors import ConfigError

# The replay the rulebook bench times (`_replay_cpu`), in a process of its own: argv is
# the v2 file and the rule count. The tree measured is the one on PYTHONPATH.
_REPLAY = (
    "import sys; from pathlib import Path; "
    "from gpuops.bench.rulebook import _replay_cpu, conditions, gpuops_rules; "
    "_replay_cpu(Path(sys.argv[1]), gpuops_rules(conditions(int(sys.argv[2]))))"
)
_TOTAL = re.compile(rb"^(?:summary|totals): (\d+)", re.MULTILINE)
RUN_TIMEOUT_S = 3600


def bench_instructions(
    gpus: int, first: int | None, rule_counts: list[int], base: Path | None
) -> Iterator[str]:
    """Figures, one line each; `first` None measures the whole recording."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise ConfigError("bench instructions runs under valgrind: install it (Debian: valgrind)")
    if base is not None and not (base / "gpuops" / "bench" / "rulebook.py").is_file():
        raise ConfigError(f"--base {base}: not a source root with gpuops/bench/rulebook.py")
    here = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-instructions-") as held:
        work = Path(held)
        recording, _, recorded = record(work, gpus)
        v2 = work / "v2.jsonl"
        samples(recording, v2)
        head, n, lines = _head(v2, first, work / "head.jsonl")
        empty = work / "empty.jsonl"
        empty.write_text("")
        yield (
            f"samples: the first {n:,} of {recorded:,} GPU samples ({lines:,} v2 lines); "
            "callgrind, PYTHONHASHSEED=0, net of the same process on an empty file"
        )
        runs = {"this tree": here, **({"base": base} if base is not None else {})}
        for k in rule_counts:
            per = {
                name: (_count(valgrind, root, head, k) - _count(valgrind, root, empty, k)) / n
                for name, root in runs.items()
            }
            line = f"{k} rule{'s' if k > 1 else ''}: {per['this tree']:,.0f} instructions a sample"
            if "base" in per:
                change = (per["this tree"] - per["base"]) / per["base"] * 100
                line += f"; base {per['base']:,.0f} ({change:+.1f}%)"
            yield line


def _head(v2: Path, first: int | None, out: Path) -> tuple[Path, int, int]:
    """The v2 lines holding the first `first` GPU samples (whole lines; None: all of
    them): the file, how many samples and lines it holds."""
    n = lines = 0
    with v2.open("rb") as src, out.open("wb") as dst:
        for line in src:
            if first is not None and n >= first:
                break
            n += len(msgspec.json.decode(wire.read(line).gpus))
            lines += 1
            dst.write(line)
    if n == 0:
        raise ConfigError("no samples to measure: raise --samples or --gpus")
    return out, n, lines


def _count(valgrind: str, root: Path, path: Path, rules: int) -> int:
    """Instructions of one replay of `path` with the tree at `root` on the path."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return callgrind(valgrind, [sys.executable, "-c", _REPLAY, str(path), str(rules)], env)[0]


def callgrind(valgrind: str, argv: list[str], env: dict[str, str]) -> tuple[int, bytes]:
    """Instructions of one command under callgrind (PYTHONHASHSEED=0: the same dicts and
    sets each run), and what it printed."""
    with tempfile.NamedTemporaryFile(prefix="callgrind-", suffix=".out") as out:
        env = {**env, "PYTHONHASHSEED": "0"}
        argv = [valgrind, "--tool=callgrind", f"--callgrind-out-file={out.name}", *argv]
        done = subprocess.run(argv, capture_output=True, env=env, timeout=RUN_TIMEOUT_S)
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace")[-2000:]
            raise ConfigError(f"{argv[3:6]} under callgrind failed ({done.returncode}):\n{tail}")
        found = _TOTAL.search(Path(out.name).read_bytes())
    if found is None:
        raise ConfigError(f"callgrind wrote no instruction total for {argv[3:6]}")
    return int(found.group(1)), done.stdout
