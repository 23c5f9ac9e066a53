"""Settings: a file, then GPUOPS_* environment, then flags; one frozen object; clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.errors import ConfigError
from gpuops.settings import Settings, load_settings, secret_values


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "gpuops.yml"
    config.write_text(
        "dry_run: true\nmax_parallel_runs: 2\nnats: {url: nats://file:4222}\n"
        "safety: {attempt_cap: 3}\n"
    )
    env = {"GPUOPS_MAX_PARALLEL_RUNS": "6", "GPUOPS_NATS__URL": "nats://env:4222", "HOME": "/x"}
    s = load_settings(config, {"nats": {"url": "nats://flag:4222"}}, env)
    assert s.dry_run is True and s.max_parallel_runs == 6 and s.safety.attempt_cap == 3
    assert s.nats.url == "nats://flag:4222"
    with pytest.raises(Exception, match="frozen"):
        s.dry_run = False  # type: ignore[misc]


def test_secrets_are_not_printed(tmp_path: Path) -> None:
    secret = "s3cr3t-0123456789abcdef0123"
    env = {"GPUOPS_NATS__PASSWORD": "hunter2", "GPUOPS_CHATOPS__SLACK_SIGNING_SECRET": secret}
    s = load_settings(None, {}, env)
    assert "hunter2" not in repr(s) and secret not in repr(s)
    assert s.chatops.slack_signing_secret is not None
    assert s.chatops.slack_signing_secret.get_secret_value() == secret


def test_a_structured_value_in_the_environment_is_json_and_bad_json_is_named() -> None:
    off = load_settings(None, {}, {"GPUOPS_SAFETY__DOMAIN_BUDGETS": "{}"})
    assert off.safety.domain_budgets == {}
    rack = load_settings(None, {}, {"GPUOPS_SAFETY__DOMAIN_BUDGETS": '{"rack": {"nodes": 1}}'})
    assert list(rack.safety.domain_budgets) == ["rack"]
    assert rack.safety.domain_budgets["rack"].limit(8) == 1
    with pytest.raises(ConfigError, match="GPUOPS_SAFETY__DOMAIN_BUDGETS: not JSON"):
        load_settings(None, {}, {"GPUOPS_SAFETY__DOMAIN_BUDGETS": "{rack"})
    with pytest.raises(ConfigError, match=r"safety\.domain_budgets\.row"):
        load_settings(None, {}, {"GPUOPS_SAFETY__DOMAIN_BUDGETS": '{"row": {"nodes": 1}}'})


def test_unknown_key_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "gpuops.yml"
    config.write_text("dryrun: true\n")
    with pytest.raises(ConfigError, match="dryrun: Extra inputs are not permitted"):
        load_settings(config, {}, {})


def test_secret_values_finds_every_secret_of_the_settings() -> None:
    values = {name: f"{name}-0123456789abcdef01234567" for name in ("slack", "mm1", "mm2")}
    values |= {name: f"{name}-0123456789abcdef01234567" for name in ("console", "am")}
    settings = Settings.model_validate(
        {
            "nats": {"password": "nats-pw", "token": "nats-tok"},
            "chatops": {
                "slack_signing_secret": values["slack"],
                "mattermost_tokens": [values["mm1"], values["mm2"]],
            },
            "console": {"tokens": [{"user": "ops", "token": values["console"]}]},
            "sources": {"alertmanager": {"token": values["am"]}},
        }
    )
    assert secret_values(settings) == {"nats-pw", "nats-tok", *values.values()}
    assert secret_values(Settings()) == frozenset()


def test_a_bare_user_name_in_a_grant_is_refused_with_how_to_write_it(tmp_path: Path) -> None:
    config = tmp_path / "gpuops.yml"
    config.write_text("chatops:\n  permissions:\n    drain: {users: [alice]}\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(config, {}, {})
    message = str(refused.value)
    assert "chatops.permissions.drain.users: " in message
    assert "'alice' is not a principal" in message
    assert "slack:T0123/U0456 or cli:alice" in message
    users = ["slack:T0123/U0456", "mattermost:kwoknj9nwp/rnina9994b", "console:bob", "cli:alice"]
    config.write_text(f"chatops:\n  permissions:\n    drain: {{users: {users}}}\n")
    assert load_settings(config, {}, {}).chatops.permissions["drain"].users == tuple(users)


@pytest.mark.parametrize(
    "user",
    ["slack:T0123", "slack:T0123/U04/56", "mattermost:/u1", "cli:", "cli:a b", "email:a@b", "*"],
)
def test_a_grant_must_name_one_principal_exactly(tmp_path: Path, user: str) -> None:
    config = tmp_path / "gpuops.yml"
    config.write_text(f"chatops:\n  permissions:\n    drain: {{users: ['{user}']}}\n")
    with pytest.raises(ConfigError, match="is not a principal"):
        load_settings(config, {}, {})


def test_the_audit_dedupe_window_covers_the_oldest_intent_an_executor_runs(
    tmp_path: Path,
) -> None:
    default = Settings()
    assert default.nats.audit_dedupe_s >= default.safety.lock_lease_s
    config = tmp_path / "gpuops.yaml"
    config.write_text("safety:\n  lock_lease_s: 7200\n")
    longer = load_settings(config)
    assert longer.nats.audit_dedupe_s == 7200.0, "raised to the intents' age limit"
    kept = Settings.model_validate(
        {"safety": {"lock_lease_s": 600}, "nats": {"audit_dedupe_s": 3600}}
    )
    assert kept.nats.audit_dedupe_s == 3600.0, "a longer window set is kept"
