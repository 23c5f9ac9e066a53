"""NATS JWTs (version 2) and `.creds` files, signed with nkeys, as `nsc` writes them.

A site's own NATS in operator mode trusts a chain of keys: the operator signs itself and
each account; an account signs its users. A JWT is

    base64url(header) . base64url(claims) . base64url(ed25519 signature of the first two)

without padding, `iss` the signer's public key, `sub` the key it is about, and `nats`
the claims of its type. nats-server checks every signature of the chain when a user
connects; a user proves it holds its seed by signing the server's nonce.

An account may also hand a *scoped* signing key a role: the key's users carry no
permissions of their own, and the server gives them the scope's template, with subject
templates such as `{{name()}}` filled in from each user's JWT. nats-server fills in
templates only there, never in a user's own permissions.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

import nkeys

from gpuops.bus.auth import Permissions
from gpuops.errors import BusError

Kind = Literal["operator", "account", "user"]
HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
NO_LIMIT = -1
_PREFIX = {
    "operator": nkeys.PREFIX_BYTE_OPERATOR,
    "account": nkeys.PREFIX_BYTE_ACCOUNT,
    "user": nkeys.PREFIX_BYTE_USER,
}
# What a public key of each kind starts with (O..., A..., U...): a seed of the wrong
# kind would sign JWTs that nats-server refuses with no word on why.
_LETTER = {"operator": "O", "account": "A", "user": "U"}


@dataclass(frozen=True, slots=True)
class Key:
    """One nkey: its seed (the secret) and the public key others know it by."""

    kind: Kind
    seed: str

    @property
    def public(self) -> str:
        """The public key (`O...`, `A...` or `U...`)."""
        return str(self._pair().public_key.decode())

    def sign(self, data: bytes) -> bytes:
        """An ed25519 signature of `data` by this key."""
        return bytes(self._pair().sign(data))

    def verify(self, data: bytes, signature: bytes) -> bool:
        """Whether `signature` is this key's over `data`."""
        try:
            return bool(self._pair().verify(data, signature))
        except nkeys.ErrInvalidSignature:
            return False

    def _pair(self) -> Any:
        return nkeys.from_seed(bytearray(self.seed.encode()))


def new_key(kind: Kind) -> Key:
    """A fresh random key of `kind`."""
    seed = nkeys.encode_seed(secrets.token_bytes(32), _PREFIX[kind])
    return Key(kind, seed.decode())


def key_from_seed(kind: Kind, seed: str) -> Key:
    """A key from its seed; BusError when the seed is not one, or of another kind."""
    key = Key(kind, seed.strip())
    try:
        public = key.public
    except (nkeys.NkeysError, ValueError) as exc:
        raise BusError(f"not an nkey seed of a NATS {kind} ({exc!r})") from exc
    if not public.startswith(_LETTER[kind]):
        raise BusError(f"the seed is a key of another kind ({public[0]}...), not a NATS {kind}")
    return key


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _jti(claims: dict[str, Any]) -> str:
    """The JWT's id, as nats-io/jwt makes it: base32 SHA-512/256 of the standard claims."""
    digest = hashlib.new("sha512_256", _dumps(claims)).digest()
    return base64.b32encode(digest).rstrip(b"=").decode()


def encode(
    issuer: Key, subject: str, name: str, nats: dict[str, Any], *, now: int | None = None
) -> str:
    """A JWT about `subject`, signed by `issuer`; `nats` holds `type` and its claims."""
    claims: dict[str, Any] = {
        "iat": int(time.time()) if now is None else now,
        "iss": issuer.public,
        "name": name,
        "sub": subject,
    }
    claims = {"jti": _jti(claims), **claims, "nats": {**nats, "version": 2}}
    signed = f"{_b64(_dumps(HEADER))}.{_b64(_dumps(claims))}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def decode(token: str, issuer: Key) -> dict[str, Any]:
    """The claims of a JWT `issuer` signed; BusError for any other token."""
    try:
        head, body, signature = token.split(".")
        header, claims = json.loads(_unb64(head)), json.loads(_unb64(body))
        signed = issuer.verify(f"{head}.{body}".encode(), _unb64(signature))
    except ValueError as exc:
        raise BusError(f"not a NATS JWT ({exc})") from exc
    if header != HEADER or not signed or claims.get("iss") != issuer.public:
        raise BusError(f"the JWT {claims.get('name')!r} is not signed by {issuer.public}")
    return dict(claims)


def operator_jwt(operator: Key, name: str, system_account: Key) -> str:
    """The operator's self-signed JWT, naming the account the server uses for itself."""
    nats = {"type": "operator", "system_account": system_account.public}
    return encode(operator, operator.public, name, nats)


def account_limits(*, jetstream: bool) -> dict[str, Any]:
    """No limit on anything; JetStream on (unlimited storage) or off (none)."""
    limits: dict[str, Any] = {"subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT}
    limits |= {"imports": NO_LIMIT, "exports": NO_LIMIT, "wildcards": True}
    limits |= {"conn": NO_LIMIT, "leaf": NO_LIMIT}
    if jetstream:  # nats-server enables JetStream for an account whose storage is not 0
        limits |= {"mem_storage": NO_LIMIT, "disk_storage": NO_LIMIT}
        limits |= {"streams": NO_LIMIT, "consumer": NO_LIMIT}
    return limits


@dataclass(frozen=True, slots=True)
class Scope:
    """A signing key of an account for one role: every user it signs gets `perms`."""

    role: str
    key: Key
    perms: Permissions


def user_limits(perms: Permissions) -> dict[str, Any]:
    """What a user may publish and subscribe, with no limit on subscriptions or bytes."""
    pub: dict[str, list[str]] = {"allow": list(perms.publish)}
    if perms.deny_publish:
        pub["deny"] = list(perms.deny_publish)
    out: dict[str, Any] = {"pub": pub, "sub": {"allow": list(perms.subscribe)}}
    if perms.allow_responses:  # one reply per request, as `allow_responses: true` allows
        out["resp"] = {"max": 1, "ttl": 0}
    return out | {"subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT}


def account_jwt(
    operator: Key, account: Key, name: str, *, jetstream: bool, scopes: tuple[Scope, ...] = ()
) -> str:
    """An account's JWT, signed by the operator, with its scoped signing keys."""
    nats: dict[str, Any] = {
        "type": "account",
        "limits": account_limits(jetstream=jetstream),
        "default_permissions": {"pub": {}, "sub": {}},
    }
    if scopes:
        nats["signing_keys"] = [
            {
                "kind": "user_scope",
                "key": s.key.public,
                "role": s.role,
                "template": user_limits(s.perms),
            }
            for s in scopes
        ]
    return encode(operator, account.public, name, nats)


def user_jwt(account: Key, user: Key, name: str, perms: Permissions) -> str:
    """A user's JWT, signed by its account, with what it may publish and subscribe."""
    return encode(account, user.public, name, {"type": "user", **user_limits(perms)})


def scoped_user_jwt(scope: Scope, account: Key, user: Key, name: str) -> str:
    """A user's JWT signed by a scoped key: no permissions of its own (the server refuses
    any), the scope's template filled in with `name`."""
    return encode(scope.key, user.public, name, {"type": "user", "issuer_account": account.public})


def creds(token: str, user: Key) -> str:
    """A `.creds` file: the user's JWT and seed, in the layout nats clients read."""
    return (
        f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user.seed}\n------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


def creds_seed(text: str) -> Key:
    """The user key of a `.creds` file (to issue its user a new JWT with the same key)."""
    lines = text.splitlines()
    for at, line in enumerate(lines[:-1]):
        if "BEGIN USER NKEY SEED" in line:
            return key_from_seed("user", lines[at + 1])
    raise BusError("not a NATS creds file: it holds no user seed")


def creds_name(text: str) -> str:
    """The user name a `.creds` file's JWT gives its user (the server names the user so
    in subject templates; an operator's command subject and inbox carry it)."""
    lines = text.splitlines()
    for at, line in enumerate(lines[:-1]):
        if "BEGIN NATS USER JWT" in line:
            try:
                body = lines[at + 1].split(".")[1]
                claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
                return str(claims["name"])
            except (IndexError, ValueError, KeyError, TypeError) as exc:
                raise BusError(f"not a NATS creds file: its JWT does not read ({exc})") from None
    raise BusError("not a NATS creds file: it holds no user JWT")
