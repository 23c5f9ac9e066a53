"""A real Redfish BMC on loopback: OpenStack's sushy-tools emulator (`sushy-emulator`).

Its fake driver serves one computer system and the manager sushy derives from it, with
that manager's virtual media; the state lives in a sqlite directory of this peer's own
(sushy's default is one shared /tmp directory). It speaks HTTPS with a server certificate
from a CA made for this peer alone, so the playbooks validate it (bmc_ca_path) rather than
turning validation off, and wants HTTP basic auth from an htpasswd file (sushy accepts
bcrypt digests only; bcrypt comes with sushy-tools).

Like hardware, the fake driver applies a power change one to eleven seconds after it was
asked, and only when the system is read again. sushy fetches a virtual media image when it
is inserted, so the peer also serves one over plain HTTP (`Bmc.image_url`).

Command line, for molecule: `python -m tests.peers.redfish up DIR` starts the emulator and
writes DIR/peer.json (address, user, password, ca, image_url, pids); `down DIR` stops it.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import importlib.util
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import free_port

USER = "gpuops"
PASSWORD = "Zq81-redfish-right"
SYSTEM_UUID = "6f2d1c3e-27a9-4b8e-9d41-0a5e3b7c9f10"
SYSTEM_NAME = "node-001"
IMAGE = "installer.iso"
FORMER_IMAGE = "former-installer.iso"  # one a former reinstall left in the CD
START_S = 30.0


class PeerMissing(RuntimeError):
    """sushy-tools is not installed here (the fixture skips, saying so)."""


def missing() -> str | None:
    """Why the emulator cannot start here; None when it can."""
    for module in ("sushy_tools", "bcrypt", "cryptography"):
        if importlib.util.find_spec(module) is None:
            return f"sushy-tools is not installed (the venv's dev extras install it; {module})"
    return None


@dataclass(frozen=True, slots=True)
class Bmc:
    """A running emulator: where it listens, who may log in, and what it reports."""

    root: Path
    port: int
    image_port: int
    user: str = USER
    password: str = PASSWORD

    @property
    def address(self) -> str:
        """`host:port`, as the inventory's bmc_address names it."""
        return f"127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        """The CA certificate that signed the emulator's own (bmc_ca_path)."""
        return self.root / "ca.pem"

    @property
    def image_url(self) -> str:
        """A virtual media image the emulator can fetch (bmc_media_image)."""
        return self.url_of(IMAGE)

    def url_of(self, image: str) -> str:
        """Where the peer serves `image` (IMAGE or FORMER_IMAGE)."""
        return f"http://127.0.0.1:{self.image_port}/{image}"

    def get(self, path: str) -> dict[str, Any]:
        """GET a Redfish resource with the right credentials, validated against the CA."""
        with self._open(urllib.request.Request(f"https://{self.address}{path}")) as answer:
            body: dict[str, Any] = json.load(answer)
        return body

    def post(self, path: str, body: dict[str, Any]) -> None:
        """POST a Redfish action's body (as a person at the BMC's console would)."""
        request = urllib.request.Request(
            f"https://{self.address}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        self._open(request).close()

    def _open(self, request: urllib.request.Request) -> Any:
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
        context = ssl.create_default_context(cafile=str(self.ca))
        return urllib.request.urlopen(request, context=context, timeout=10)

    def system(self) -> dict[str, Any]:
        """The one computer system, as the emulator reports it now."""
        return self.get(f"/redfish/v1/Systems/{SYSTEM_UUID}")

    def power_state(self) -> str:
        """`On` or `Off` (reading also applies a power change that is due)."""
        return str(self.system()["PowerState"])

    def boot(self) -> dict[str, Any]:
        """The system's `Boot` (BootSourceOverrideTarget, BootSourceOverrideEnabled)."""
        boot: dict[str, Any] = self.system()["Boot"]
        return boot

    def cd(self) -> dict[str, Any]:
        """The virtual CD (Image, Inserted), found through the manager as a client finds it."""
        manager = self.get(f"/redfish/v1/Managers/{SYSTEM_UUID}")
        return self.get(manager["VirtualMedia"]["@odata.id"] + "/Cd")

    def insert(self, image_url: str) -> None:
        """Put an image in the virtual CD, bypassing the playbooks."""
        self.post(self.cd()["Actions"]["#VirtualMedia.InsertMedia"]["target"], {"Image": image_url})

    def log(self) -> str:
        """The emulator's own log: what it was asked, for a failure's message."""
        return (self.root / "emulator.log").read_text(errors="replace")


def _name(common: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _certificates(root: Path) -> None:
    """ca.pem, and server.pem/server.key for 127.0.0.1 signed by it (valid one day)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def build(subject: str, public: Any, issuer: str) -> Any:
        return (
            x509.CertificateBuilder()
            .subject_name(_name(subject))
            .issuer_name(_name(issuer))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    ca = (
        build("gpuops test BMC CA", ca_key.public_key(), "gpuops test BMC CA")
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server = (
        build("127.0.0.1", key.public_key(), "gpuops test BMC CA")
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (root / "ca.pem").write_bytes(ca.public_bytes(pem))
    (root / "server.pem").write_bytes(server.public_bytes(pem))
    (root / "server.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (root / "server.key").chmod(0o600)


def _htpasswd(root: Path, user: str, password: str) -> Path:
    import bcrypt

    path = root / "htpasswd"
    digest = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    path.write_text(f"{user}:{digest}\n")
    path.chmod(0o600)
    return path


def _config(root: Path, port: int, auth: Path, power: str) -> Path:
    """sushy's config, a Python file of SUSHY_EMULATOR_* settings."""
    system = {
        "uuid": SYSTEM_UUID,
        "name": SYSTEM_NAME,
        "power_state": power,
        "external_notifier": False,
        "nics": [{"mac": "00:5c:52:31:3a:9c", "ip": "127.0.0.1"}],
    }
    settings = {
        "SUSHY_EMULATOR_LISTEN_IP": "127.0.0.1",
        "SUSHY_EMULATOR_LISTEN_PORT": port,
        "SUSHY_EMULATOR_SSL_CERT": str(root / "server.pem"),
        "SUSHY_EMULATOR_SSL_KEY": str(root / "server.key"),
        "SUSHY_EMULATOR_AUTH_FILE": str(auth),
        "SUSHY_EMULATOR_FAKE_DRIVER": True,
        "SUSHY_EMULATOR_FAKE_SYSTEMS": [system],
        "SUSHY_EMULATOR_STATE_DIR": str(root / "state"),
    }
    path = root / "emulator.conf"
    path.write_text("".join(f"{key} = {value!r}\n" for key, value in settings.items()))
    return path


def _spawn(root: Path, name: str, argv: list[str]) -> None:
    """A child in its own session, its output in NAME.log, its pid in NAME.pid."""
    with (root / f"{name}.log").open("w") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    (root / f"{name}.pid").write_text(str(proc.pid))


def _wait(bmc: Bmc) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
            bmc.system()
            return
        time.sleep(0.2)
    raise RuntimeError(f"sushy-emulator did not answer within {START_S:.0f}s:\n{bmc.log()}")


def start(root: Path, power: str = "On") -> Bmc:
    """The emulator (its system's power `On` or `Off`) and the image server, both answering;
    raises PeerMissing here."""
    why = missing()
    if why is not None:
        raise PeerMissing(why)
    (root / "images").mkdir(parents=True, exist_ok=True)
    for image in (IMAGE, FORMER_IMAGE):
        (root / "images" / image).write_bytes(f"gpuops test image {image}\n".encode() * 64)
    _certificates(root)
    bmc = Bmc(root, free_port(), free_port())
    config = _config(root, bmc.port, _htpasswd(root, bmc.user, bmc.password), power)
    _spawn(
        root,
        "emulator",
        [sys.executable, "-m", "sushy_tools.emulator.main", "--config", str(config)],
    )
    _spawn(
        root,
        "images",
        [sys.executable, "-m", "http.server", str(bmc.image_port), "--bind", "127.0.0.1",
         "--directory", str(root / "images")],
    )  # fmt: skip
    _wait(bmc)
    return bmc


def stop(root: Path) -> None:
    """The emulator and the image server started in `root`, by their pid files."""
    for name in ("emulator", "images"):
        _kill(root / f"{name}.pid")


def _kill(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _gone(pid):
            time.sleep(0.1)
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)


def _gone(pid: int) -> bool:
    """Whether `pid` ended; our own child (the context manager's) is reaped, since a
    zombie still answers kill(pid, 0)."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextlib.contextmanager
def redfish_bmc(root: Path, power: str = "On") -> Iterator[Bmc]:
    """An emulated BMC for the `with` block; stopped after, even when the block failed."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        bmc = start(root, power)
    except BaseException:
        stop(root)
        raise
    try:
        yield bmc
    finally:
        stop(root)


def main(argv: list[str]) -> int:
    """`up DIR` or `down DIR`."""
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: python -m tests.peers.redfish up|down DIR", file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    if argv[0] == "down":
        stop(root)
        return 0
    root.mkdir(parents=True, exist_ok=True)
    try:
        bmc = start(root)
    except PeerMissing as exc:
        print(exc, file=sys.stderr)
        return 3
    peer = {
        "address": bmc.address,
        "port": bmc.port,
        "user": bmc.user,
        "password": bmc.password,
        "ca": str(bmc.ca),
        "image_url": bmc.image_url,
        "system_id": SYSTEM_UUID,
        "pids": {n: int((root / f"{n}.pid").read_text()) for n in ("emulator", "images")},
    }
    (root / "peer.json").write_text(json.dumps(peer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
