"""One error tree for everything gpuops raises on purpose.

    EngineError
     +-- ConfigError          settings, inventory or paths are wrong
     +-- RuleError            a rule file is invalid (file, line, rule)
     |    +-- RuleSetError    several RuleErrors found in one load
     +-- EventError           an event could not be decoded or validated (reason)
     +-- BusError             NATS could not be reached, started or configured
     |    +-- Contended       a record's compare-and-set lost every try
     +-- StateUnreadable      a stored record does not decode (bucket, key): fail closed
     +-- ActionError          a playbook could not be prepared or run (playbook, node)
     +-- SourceError          a telemetry source answered nothing usable (target, reason)
     +-- DiagnosticsError     a diagnostic tool's output is not what it prints (tool)

Third-party errors are translated at the boundary with ``raise ... from exc`` so a
caller only ever needs to catch ``EngineError``.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error gpuops raises on purpose."""


class ConfigError(EngineError):
    """Settings, inventory or paths are wrong; the message says which and what to do."""


class RuleError(EngineError):
    """A rule is invalid: carries the file, line and rule name for `file:line: rule N: msg`."""

    def __init__(self, message: str, *, file: str = "", line: int = 0, rule: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.line = line
        self.rule = rule

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.file else "<rules>"
        who = f" rule {self.rule}:" if self.rule else ""
        return f"{where}:{who} {self.message}"


class RuleSetError(RuleError):
    """Every error found while loading a rule set, reported together."""

    def __init__(self, errors: list[RuleError]) -> None:
        super().__init__("\n".join(str(e) for e in errors))
        self.errors = errors

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


class EventError(EngineError):
    """An event failed decoding or validation; `reason` becomes the dead-letter subject token."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class BusError(EngineError):
    """NATS could not be reached, started or configured."""


class Contended(BusError):
    """Other writers won every compare-and-set on one record. Never read as "nothing to
    change": the write did not happen, so the caller's work is given back (the event is
    not acked, the run's outcome not recorded) and done again."""

    def __init__(self, key: str, tries: int) -> None:
        super().__init__(f"{key}: another writer won all {tries} compare-and-sets")
        self.key = key
        self.tries = tries


class LeaseLost(BusError):
    """This replica no longer owns the node's partition: another one decides for it now."""


class ConsumerGone(LeaseLost):
    """The partition's consumer this replica made is gone: another replica took it over."""


# The start of an unreadable value kept with its error (for the log and the repair).
RAW_KEPT = 512


class StateUnreadable(EngineError):
    """A record in a KV bucket is there but does not decode as what it should be.

    Never read as "absent": a garbage cooldown read so would let a second remediation
    through, a garbage breaker would reopen. What reads it fails closed (gpuops.decide.
    stage drops the proposal as `state_unreadable`) until a person repairs the record
    (`gpuops state repair BUCKET KEY`).
    """

    def __init__(self, bucket: str, key: str, detail: str, raw: bytes = b"") -> None:
        super().__init__(f"{bucket or 'bucket'}/{key} is unreadable ({detail})")
        self.bucket = bucket
        self.key = key
        self.detail = detail
        self.raw = raw[:RAW_KEPT]


class ActionError(EngineError):
    """A playbook could not be prepared or run."""

    def __init__(self, message: str, *, playbook: str = "", node: str = "") -> None:
        super().__init__(message)
        self.playbook = playbook
        self.node = node


class SourceError(EngineError):
    """A scrape target was down, slow, too large or not what it should be; `reason` is the
    metric label (down, timeout, too_large, http_status, garbage)."""

    def __init__(self, reason: str, message: str, *, target: str = "") -> None:
        super().__init__(f"{target}: {message}" if target else message)
        self.reason = reason
        self.target = target


class DiagnosticsError(EngineError):
    """A diagnostic tool's output could not be read: empty, truncated or another format.

    Never read as a pass or a fail of the node: a run that printed nothing usable says
    nothing about the hardware, so the caller reruns it or asks a person.
    """

    def __init__(self, tool: str, message: str) -> None:
        super().__init__(f"{tool}: {message}")
        self.tool = tool
        self.message = message
