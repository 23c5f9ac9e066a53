"""What a playbook run's process is given: an environment from an allow-list, host key checks.

ansible-runner seeds a run's environment with the executor's whole `os.environ`, hands
that to ansible-playbook and writes it into the run's `command` artifact, which the
evidence keeps for weeks. The executor's environment holds the NATS password, the Slack
signing secret, the Alertmanager token. So a run gets only the names in `ALLOWED`, the
site's `executor.env_allow`, the ANSIBLE_* settings below and what ansible-runner sets
itself (`child_env`), never the rest.

SSH host keys are checked: `strict` refuses a host whose key is not in the known_hosts
file, `accept-new` (onboarding) records a new host's key there and refuses a changed
one (ssh's StrictHostKeyChecking=yes and =accept-new; docs/deploy.md#ssh-host-keys).
"""

from __future__ import annotations

import fnmatch
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuops.settings import Settings

# Shell patterns of the executor's variables a run keeps. ANSIBLE_PRIVATE_KEY_FILE is how
# the shipped units hand ansible the SSH key's path (deploy/systemd, deploy/k8s);
# GPUOPS_BMC_* hold the BMC credentials the playbooks read (playbooks/tasks/bmc.yml), and
# the evidence masks their values (a name with PASS in it is a secret's).
ALLOWED = (
    "PATH",
    "HOME",
    "LANG",
    "LC_*",
    "TMPDIR",
    "SSH_AUTH_SOCK",
    "ANSIBLE_PRIVATE_KEY_FILE",
    "GPUOPS_BMC_*",
)
# ansible's own default ssh_args, which ANSIBLE_SSH_ARGS replaces: kept in front.
_SSH_DEFAULTS = "-C -o ControlMaster=auto -o ControlPersist=60s"
_STRICT = {"strict": "yes", "accept-new": "accept-new"}
_REFUSED = ("Host key verification failed", "REMOTE HOST IDENTIFICATION HAS CHANGED")

HostKeyChecking = Literal["strict", "accept-new"]


def allowed(environ: Mapping[str, str], patterns: tuple[str, ...]) -> dict[str, str]:
    """The variables of `environ` whose names match one of `patterns` (case matters)."""
    return {
        name: value
        for name, value in environ.items()
        if any(fnmatch.fnmatchcase(name, p) for p in patterns)
    }


def child_env(
    prepared: Mapping[str, str], ours: Mapping[str, str], parent: Mapping[str, str]
) -> dict[str, str]:
    """ansible-runner's prepared environment without what it copied from `parent` unasked.

    It keeps what we passed (`ours`) and what ansible-runner set itself (its callback
    plugin, artifact dir): a name it did not set still holds the parent's value.
    """
    return {k: v for k, v in prepared.items() if k in ours or parent.get(k) != v}


@dataclass(frozen=True, slots=True)
class RunEnv:
    """The environment policy of playbook runs: extra names allowed, host key checking."""

    allow: tuple[str, ...] = ()
    host_keys: HostKeyChecking = "strict"
    known_hosts: Path | None = None  # None: ssh's own (~/.ssh/known_hosts)

    @classmethod
    def of(cls, settings: Settings) -> RunEnv:
        """The policy the settings give; known_hosts defaults to STATE/ssh/known_hosts."""
        ex = settings.executor
        return cls(
            allow=ex.env_allow,
            host_keys=ex.host_key_checking,
            known_hosts=ex.known_hosts or settings.state_dir / "ssh" / "known_hosts",
        )

    def build(self, environ: Mapping[str, str], data_dir: Path) -> dict[str, str]:
        """A run's whole environment: the allowed names of `environ`, then ansible's settings."""
        env = allowed(environ, ALLOWED + self.allow)
        # ansible-playbook from this environment, even when PATH lacks the venv.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
        return {**env, **self._ansible(data_dir)}

    def ssh_args(self) -> str:
        """ANSIBLE_SSH_ARGS: ansible's defaults, then the host key policy and its file.

        ssh takes the first value of an option, and ansible puts ssh_args before a host's
        ansible_ssh_common_args: only a host's own ansible_ssh_args replaces the policy.
        """
        args = f"{_SSH_DEFAULTS} -o StrictHostKeyChecking={_STRICT[self.host_keys]}"
        if self.known_hosts is not None:
            args += " -o " + shlex.quote(f"UserKnownHostsFile={self.known_hosts}")
        return args

    def hint(self, unreachable: str) -> str:
        """What to do when ssh refused a host's key: where keys are enrolled ("" otherwise)."""
        # ssh's banner for a changed key is long enough to push its last line out of the
        # message kept (800 characters): either line says the key was refused.
        if not any(line in unreachable for line in _REFUSED):
            return ""
        where = self.known_hosts or "~/.ssh/known_hosts"
        return f" (its host key is unknown or changed: enrol it in {where}; docs/deploy.md)"

    def prepare(self) -> None:
        """The known_hosts file's folder, private, so that accept-new can record keys."""
        if self.known_hosts is not None:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _ansible(self, data_dir: Path) -> dict[str, str]:
        return {
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_SSH_ARGS": self.ssh_args(),
            "ANSIBLE_RETRY_FILES_ENABLED": "False",
            "ANSIBLE_NOCOLOR": "True",
            "ANSIBLE_LOCAL_TEMP": str(data_dir / "tmp"),
            # One process per module instead of a temp dir, a copy, a chmod and a cleanup.
            "ANSIBLE_PIPELINING": "True",
            "ANSIBLE_GATHERING": "explicit",
        }
