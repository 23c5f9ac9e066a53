"""Issue 10, defect 4: an intent the engine did not decide and sign runs nothing.

Whoever can publish on `gpuops.actions.>` tries what worked before: an unsigned intent,
one signed with another key, and signed ones (as if the key leaked) naming a playbook
outside `playbooks/` or the pattern `all` for a node, and a signed one decided a month
ago (sent again once its claim aged out). The executor refuses each, counts it, records
why, and no tool is called on any node.
"""

from __future__ import annotations

import time
from pathlib import Path

from gpuops.bus.conn import ACTIONS, Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.models import ActionSpec, Intent, RunStatus, action_subject
from gpuops.record.audit import read_audit
from gpuops.signing import load_key, sign
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import signing_key_path

from tests.conftest import calls, counted, engine_settings, running_engine, wait_for


def _intent(node: str, playbook: str, key: str, age_s: float = 0.0) -> Intent:
    now = time.time() - age_s
    return Intent(
        key=key,
        rule="forged",
        node=node,
        action=ActionSpec(playbook=playbook, vars={"reason": "forged"}),
        event_id=f"forged-{key}",
        event_ts=now,
        decided_at=now,
    )


async def _queue(bus: Bus) -> int:
    return int((await bus.js.stream_info(ACTIONS)).state.messages)


async def test_unsigned_foreign_and_out_of_catalogue_intents_run_nothing(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    evil = tmp_path / "x" / "evil.yml"
    evil.parent.mkdir()
    pwned = tmp_path / "pwned"
    evil.write_text(f"- hosts: all\n  tasks:\n    - command: touch {pwned}\n")
    settings = engine_settings(tmp_path, fleet, nats_server.url, role="executor")
    key = load_key(signing_key_path(settings))
    forged = [
        _intent("node-001", "drain.yml", "unsigned"),
        sign(_intent("node-001", "drain.yml", "other-key"), b"not the engine's key" * 2),
        sign(_intent("node-001", f"../../../..{evil}", "traversal"), key),
        sign(_intent("node-001", str(evil), "absolute"), key),
        sign(_intent("all", "drain.yml", "pattern"), key),
        # Signed, but decided long ago: captured off the queue and sent again once its
        # claim aged out, or left queued while the executors were down past the lock.
        sign(_intent("node-001", "drain.yml", "stale", age_s=31 * 86400), key),
    ]
    async with running_engine(settings, bus) as app:
        for intent in forged:
            subject = action_subject(intent.node)
            await bus.js.publish(subject, intent.model_dump_json().encode())
        refused = app.engine.metrics.runs
        await wait_for(lambda: counted(refused, RunStatus.REFUSED.value) == len(forged), 60)
    assert await _queue(bus) == 0, "each refused intent was taken off the queue"
    assert counted(refused) == len(forged), "nothing else ran"
    for node in fleet.nodes:
        assert calls(fleet, node) == [], f"no tool was called on {node}"
    notes = [r.summary async for r in read_audit(bus.js) if "intent refused" in r.summary]
    assert len(notes) == len(forged)
    assert sum("signature does not verify" in n for n in notes) == 2
    assert sum("not in the catalogue" in n for n in notes) == 2
    assert sum("not one host of the inventory" in n for n in notes) == 1
    assert sum("longer than a node lock's lease" in n for n in notes) == 1
    assert not _exists(pwned), "the playbook outside playbooks/ never ran"


def _exists(path: Path) -> bool:
    return path.exists()
