"""A run's environment: the allow-list, what ansible-runner adds, SSH host key checking on."""

from __future__ import annotations

import shlex
from pathlib import Path

from gpuops.act.runenv import RunEnv, child_env
from gpuops.settings import Settings

PARENT = {
    "PATH": "/usr/bin",
    "HOME": "/var/lib/gpuops",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "SSH_AUTH_SOCK": "/run/agent.sock",
    "ANSIBLE_PRIVATE_KEY_FILE": "/run/credentials/ssh-key",
    "GPUOPS_NATS__PASSWORD": "nats-secret",
    "GPUOPS_CHATOPS__SLACK_SIGNING_SECRET": "slack-secret",
    "HTTPS_PROXY": "http://proxy:3128",
    "ANSIBLE_VAULT_PASSWORD_FILE": "/etc/vault-pass",
}


def test_a_run_gets_the_allowed_names_and_none_of_the_executors_secrets(tmp_path: Path) -> None:
    env = RunEnv().build(PARENT, tmp_path)
    kept = {"HOME", "LANG", "LC_ALL", "SSH_AUTH_SOCK", "ANSIBLE_PRIVATE_KEY_FILE"}
    assert {k: env[k] for k in kept} == {k: PARENT[k] for k in kept}
    assert env["PATH"].endswith(":/usr/bin"), "the venv's bin first, then the executor's PATH"
    assert not {"GPUOPS_NATS__PASSWORD", "GPUOPS_CHATOPS__SLACK_SIGNING_SECRET"} & set(env)
    assert not {"HTTPS_PROXY", "ANSIBLE_VAULT_PASSWORD_FILE"} & set(env), "not asked for"


def test_the_site_adds_names_by_pattern(tmp_path: Path) -> None:
    env = RunEnv(allow=("*_PROXY",)).build(PARENT, tmp_path)
    assert env["HTTPS_PROXY"] == "http://proxy:3128" and "GPUOPS_NATS__PASSWORD" not in env


def test_what_ansible_runner_copied_from_the_parent_goes_and_what_it_set_stays() -> None:
    ours = {"PATH": "/venv/bin:/usr/bin", "HOME": "/var/lib/gpuops"}
    parent = {**PARENT, "ANSIBLE_CALLBACK_PLUGINS": "/site/callbacks"}
    prepared = {
        **parent,  # ansible-runner starts from os.environ.copy()
        **ours,
        "ANSIBLE_STDOUT_CALLBACK": "awx_display",
        "ANSIBLE_CALLBACK_PLUGINS": "/site/callbacks:/runner/callback",
    }
    assert child_env(prepared, ours, parent) == {
        **ours,
        "ANSIBLE_STDOUT_CALLBACK": "awx_display",
        "ANSIBLE_CALLBACK_PLUGINS": "/site/callbacks:/runner/callback",
    }


def _ssh_options(env: dict[str, str]) -> dict[str, str]:
    words = shlex.split(env["ANSIBLE_SSH_ARGS"])
    pairs = [words[i + 1] for i, w in enumerate(words) if w == "-o"]
    return dict(p.split("=", 1) for p in pairs)


def test_host_keys_are_checked_by_default_against_the_state_dirs_known_hosts(
    tmp_path: Path,
) -> None:
    settings = Settings(state_dir=tmp_path / "my state")
    env = RunEnv.of(settings).build(PARENT, tmp_path)
    assert env["ANSIBLE_HOST_KEY_CHECKING"] == "True"
    options = _ssh_options(env)
    assert options["StrictHostKeyChecking"] == "yes"
    assert options["UserKnownHostsFile"] == str(tmp_path / "my state" / "ssh" / "known_hosts")
    assert options["ControlPersist"] == "60s", "ansible's own ssh_args are kept"


def test_accept_new_enrols_new_hosts_into_the_sites_known_hosts(tmp_path: Path) -> None:
    settings = Settings.model_validate(
        {
            "state_dir": tmp_path,
            "executor": {"host_key_checking": "accept-new", "known_hosts": "/srv/site/known_hosts"},
        }
    )
    options = _ssh_options(RunEnv.of(settings).build(PARENT, tmp_path))
    assert options["StrictHostKeyChecking"] == "accept-new"
    assert options["UserKnownHostsFile"] == "/srv/site/known_hosts"
