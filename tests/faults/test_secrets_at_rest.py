"""Issue 25, secrets at rest: no secret of the executor reaches a run or its evidence.

The executor's environment holds the NATS password, the Slack signing secret and the
Alertmanager token (that is how the shipped units hand them over). A run through the real
executor and ansible-runner leaves STATE/runs/<id> for 14 days: grep it for each secret.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from gpuops.act.evidence import Evidence, new_run_id
from gpuops.act.playbooks import resolve
from gpuops.act.runner import RunRequest, run_playbook
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import SystemClock
from gpuops.models import RunStatus, action_subject
from gpuops.signing import load_key, sign
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import signing_key_path

from tests.conftest import counted, engine_settings, run_outcomes, running_engine, wait_for
from tests.support import drain_intent

pytestmark = pytest.mark.faults

# As a deployment sets them: executor.env and engine.env (deploy/systemd/etc/gpuops/).
# Each secret is as long as the settings ask (settings.MIN_SECRET_CHARS, 24 or more).
ENVIRONMENT = {
    "GPUOPS_NATS__PASSWORD": "nats-pw-3f9c1e77aa5d20b4c8e1f6",
    "GPUOPS_CHATOPS__SLACK_SIGNING_SECRET": "slack-sign-8d2b4c0f19e7a35b6d",
    "GPUOPS_SOURCES__ALERTMANAGER__TOKEN": "am-token-51e0d9b6c2f84a07e3b1",
    # A site's own variable that its playbooks need (executor.env_allow): the run gets
    # it, and the evidence still masks it, since its name says it is a secret.
    "SITE_VAULT_TOKEN": "vault-tok-a7c3e9f104b62d58c9",
}
# Secrets of the settings file. The site's playbooks post to Slack themselves, through
# the webhook the settings name: SITE_WEBHOOK looks like no secret, the settings say it is.
CONSOLE_TOKEN = "console-tok-6b1f0e2d93a4c7e851"
WEBHOOK = "http://127.0.0.1:1/services/c8e4a1f7b2"  # refused at once


def _grep(root: Path, secrets: set[str]) -> list[str]:
    """`file: secret` for every secret found in any file under `root` (the issue's grep)."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [f"{path.relative_to(root)}: {s}" for s in sorted(secrets) if s.encode() in data]
    return found


async def test_a_run_through_the_executor_leaves_no_secret_in_its_evidence(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)
    monkeypatch.setenv("SITE_WEBHOOK", WEBHOOK)
    settings = engine_settings(
        tmp_path,
        fleet,
        nats_server.url,
        role="executor",
        executor={"env_allow": ["SITE_VAULT_TOKEN", "SITE_WEBHOOK"]},
        console={"tokens": [{"user": "ops", "token": CONSOLE_TOKEN}]},
        chatops={"webhooks": [{"url": WEBHOOK}]},
    )
    intent = drain_intent("secrets-drain")
    signed = sign(intent, load_key(signing_key_path(settings)))
    await bus.js.publish(action_subject(intent.node), signed.model_dump_json().encode())
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: counted(app.engine.metrics.runs) >= 1, 120)

    (outcome,) = await run_outcomes(bus)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert fleet.state("node-001")["drained"] is True, "the drain ran for real"
    runs = settings.state_dir / "runs"
    assert outcome.run_id is not None and (runs / outcome.run_id / "run.json").is_file()
    secrets = set(ENVIRONMENT.values()) | {WEBHOOK, CONSOLE_TOKEN}
    assert _grep(runs, secrets) == []
    env = json.loads((runs / outcome.run_id / "command").read_text())["env"]
    assert not {n for n in env if n.startswith("GPUOPS_")}, "none of the executor's settings"
    assert env["SITE_VAULT_TOKEN"] == "********", "the site's variable went in, masked at rest"
    assert env["SITE_WEBHOOK"] == "********", "masked as a secret of the settings"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["HOME"] == os.environ["HOME"]


def test_the_playbook_process_gets_only_the_allowed_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LC_TIME", "C.UTF-8")
    books = tmp_path / "books"
    books.mkdir()
    seen = tmp_path / "seen.env"
    # `env` found on PATH, run by ansible-playbook found on PATH: the allowed PATH works.
    (books / "env.yml").write_text(
        "- name: Environment\n  hosts: all\n  gather_facts: false\n  tasks:\n"
        "    - name: Write what the task's process was given\n"
        f"      ansible.builtin.shell: env > {seen}\n"
        "      changed_when: true\n"
    )
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)
    request = RunRequest(
        key="env",
        rule="test",
        node="node-001",
        playbook=resolve(books, "env.yml", None, tmp_path),
        playbook_name="env.yml",
        inventory=fleet.root / "inventory",
        timeout_s=120,
        limit="node-001",
        run_id=new_run_id(time.time()),
        evidence=Evidence(tmp_path / "runs"),
    )
    outcome = run_playbook(request, SystemClock())

    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    names = {line.split("=", 1)[0] for line in seen.read_text().splitlines() if "=" in line}
    assert not names & set(ENVIRONMENT), "no secret reached the playbook's process"
    assert not {n for n in names if n.startswith("GPUOPS_")}
    assert {"PATH", "HOME", "LC_TIME"} <= names
    assert _grep(tmp_path / "runs", set(ENVIRONMENT.values())) == []


@pytest.mark.parametrize("password", ["calvin", 'Grüß-"bmc"-2026'])
def test_a_bmc_password_is_masked_in_a_run_nobody_sealed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, password: str
) -> None:
    """Review of issue 30: ansible-runner writes the child's environment to `command` as
    the run starts; a factory password shorter than any value the scrub searches for
    (iDRAC's `calvin`), or one JSON writes unescaped, stayed there in clear, and so did
    every password of a run whose executor died before sealing it."""
    monkeypatch.setenv("GPUOPS_BMC_PASSWORD", password)
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)
    intent = drain_intent("unsealed-drain")
    evidence = Evidence(tmp_path / "runs")
    run_id = new_run_id(intent.decided_at)
    book = resolve(Path(__file__).resolve().parents[2] / "playbooks", "drain.yml", None, tmp_path)
    request = RunRequest.for_intents(
        [intent], book, fleet.root / "inventory", 120, run_id=run_id, evidence=evidence
    )
    outcome = run_playbook(request, SystemClock())  # never sealed: as if the executor died
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    env = json.loads((tmp_path / "runs" / run_id / "command").read_text())["env"]
    assert env["GPUOPS_BMC_PASSWORD"] == "********", "the playbook got it; the file keeps none"
    assert evidence.scrub_unsealed() == [run_id], "the next executor scrubs what was left"
    assert _grep(tmp_path / "runs", {password}) == []
