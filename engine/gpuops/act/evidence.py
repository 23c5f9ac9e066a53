"""Run evidence: each playbook run's ansible-runner artifacts, kept under STATE/runs/<run id>.

ansible-runner writes stdout, job_events/, rc, status and command there itself; the
executor adds `run.json` (playbook version, hosts, the intent each host served, times,
size). Past the age limit, and then oldest first past the size limit, runs are removed.
A run still going has no `run.json` yet and is never removed.

Sealing scrubs the run's files first (`scrub`): the values of the settings' secrets and
of secret-looking variables of the executor's environment become `********`, wherever a
playbook, a verbose ssh or ansible-runner put them. ansible-runner writes the child's
whole environment to `command` before the playbook starts: secret-named variables are
masked there by name as soon as the run is running (`mask_command`), whatever their
length, and a run an executor never sealed (it died mid-run) is scrubbed when the next
executor starts (`scrub_unsealed`).
"""

from __future__ import annotations

import calendar
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from gpuops.errors import ActionError

log = logging.getLogger(__name__)

META = "run.json"
STDOUT = "stdout"
# Sortable by start time, unique without coordination, and safe as a directory name.
RUN_ID = re.compile(r"^[0-9]{8}T[0-9]{6}-[0-9a-f]{8}$")
SECRET_NAME = re.compile(r"PASS|SECRET|TOKEN|KEY|CRED", re.IGNORECASE)
# Shorter values would match ordinary text all over the evidence ("1", "true", "admin").
MIN_SECRET_LEN = 8
MASK = b"********"


def new_run_id(now: float) -> str:
    """`20260101T120000-1a2b3c4d`: the run's start (UTC) and a random suffix."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + "-" + uuid.uuid4().hex[:8]


def run_started(run_id: str) -> float:
    """When a run began, read from its id: the executor's clock, as `now` in rotation is
    (a file's mtime is the host's clock, which an injected clock need not agree with)."""
    return float(calendar.timegm(time.strptime(run_id.split("-", 1)[0], "%Y%m%dT%H%M%S")))


class RunMeta(BaseModel):
    """What a kept run was: written when it ends, read by rotation and `history --run`."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    run_id: str
    playbook: str
    revision: str | None = None
    sha256: str | None = None
    started: float
    ended: float
    status: str
    rc: int | None = None
    intents: dict[str, str] = {}  # host -> intent key
    bytes: int = 0


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                continue
    return total


def _last_written(path: Path) -> float:
    """The newest modification time under `path` (the host's clock)."""
    newest = path.lstat().st_mtime
    for file in _files(path):
        try:
            newest = max(newest, file.lstat().st_mtime)
        except OSError:
            continue
    return newest


def secret_looking(environ: Mapping[str, str]) -> frozenset[str]:
    """Values of the variables whose names say they hold a secret (PASS, TOKEN, KEY...)."""
    return frozenset(v for k, v in environ.items() if SECRET_NAME.search(k))


def _forms(secret: str) -> set[bytes]:
    """The secret as written raw, and as it reads inside a JSON string, ASCII-escaped (job
    events) or not (ansible-runner's `command`)."""
    return {
        secret.encode(),
        json.dumps(secret)[1:-1].encode(),
        json.dumps(secret, ensure_ascii=False)[1:-1].encode(),
    }


COMMAND = "command"


def mask_command(artifact_dir: Path) -> bool:
    """Mask, by name, the secret-named variables of the environment ansible-runner wrote to
    the run's `command`: a BMC's factory password is shorter than any value `scrub` may
    search for. Whether the file changed."""
    path = artifact_dir / COMMAND
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    env = data.get("env") if isinstance(data, dict) else None
    if not isinstance(env, dict):
        return False
    masked = {k: MASK.decode() if SECRET_NAME.search(k) else v for k, v in env.items()}
    if masked == env:
        return False
    path.write_text(json.dumps({**data, "env": masked}, ensure_ascii=False), encoding="utf-8")
    return True


def _files(directory: Path) -> list[Path]:
    """The plain files under `directory`; links are never followed (a link could point out)."""
    out = []
    for root, _dirs, files in os.walk(directory):
        out += [p for p in (Path(root) / n for n in files) if p.is_file() and not p.is_symlink()]
    return out


def scrub(directory: Path, secrets: Iterable[str]) -> list[Path]:
    """Mask every secret in every file under `directory` (links not followed); the files changed."""
    forms = sorted(
        {f for s in secrets if len(s) >= MIN_SECRET_LEN for f in _forms(s)}, key=len, reverse=True
    )
    changed = []
    for path in _files(directory):
        data = path.read_bytes()
        clean = data
        for form in forms:
            clean = clean.replace(form, MASK)
        if clean != data:
            path.write_bytes(clean)
            changed.append(path)
    return changed


@dataclass(frozen=True, slots=True)
class Evidence:
    """The runs directory and its limits."""

    root: Path
    max_age_s: float = 14 * 86400.0
    max_bytes: int = 1 << 30
    secrets: frozenset[str] = field(default=frozenset(), repr=False)  # masked when sealed

    def prepare(self) -> Path:
        """The runs directory, private to this user (job events may hold host variables)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.root

    def dir_for(self, run_id: str) -> Path:
        """Where a run's artifacts are; ActionError for anything that is not a run id."""
        if not RUN_ID.match(run_id):
            raise ActionError(f"{run_id!r} is not a run id (like 20260101T120000-1a2b3c4d)")
        return self.root / run_id

    def seal(self, meta: RunMeta) -> RunMeta:
        """Scrub the run's files, write its `run.json` with its size: rotation may remove it."""
        where = self.dir_for(meta.run_id)
        where.mkdir(parents=True, exist_ok=True)
        self._scrub(where)
        sealed = meta.model_copy(update={"bytes": _size(where)})
        (where / META).write_text(sealed.model_dump_json(indent=1))
        return sealed

    def _scrub(self, where: Path) -> None:
        mask_command(where)
        scrub(where, self.secrets | secret_looking(os.environ))

    def scrub_unsealed(self, quiet_s: float = 0.0) -> list[str]:
        """Scrub the runs an executor never sealed (it died mid-run): until they age out,
        their files are read like any run's (`history --run`, the console). A run written
        to within `quiet_s` may be another executor's, still going: left to its sealing."""
        sealed = {m.run_id for m in self.kept()}
        done = []
        for path in self.root.iterdir() if self.root.is_dir() else ():
            if path.name in sealed or not RUN_ID.match(path.name) or not path.is_dir():
                continue
            if time.time() - _last_written(path) >= quiet_s:  # files carry the host's clock
                self._scrub(path)
                done.append(path.name)
        return done

    def stdout(self, run_id: str) -> str:
        """The run's output as ansible-playbook printed it."""
        path = self.dir_for(run_id) / STDOUT
        try:
            return path.read_text(errors="replace")
        except OSError as exc:
            raise ActionError(
                f"no output kept for run {run_id} under {self.root}: it was rotated away, "
                "or it ran on an executor with another state dir (look there)"
            ) from exc

    def kept(self) -> list[RunMeta]:
        """The finished runs kept, oldest first."""
        runs = []
        for meta_file in self.root.glob(f"*/{META}"):
            try:
                meta = RunMeta.model_validate_json(meta_file.read_bytes())
            except (OSError, ValidationError):
                log.warning("unreadable run record %s; left alone", meta_file)
                continue
            # Rotation deletes by run id: only the directory's own name, never a path a
            # record's contents could name.
            if meta.run_id != meta_file.parent.name or not RUN_ID.match(meta.run_id):
                log.warning("run record %s names another run; left alone", meta_file)
                continue
            runs.append(meta)
        return sorted(runs, key=lambda m: (m.started, m.run_id))

    def rotate(self, now: float, in_flight: frozenset[str] = frozenset()) -> list[str]:
        """Remove runs past the age limit, then the oldest while past the size limit;
        never a run in flight (its ansible-runner still writes there)."""
        runs = self.kept()
        total = sum(m.bytes for m in runs)
        removed = self._leftovers(now, {m.run_id for m in runs} | in_flight)
        for meta in runs:
            if now - meta.started <= self.max_age_s and total <= self.max_bytes:
                break
            shutil.rmtree(self.root / meta.run_id, ignore_errors=True)
            total -= meta.bytes
            removed.append(meta.run_id)
        return removed

    def _leftovers(self, now: float, sealed: set[str]) -> list[str]:
        """Runs an executor never sealed (it died mid-run), once past the age limit."""
        removed = []
        for path in self.root.iterdir() if self.root.is_dir() else ():
            if path.name in sealed or not RUN_ID.match(path.name):
                continue
            if now - run_started(path.name) > self.max_age_s:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed
