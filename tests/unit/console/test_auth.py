"""Console logins: tokens, signed session cookies, a proxy's header only with its secret."""

from __future__ import annotations

from aiohttp.test_utils import make_mocked_request
from gpuops.clock import SystemClock
from gpuops.console.auth import COOKIE, Auth, Via, anonymous_read, is_loopback
from gpuops.settings import ConsoleSettings
from prometheus_client import CollectorRegistry

TOKEN = "a-secret-token-0123456789abcdef"
PROXY_SECRET = "the-proxy-secret-0123456789abcdef"
SETTINGS = ConsoleSettings.model_validate(
    {
        "tokens": [{"user": "alice", "token": TOKEN}],
        "user_header": "X-Forwarded-User",
        "proxy_secret": PROXY_SECRET,
        "trusted_proxies": ["10.0.0.5"],
    }
)


def _auth(settings: ConsoleSettings = SETTINGS) -> Auth:
    return Auth(settings, SystemClock(), CollectorRegistry())


def _request(headers: dict[str, str], peer: str = "10.0.0.9") -> object:
    request = make_mocked_request("GET", "/console/now", headers=headers)
    request._transport_peername = (peer, 5555)  # type: ignore[attr-defined]
    return request


def test_a_session_cookie_names_its_user_and_a_changed_one_names_nobody() -> None:
    auth = _auth()
    cookie = auth.session_cookie("alice")
    viewer = auth.viewer(_request({"Cookie": f"{COOKIE}={cookie}"}))  # type: ignore[arg-type]
    assert (viewer.user, viewer.via) == ("alice", Via.SESSION)
    forged = cookie.replace("alice", "admin", 1)
    assert not auth.viewer(_request({"Cookie": f"{COOKIE}={forged}"})).known  # type: ignore[arg-type]
    expired = auth.session_cookie("alice", now=0.0)
    assert not auth.viewer(_request({"Cookie": f"{COOKIE}={expired}"})).known  # type: ignore[arg-type]
    # Another process's key (a restart) signs differently: everyone logs in again.
    assert not _auth().viewer(_request({"Cookie": f"{COOKIE}={cookie}"})).known  # type: ignore[arg-type]


def test_the_proxy_header_is_believed_only_with_the_secret_from_the_proxy() -> None:
    auth = _auth()
    header = {"X-Forwarded-User": "carol", "X-Gpuops-Proxy-Secret": PROXY_SECRET}
    assert auth.viewer(_request(header, peer="10.0.0.5")).user == "carol"  # type: ignore[arg-type]
    assert not auth.viewer(_request(header, peer="10.0.0.9")).known  # type: ignore[arg-type]
    bare = {"X-Forwarded-User": "carol"}
    assert not auth.viewer(_request(bare, peer="10.0.0.5")).known  # type: ignore[arg-type]


def test_anonymous_read_is_for_loopback_binds_unless_a_site_says_otherwise() -> None:
    assert [is_loopback(b) for b in ("127.0.0.1:8080", ":0", "[::1]:80", "localhost:1")] == [
        True
    ] * 4
    assert not any(is_loopback(b) for b in ("0.0.0.0:8080", "[::]:80", "10.1.2.3:80", "gpu:1"))
    default = ConsoleSettings()
    assert anonymous_read(default, "127.0.0.1:8080") and not anonymous_read(default, "0.0.0.0:1")
    always = ConsoleSettings(anonymous_read="always")
    assert anonymous_read(always, "0.0.0.0:8080")
    assert not anonymous_read(ConsoleSettings(anonymous_read="never"), "127.0.0.1:8080")
    assert not anonymous_read(ConsoleSettings(login_required=True), "127.0.0.1:8080")


def test_bearer_tokens_and_their_bounds() -> None:
    auth = _auth()
    assert auth.user_for_token(TOKEN) == "alice"
    assert auth.user_for_token(TOKEN[:-1] + "X") is None
    assert auth.user_for_token("x" * 10_000) is None
    viewer = auth.viewer(_request({"Authorization": f"Bearer {TOKEN}"}))  # type: ignore[arg-type]
    assert (viewer.user, viewer.via) == ("alice", Via.BEARER)
