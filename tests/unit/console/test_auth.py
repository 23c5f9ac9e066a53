"""Console logins: tokens, signed session cookies, a proxy's header only from the proxy."""

from __future__ import annotations

from aiohttp.test_utils import make_mocked_request
from gpuops.console.auth import COOKIE, Auth, Via
from gpuops.settings import ConsoleSettings

SETTINGS = ConsoleSettings.model_validate(
    {
        "tokens": [{"user": "alice", "token": "a-secret-token"}],
        "user_header": "X-Forwarded-User",
        "trusted_proxies": ["10.0.0.5"],
    }
)


def _request(headers: dict[str, str], peer: str = "10.0.0.9") -> object:
    request = make_mocked_request("GET", "/console/now", headers=headers)
    request._transport_peername = (peer, 5555)  # type: ignore[attr-defined]
    return request


def test_a_session_cookie_names_its_user_and_a_changed_one_names_nobody() -> None:
    auth = Auth(SETTINGS)
    cookie = auth.session_cookie("alice")
    viewer = auth.viewer(_request({"Cookie": f"{COOKIE}={cookie}"}))  # type: ignore[arg-type]
    assert (viewer.user, viewer.via) == ("alice", Via.SESSION)
    forged = cookie.replace("alice", "admin", 1)
    assert not auth.viewer(_request({"Cookie": f"{COOKIE}={forged}"})).known  # type: ignore[arg-type]
    expired = auth.session_cookie("alice", now=0.0)
    assert not auth.viewer(_request({"Cookie": f"{COOKIE}={expired}"})).known  # type: ignore[arg-type]
    # Another process's key (a restart) signs differently: everyone logs in again.
    assert not Auth(SETTINGS).viewer(_request({"Cookie": f"{COOKIE}={cookie}"})).known  # type: ignore[arg-type]


def test_the_proxy_header_is_believed_only_from_the_proxy() -> None:
    auth = Auth(SETTINGS)
    header = {"X-Forwarded-User": "carol"}
    assert auth.viewer(_request(header, peer="10.0.0.5")).user == "carol"  # type: ignore[arg-type]
    assert not auth.viewer(_request(header, peer="10.0.0.9")).known  # type: ignore[arg-type]


def test_bearer_tokens_and_their_bounds() -> None:
    auth = Auth(SETTINGS)
    assert auth.user_for_token("a-secret-token") == "alice"
    assert auth.user_for_token("a-secret-tokem") is None
    assert auth.user_for_token("x" * 10_000) is None
    viewer = auth.viewer(_request({"Authorization": "Bearer a-secret-token"}))  # type: ignore[arg-type]
    assert (viewer.user, viewer.via) == ("alice", Via.BEARER)
