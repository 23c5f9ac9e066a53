"""Kept run evidence: run ids, rotation by age and by total size, runs in progress left alone,
secrets masked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gpuops.act.evidence import RUN_ID, Evidence, RunMeta, new_run_id, scrub
from gpuops.errors import ActionError

DAY = 86400.0
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def _run(evidence: Evidence, started: float, size: int) -> str:
    run_id = new_run_id(started)
    where = evidence.prepare() / run_id
    (where / "job_events").mkdir(parents=True)
    (where / "stdout").write_bytes(b"x" * size)
    (where / "job_events" / "1-a.json").write_text("{}")
    evidence.seal(
        RunMeta(
            run_id=run_id,
            playbook="drain.yml",
            started=started,
            ended=started + 1,
            status="successful",
        )
    )
    return run_id


def test_run_ids_sort_by_start_and_are_safe_directory_names() -> None:
    first, second = new_run_id(T0), new_run_id(T0 + 1)
    assert first.startswith("20260101T000000-") and RUN_ID.match(first)
    assert first < second


@pytest.mark.parametrize("bad", ["../etc", "20260101T000000-1a2b3c4d/../x", "", "x"])
def test_anything_but_a_run_id_is_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ActionError, match="is not a run id"):
        Evidence(tmp_path).stdout(bad)


def test_sealing_records_the_size(tmp_path: Path) -> None:
    evidence = Evidence(tmp_path / "runs")
    run_id = _run(evidence, T0, 1000)
    (meta,) = evidence.kept()
    assert meta.run_id == run_id and meta.bytes == 1002  # stdout and the event file


def test_runs_past_the_age_limit_are_removed(tmp_path: Path) -> None:
    evidence = Evidence(tmp_path / "runs", max_age_s=14 * DAY, max_bytes=1 << 30)
    old = _run(evidence, T0, 10)
    new = _run(evidence, T0 + 10 * DAY, 10)
    assert evidence.rotate(T0 + 15 * DAY) == [old]
    assert [m.run_id for m in evidence.kept()] == [new]
    assert not (evidence.root / old).exists()


def test_the_oldest_runs_go_while_past_the_size_limit(tmp_path: Path) -> None:
    evidence = Evidence(tmp_path / "runs", max_age_s=14 * DAY, max_bytes=2500)
    runs = [_run(evidence, T0 + i * 60, 998) for i in range(4)]  # 1000 bytes each
    assert evidence.rotate(T0 + 3600) == runs[:2]
    assert [m.run_id for m in evidence.kept()] == runs[2:]


def test_an_unsealed_run_is_kept_until_past_the_age_limit(tmp_path: Path) -> None:
    """A run an executor never sealed (it died mid-run) goes by the age its id names."""
    evidence = Evidence(tmp_path / "runs", max_age_s=DAY, max_bytes=1 << 20)
    running = evidence.prepare() / new_run_id(T0)
    running.mkdir()
    (running / "stdout").write_bytes(b"x" * (2 << 20))  # over the size limit by itself
    assert evidence.rotate(T0 + 60) == [] and running.exists()
    assert evidence.rotate(T0 + 2 * DAY) == [running.name] and not running.exists()


def test_a_run_in_flight_is_never_removed_whatever_the_clocks_say(tmp_path: Path) -> None:
    """The age is the executor's clock against the run id, never the file's mtime: an
    injected clock years ahead of the host (replay, the tests) removed a run's directory
    while ansible-runner wrote to it, and the run hung. In flight, it is not touched."""
    evidence = Evidence(tmp_path / "runs", max_age_s=DAY, max_bytes=1 << 30)
    future = T0 + 4 * 365 * DAY
    running = evidence.prepare() / new_run_id(future)
    running.mkdir()
    os.utime(running, (T0, T0))  # the host's clock: years before the run's own
    assert evidence.rotate(future + 60) == [] and running.exists()
    inflight = frozenset({running.name})
    assert evidence.rotate(future + 2 * DAY, in_flight=inflight) == [] and running.exists()
    assert evidence.rotate(future + 2 * DAY) == [running.name]


def test_output_of_a_rotated_run_says_where_to_look(tmp_path: Path) -> None:
    with pytest.raises(ActionError, match="rotated away, or it ran on an executor"):
        Evidence(tmp_path).stdout(new_run_id(T0))


def test_rotation_deletes_by_directory_name_never_by_what_a_record_says(tmp_path: Path) -> None:
    evidence = Evidence(tmp_path / "runs", max_age_s=DAY, max_bytes=1 << 30)
    run_id = _run(evidence, T0, 10)
    precious = tmp_path / "precious"
    precious.mkdir()
    meta = evidence.root / run_id / "run.json"
    meta.write_text(meta.read_text().replace(run_id, "../precious"))
    evidence.rotate(T0 + 30 * DAY)
    assert precious.is_dir(), "a record naming another path deleted nothing outside"


def test_scrub_masks_each_secret_raw_and_inside_json_and_leaves_short_values(
    tmp_path: Path,
) -> None:
    quoted = 'pa"ss\\word-42'  # as a job event's JSON writes it: escaped
    (tmp_path / "job_events").mkdir()
    (tmp_path / "command").write_text('{"env": {"GPUOPS_NATS__PASSWORD": "s3cret-nats-pw"}}')
    (tmp_path / "job_events" / "1-a.json").write_text(json.dumps({"stdout": quoted}))
    (tmp_path / "stdout").write_text("ok: [node-001]\n")
    changed = scrub(tmp_path, ["s3cret-nats-pw", quoted, "1"])
    assert sorted(p.name for p in changed) == ["1-a.json", "command"]
    assert (tmp_path / "command").read_text() == '{"env": {"GPUOPS_NATS__PASSWORD": "********"}}'
    assert json.loads((tmp_path / "job_events" / "1-a.json").read_text()) == {"stdout": "********"}
    assert (tmp_path / "stdout").read_text() == "ok: [node-001]\n", "a short value is left"


def test_sealing_scrubs_the_settings_secrets_and_secret_looking_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SITE_API_TOKEN", "tok-from-the-environment")
    evidence = Evidence(tmp_path / "runs", secrets=frozenset({"from-the-settings-file"}))
    run_id = new_run_id(T0)
    where = evidence.prepare() / run_id
    where.mkdir()
    (where / "stdout").write_text("tok-from-the-environment from-the-settings-file")
    meta = evidence.seal(
        RunMeta(run_id=run_id, playbook="d.yml", started=T0, ended=T0, status="successful")
    )
    assert (where / "stdout").read_text() == "******** ********"
    assert meta.bytes == len("******** ********"), "the size is the scrubbed one"
