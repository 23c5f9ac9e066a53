"""Who published a message, proved per message: each publisher's key, the engine's check.

Every publisher of telemetry and health events has an identity: a node's agent is
`node:<its subject token>` (`node:node-001`), a source is `source:<name>` (the
Prometheus source: `source:prometheus`), the engine is `engine`. It signs each message with a key
of its own, HMAC-SHA256 over the payload, sent in two headers:

    Gpuops-Publisher: node:node-001
    Gpuops-Mac: 64 hex characters

A publisher's key is derived from the engine's identity key and the identity's name
(HMAC(identity key, name)), so the engine checks any publisher without a table of keys,
and a node holding its own key can sign for nobody else. The engine refuses, as
`forged`, a message without a valid MAC or whose publisher may not speak for the node
and kind its subject names: a node speaks for itself only, a source for any node, and
the kinds only the engine makes (ChatOps commands, drift reports, alerts) only the
engine may publish. This holds whatever the NATS server's permissions are (a site's
NATS with one shared agent user included); the per-node NATS users are the first wall,
this is the second, and the one that records who spoke.

HMAC rather than a signature per message: the engine checks every sample of the fleet
(tens of thousands a second), and an HMAC costs about a microsecond where an ed25519
verification costs fifty. Each key's HMAC is prepared once (its padded key hashed) and
copied per message: OpenSSL 3's one-shot HMAC looks the digest up and hashes the key
again on every call, a third of the cost of a node's 1 KB sample.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpuops import subjects
from gpuops.errors import ConfigError, EventError
from gpuops.signing import replace_private

PUBLISHER = "Gpuops-Publisher"
MAC = "Gpuops-Mac"
ENGINE = "engine"
SOURCE = "source:"
# Kinds only the engine publishes: its ChatOps receiver, its drift check, its
# Alertmanager receiver. From anyone else they would be decided as a person's, the
# baseline's or Alertmanager's word.
ENGINE_ONLY_KINDS = frozenset({"chatops", "drift", "alert", "diagnostics"})
# The executor tells what its runs measured (a grade's result, the gate's) and nothing
# else: it may not speak as a person, a source or a node.
EXECUTOR = "executor"
EXECUTOR_KINDS = frozenset({"diagnostics"})
# Kinds only one source makes, and that source makes nothing else: a facility reading is
# the building's word (Redfish), a DRA taint the cluster's (the DRA driver's slices); from
# a node, or from another source, they would be a forgery of that word (a node faking a
# taint on itself would fence and reset its own GPU).
SOURCE_KINDS = {"source:redfish": frozenset({"facility"}), "source:dra": frozenset({"dra_taint"})}
SOURCED_KINDS = {kind: who for who, kinds in SOURCE_KINDS.items() for kind in kinds}
_MAX_NAME = 128


def source(name: str) -> str:
    """The identity of a source (`source:prometheus`)."""
    return SOURCE + subjects.token(name)


NODE = "node:"


def node_identity(node: str) -> str:
    """The identity of a node's agent (`node:node-001`): a name no source or engine
    shares, whatever the node is called (a host named `engine` is still a node)."""
    return NODE + subjects.token(node)


def derive(identity_key: bytes, identity: str) -> bytes:
    """A publisher's own key: what the engine gives it, and checks it by."""
    return hmac.new(
        identity_key, b"gpuops-publisher\0" + identity.encode(), hashlib.sha256
    ).digest()


def prepared(key: bytes) -> hmac.HMAC:
    """HMAC-SHA256 with `key`, ready for `mac`."""
    return hmac.new(key, digestmod=hashlib.sha256)


def mac(keyed: hmac.HMAC, payload: bytes) -> str:
    """The hex HMAC of `payload` under a `prepared` key (the prepared one is not changed)."""
    one = keyed.copy()
    one.update(payload)
    return one.hexdigest()


@dataclass(frozen=True, slots=True)
class Signer:
    """A publisher's identity and key: the headers that prove a payload is its."""

    identity: str
    key: bytes = field(repr=False)
    keyed: hmac.HMAC = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keyed", prepared(self.key))

    def headers(self, payload: bytes, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The publisher and MAC headers for `payload` (plus `extra`, e.g. Nats-Msg-Id)."""
        return {**(extra or {}), PUBLISHER: self.identity, MAC: mac(self.keyed, payload)}


def may_speak(identity: str, kind: str, node_token: str) -> str | None:
    """None if `identity` may publish `kind` about the node, else why not."""
    if identity == ENGINE:
        return None
    if identity == EXECUTOR:
        return None if kind in EXECUTOR_KINDS else f"the executor may not publish {kind} events"
    if kind in ENGINE_ONLY_KINDS:
        return f"{identity} may not publish {kind} events (only the engine makes them)"
    if identity in SOURCE_KINDS and kind not in SOURCE_KINDS[identity]:
        makes = ", ".join(sorted(SOURCE_KINDS[identity]))
        return f"{identity} may not publish {kind} events (it makes {makes})"
    if kind in SOURCED_KINDS and identity != SOURCED_KINDS[kind]:
        return f"{identity} may not publish {kind} events (only {SOURCED_KINDS[kind]} makes them)"
    if identity.startswith(SOURCE):
        # A probe is a node's answer about itself (its validation): nobody else's.
        return f"{identity} may not publish probe results" if kind == "probe" else None
    if identity != NODE + node_token:
        return f"{identity} may not speak for node {node_token}"
    return None


class KeyRing:
    """Every publisher's key, derived from the identity key on first use and kept.

    The engine's (it checks everyone, and signs what it publishes itself) and a
    simulator's or a benchmark's, which publish as many nodes at once.
    """

    def __init__(self, identity_key: bytes) -> None:
        self.root = identity_key
        self._signers: dict[str, Signer] = {}  # each derived key, its HMAC prepared

    def key(self, identity: str) -> bytes:
        """The identity's key."""
        return self.signer(identity).key

    def known(self, identity: str) -> Signer | None:
        """The identity's signer if its key was derived and kept before."""
        return self._signers.get(identity)

    def keep(self, signer: Signer) -> None:
        """Remember a derived key (bounded: one per publisher of the fleet, in practice)."""
        if len(self._signers) > 1_000_000:
            self._signers.clear()
        self._signers[signer.identity] = signer

    def signer(self, identity: str) -> Signer:
        """The identity's signer."""
        signer = self._signers.get(identity)
        if signer is None:
            signer = Signer(identity, derive(self.root, identity))
            self.keep(signer)
        return signer

    def node(self, node: str) -> Signer:
        """A node's agent's signer."""
        return self.signer(node_identity(node))


class Verifier:
    """The engine's check of a message's publisher."""

    def __init__(self, keys: KeyRing, *, required: bool = True) -> None:
        self.keys = keys
        self.required = required

    def publisher(
        self, headers: Mapping[str, str] | None, payload: bytes, kind: str, node_token: str
    ) -> str:
        """Who published `payload` about `kind`/`node_token`; EventError("forged") if
        the MAC is wrong or missing, or the publisher may not speak for the node."""
        name = (headers or {}).get(PUBLISHER, "")
        given = (headers or {}).get(MAC, "")
        if not name and not given and not self.required:
            return "unsigned"
        if not name or not given or len(name) > _MAX_NAME:
            raise EventError("forged", "no publisher identity (Gpuops-Publisher, Gpuops-Mac)")
        signer = self.keys.known(name)
        kept = signer is not None
        if signer is None:
            signer = Signer(name, derive(self.keys.root, name))
        want = mac(signer.keyed, payload)
        if not hmac.compare_digest(want.encode(), given.encode("ascii", "replace")):
            raise EventError("forged", f"the MAC is not {name!r}'s")
        if not kept:  # only names whose key signed: no cache for made-up ones
            self.keys.keep(signer)
        refused = may_speak(name, kind, node_token)
        if refused is not None:
            raise EventError("forged", refused)
        return name


def key_file_of(folder: Path, identity: str) -> Path:
    """Where a publisher's key is kept under a state dir's `creds/publishers`."""
    return folder / f"{subjects.token(identity.replace(':', '-'))}.key"


def write_key(path: Path, key: bytes) -> None:
    """Write a publisher's key (hex, 0600) unless it is there with the same value."""
    text = key.hex()
    if path.exists() and path.read_text().strip() == text:
        return
    replace_private(path, text)


def read_signer(path: Path, identity: str) -> Signer:
    """A publisher's signer from its key file; a ConfigError says what to do."""
    try:
        key = bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        raise ConfigError(
            f"no publisher key for {identity!r} at {path}: the engine writes one for each "
            "inventory node on its state dir; for a site's NATS run "
            f"`gpuops identity issue {identity}` where the engine's identity key is"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"publisher key {path} for {identity!r} is unreadable: {exc}") from exc
    if len(key) != 32:
        raise ConfigError(f"publisher key {path} for {identity!r}: want 64 hex characters")
    return Signer(identity, key)
