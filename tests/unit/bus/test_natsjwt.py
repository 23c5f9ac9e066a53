"""NATS JWTs and creds files: the v2 layout nats-server reads, signatures that check,
and keys that cannot be mixed up (the server itself is in tests/deploy/test_nats_jwt.py)."""

from __future__ import annotations

import base64
import json

import pytest
from gpuops import subjects
from gpuops.bus import natsjwt
from gpuops.bus.auth import node_permissions, permissions_of
from gpuops.errors import BusError


def part(token: str, index: int) -> dict[str, object]:
    text = token.split(".")[index]
    return dict(json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))))


def test_a_jwt_is_header_claims_and_signature_in_base64url_without_padding() -> None:
    operator, account = natsjwt.new_key("operator"), natsjwt.new_key("account")
    token = natsjwt.account_jwt(operator, account, "GPUOPS", jetstream=True)
    assert token.count(".") == 2 and "=" not in token
    assert part(token, 0) == {"typ": "JWT", "alg": "ed25519-nkey"}
    claims = natsjwt.decode(token, operator)
    assert (claims["iss"], claims["sub"], claims["name"]) == (
        operator.public,
        account.public,
        "GPUOPS",
    )
    assert claims["nats"]["type"] == "account" and claims["nats"]["version"] == 2
    assert claims["nats"]["limits"]["disk_storage"] == natsjwt.NO_LIMIT  # JetStream on


def test_the_id_is_the_digest_of_the_standard_claims() -> None:
    key = natsjwt.new_key("operator")
    token = natsjwt.encode(key, key.public, "x", {"type": "operator"}, now=1700000000)
    claims = natsjwt.decode(token, key)
    standard = {"iat": 1700000000, "iss": key.public, "name": "x", "sub": key.public}
    assert claims["jti"] == natsjwt._jti(standard)
    assert len(claims["jti"]) == 52  # base32 of 32 bytes, no padding


def test_the_system_account_has_no_jetstream() -> None:
    operator, system = natsjwt.new_key("operator"), natsjwt.new_key("account")
    limits = natsjwt.decode(natsjwt.account_jwt(operator, system, "SYS", jetstream=False), operator)
    assert "disk_storage" not in limits["nats"]["limits"]
    assert "mem_storage" not in limits["nats"]["limits"]


def test_a_jwt_signed_by_another_key_or_changed_is_refused() -> None:
    operator, other = natsjwt.new_key("operator"), natsjwt.new_key("operator")
    token = natsjwt.operator_jwt(operator, "gpuops", natsjwt.new_key("account"))
    with pytest.raises(BusError, match="not signed by"):
        natsjwt.decode(token, other)
    head, body, sig = token.split(".")
    forged = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    forged["name"] = "mallory"
    body = base64.urlsafe_b64encode(json.dumps(forged).encode()).rstrip(b"=").decode()
    with pytest.raises(BusError, match="not signed by"):
        natsjwt.decode(f"{head}.{body}.{sig}", operator)


def test_a_user_carries_its_role_permissions() -> None:
    account, user = natsjwt.new_key("account"), natsjwt.new_key("user")
    perms = permissions_of("cli", "alice")
    nats = natsjwt.decode(natsjwt.user_jwt(account, user, "alice", perms), account)["nats"]
    assert nats["pub"] == {"allow": list(perms.publish), "deny": list(perms.deny_publish)}
    assert nats["sub"] == {"allow": list(perms.subscribe)}
    assert nats["resp"] == {"max": 1, "ttl": 0}  # may answer requests sent to it
    assert (nats["subs"], nats["data"], nats["payload"]) == (-1, -1, -1)


def test_a_scoped_user_has_only_a_name_and_the_scope_the_templates() -> None:
    operator, account = natsjwt.new_key("operator"), natsjwt.new_key("account")
    scope = natsjwt.Scope("node", natsjwt.new_key("account"), node_permissions(subjects.USER_NAME))
    user = natsjwt.new_key("user")
    claims = natsjwt.decode(natsjwt.scoped_user_jwt(scope, account, user, "node-a"), scope.key)
    # nats-server refuses a scoped user with permissions or limits of its own.
    assert claims["nats"] == {"type": "user", "issuer_account": account.public, "version": 2}
    assert claims["name"] == "node-a"
    account_claims = natsjwt.decode(
        natsjwt.account_jwt(operator, account, "GPUOPS", jetstream=True, scopes=(scope,)), operator
    )
    (signing_key,) = account_claims["nats"]["signing_keys"]
    assert signing_key["kind"] == "user_scope" and signing_key["key"] == scope.key.public
    assert signing_key["template"]["pub"]["allow"] == [
        "gpuops.telemetry.{{name()}}",
        "gpuops.events.*.{{name()}}",
    ]
    assert signing_key["template"]["sub"] == {
        "allow": ["gpuops.agent.{{name()}}.>", "_INBOX.node.{{name()}}.>"]
    }


def test_creds_hold_the_jwt_and_give_back_the_seed() -> None:
    account, user = natsjwt.new_key("account"), natsjwt.new_key("user")
    token = natsjwt.user_jwt(account, user, "engine", permissions_of("engine", "engine"))
    text = natsjwt.creds(token, user)
    lines = text.splitlines()
    # nats clients read the line after each BEGIN marker.
    assert lines[lines.index("-----BEGIN NATS USER JWT-----") + 1] == token
    assert lines[lines.index("-----BEGIN USER NKEY SEED-----") + 1] == user.seed
    assert natsjwt.creds_seed(text) == user
    with pytest.raises(BusError, match="no user seed"):
        natsjwt.creds_seed(token)


def test_a_seed_of_another_kind_or_no_seed_is_refused() -> None:
    account = natsjwt.new_key("account")
    assert natsjwt.key_from_seed("account", account.seed + "\n") == account
    with pytest.raises(BusError, match="another kind"):
        natsjwt.key_from_seed("operator", account.seed)
    with pytest.raises(BusError, match="not an nkey seed"):
        natsjwt.key_from_seed("user", "SUNOTASEED")
