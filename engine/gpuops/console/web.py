"""The console's routes, mounted under /console on the engine's HTTP server.

Pages are rendered on the server (Jinja2); the fleet heatmap and the node charts are
drawn in the browser from compact JSON, and a server-sent event stream pushes what
changed (cells, node states, counts) every `push_s`. Actions go through the same
command table as ChatOps and the CLI (`gpuops.ops.commands`), as the logged-in user, on the
`console` platform and channel, so the ChatOps permission table decides who may act.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuops.act.evidence import RUN_ID, Evidence
from gpuops.clock import Clock
from gpuops.console.auth import COOKIE, Auth, Viewer, anonymous_read, is_loopback_host
from gpuops.console.latest import SIGNALS, Latest
from gpuops.console.thresholds import TempThreshold, temp_threshold, with_threshold
from gpuops.console.throttle import Failure
from gpuops.console.views import CHART_FIELDS, Warned, telemetry, timeline
from gpuops.errors import EngineError
from gpuops.inventory.domains import KINDS, Domains
from gpuops.match.rules import RuleSet
from gpuops.ops.cmdwire import CommandError
from gpuops.ops.commands import MAX_REASON, Caller, Commands
from gpuops.record.episodes import node_reason, read_open
from gpuops.record.nodestate import NodeState
from gpuops.settings import ConsoleSettings

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
STATIC, TEMPLATES = HERE / "static", HERE / "templates"
UPLOT = "uPlot-1.6.32"  # static/vendor/: the pinned chart library (LICENSE beside it)
COLOUR_BY = {
    "temp": "temperature against its slowdown threshold",
    "power": "power against its limit",
    "util": "utilisation",
    "membw": "memory bandwidth",
    "state": "node state",
}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
APPROVAL_ID = re.compile(r"^[0-9a-f]{1,64}$")
SILENCE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TARGET, MAX_DURATION = 300, 16
TIMELINE_DAYS = 7
TELEMETRY_WINDOW_S = 600.0

# A source of power budgets and their use, once budgets exist: rows with `name`,
# `limit_w`, `used_w` (and anything else worth a column). None: the panel is not shown.
BudgetSource = Callable[[], Awaitable[Sequence[Mapping[str, Any]]]]


class _Cached:
    """One awaited value shared by every page for `ttl` seconds (a stream per page must
    not mean a KV scan per page)."""

    def __init__(self, fetch: Callable[[], Awaitable[Any]], ttl: float) -> None:
        self.fetch, self.ttl = fetch, ttl
        self._value: Any = None
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    async def get(self) -> Any:
        async with self._lock:
            if time.monotonic() - self._at >= self.ttl:
                self._value, self._at = await self.fetch(), time.monotonic()
            return self._value


class Console:
    """The /console routes, for a server listening on `bind` (`host:port`)."""

    def __init__(
        self,
        commands: Commands,
        settings: ConsoleSettings,
        latest: Latest,
        evidence: Evidence,
        *,
        bind: str,
        clock: Clock,
        registry: CollectorRegistry,
        budgets: BudgetSource | None = None,
        rules: Callable[[], RuleSet] | None = None,
    ) -> None:
        """`rules`: the engine's rules now (the heatmap's threshold is the overheat rule's)."""
        self.commands, self.settings, self.latest = commands, settings, latest
        self.rules = rules
        self._thresholds: tuple[RuleSet | None, TempThreshold | None] = (None, None)
        self.evidence, self.budgets = evidence, budgets
        self.auth = Auth(settings, clock, registry)
        self.anonymous_read = anonymous_read(settings, bind)
        # Open to read because only this host can reach it: a request that names another
        # host (a page elsewhere whose name was made to resolve to 127.0.0.1) is not.
        self._loopback_read = self.anonymous_read and settings.anonymous_read != "always"
        if not self.anonymous_read and not (settings.tokens or settings.user_header):
            log.warning(
                "console on %s needs a login to read, and none is configured "
                "(console.tokens or console.user_header): nobody can use it",
                bind,
            )
        self.unreadable = Warned()  # audit records already logged as unreadable
        self.status = _Cached(commands.status, settings.push_s)
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(TEMPLATES),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.env.globals.update(uplot=UPLOT, colour_by=COLOUR_BY)
        self.env.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
        self._closing = asyncio.Event()
        self.streams = 0

    def mount(self, app: web.Application) -> None:
        """Add the routes and static files to the engine's application."""
        app.add_routes(
            [
                web.get("/console", self.home),
                web.get("/console/", self.home),
                web.get("/console/fleet", self.fleet),
                web.get("/console/api/fleet", self.fleet_json),
                web.get("/console/events", self.events),
                web.get("/console/node/{node}", self.node),
                web.get("/console/api/node/{node}/telemetry", self.node_json),
                web.get("/console/runs/{run_id}", self.run_output),
                web.get("/console/now", self.now),
                web.post("/console/approvals/{id}", self.answer),
                web.post("/console/silences", self.silence),
                web.post("/console/silences/{id}/expire", self.expire),
                web.post("/console/breaker", self.breaker),
                web.get("/console/login", self.login_page),
                web.post("/console/login", self.login),
                web.post("/console/logout", self.logout),
            ]
        )
        app.router.add_static("/console/static", STATIC)
        app.on_shutdown.append(self._shutdown)

    async def _shutdown(self, app: web.Application) -> None:
        self._closing.set()  # live streams end now, not at the server's shutdown timeout

    # --- helpers ----------------------------------------------------------------------

    def _open_to(self, request: web.Request) -> bool:
        """Whether anyone may read what this request asks for without logging in."""
        return self.anonymous_read and (not self._loopback_read or is_loopback_host(request.host))

    def _viewer(self, request: web.Request) -> Viewer:
        viewer = self.auth.viewer(request)
        if not (viewer.known or self._open_to(request)):
            if request.path.startswith(("/console/api/", "/console/events")):
                raise web.HTTPUnauthorized(text="log in to read (/console/login)")
            raise web.HTTPFound("/console/login?next=" + quote(request.path_qs, safe=""))
        return viewer

    async def _page(
        self, name: str, request: web.Request, viewer: Viewer, status: int = 200, **data: Any
    ) -> web.Response:
        # The header says what every page is under: the engine, and whether it only records.
        readable = viewer.known or self._open_to(request)
        header = _summary(await self.status.get()) if readable else None
        html = self.env.get_template(name).render(
            viewer=viewer,
            header=header,
            form_token=self.auth.form_token(viewer) if viewer.known else "",
            path=request.path,
            **data,
        )
        return web.Response(text=html, content_type="text/html", status=status, headers=HEADERS)

    def _nodes(self, request: web.Request) -> tuple[str, Sequence[str]]:
        group = request.query.get("group", "all")[:200]
        nodes = self.latest.nodes_of(group)
        if nodes is None:
            raise web.HTTPBadRequest(text=f"no inventory group {group!r}")
        return group, nodes

    # --- fleet ------------------------------------------------------------------------

    async def home(self, request: web.Request) -> web.Response:
        """The fleet is the first page."""
        raise web.HTTPFound("/console/fleet")

    async def fleet(self, request: web.Request) -> web.Response:
        """The heatmap page (drawn by static/fleet.js from /console/api/fleet)."""
        viewer = self._viewer(request)
        group, nodes = self._nodes(request)
        colour = request.query.get("by", "temp")
        colour = colour if colour in COLOUR_BY else "temp"
        groups = ["all", *self.latest.groups]
        kind = request.query.get("domain", "")
        kind = kind if kind in KINDS else ""
        sections = _sections(self.latest.domains, kind, await self.status.get()) if kind else []
        return await self._page(
            "fleet.html",
            request,
            viewer,
            group=group,
            groups=groups,
            by=colour,
            count=len(nodes),
            kinds=KINDS,
            domain=kind,
            sections=sections,
        )

    async def fleet_json(self, request: web.Request) -> web.Response:
        """Every cell of the group's nodes, their states and the fields of a row."""
        self._viewer(request)
        _, nodes = self._nodes(request)
        frame = self.latest.frame(nodes, time.time())
        status = await self.status.get()
        threshold = self._threshold()
        body = {
            "fields": ["node", "gpu", "age_s", *SIGNALS, "temp_at"],
            "nodes": list(nodes),
            "seq": frame.seq,
            "rows": with_threshold(frame.rows, threshold),
            "temp_threshold": threshold.text if threshold is not None else None,
            "states": _states(status, nodes),
            "summary": _summary(status),
        }
        return web.json_response(body, dumps=_compact)

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: every `push_s`, the cells changed since the last, and states."""
        self._viewer(request)
        _, nodes = self._nodes(request)
        if self.streams >= self.settings.max_streams:
            raise web.HTTPServiceUnavailable(text="too many live pages open; reload later")
        since = _bounded_int(request.query.get("since", "0"), self.latest.seq)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        self.streams += 1  # before the first await: requests arriving together count too
        try:
            await response.prepare(request)
            while not self._closing.is_set():
                since = await self._push(response, nodes, since)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), self.settings.push_s)
        except (ConnectionResetError, RuntimeError):
            pass  # the page went away
        finally:
            self.streams -= 1
        return response

    async def _push(self, response: web.StreamResponse, nodes: Sequence[str], since: int) -> int:
        frame = self.latest.frame(nodes, time.time(), since)
        status = await self.status.get()
        data = {
            "seq": frame.seq,
            "rows": with_threshold(frame.rows, self._threshold()),
            "states": _states(status, nodes),
            "summary": _summary(status),
        }
        await response.write(f"event: frame\ndata: {_compact(data)}\n\n".encode())
        return frame.seq

    def _threshold(self) -> TempThreshold | None:
        """The overheat rule's threshold, found again only when the rules were reloaded."""
        if self.rules is None:
            return None
        rules = self.rules()
        if self._thresholds[0] is not rules:
            self._thresholds = (rules, temp_threshold(rules))
        return self._thresholds[1]

    # --- node -------------------------------------------------------------------------

    def _known_node(self, request: web.Request) -> str:
        node = request.match_info["node"]
        if node not in self.latest.nodes:
            raise web.HTTPNotFound(text=f"{node!r} is not in the inventory")
        return node

    async def node(self, request: web.Request) -> web.Response:
        """A node's state, its timeline from the audit trail, and its GPUs' recent charts."""
        viewer = self._viewer(request)
        node = self._known_node(request)
        days = _bounded_int(request.query.get("days", str(TIMELINE_DAYS)), 30, low=1)
        since = time.time() - days * 86400.0
        entries = await timeline(self.commands.bus.js, node, since, self.unreadable)
        if not viewer.known:  # a run's failed task and message are as private as its output
            entries = [e.for_anonymous() for e in entries]
        record = await self.commands.states.get(node)
        reason = node_reason(record, await read_open(self.commands.episodes))
        gpus = sorted(self.latest.gpus(node).items())
        return await self._page(
            "node.html",
            request,
            viewer,
            node=node,
            record=record,
            reason=reason,
            entries=list(reversed(entries)),
            days=days,
            gpus=gpus,
            signals=SIGNALS,
            chart_fields=CHART_FIELDS,
        )

    async def node_json(self, request: web.Request) -> web.Response:
        """The node's telemetry of the last ten minutes, per GPU, as uPlot columns."""
        self._viewer(request)
        node = self._known_node(request)
        data = await telemetry(self.commands.bus.js, node, time.time() - TELEMETRY_WINDOW_S)
        return web.json_response(data, dumps=_compact)

    async def run_output(self, request: web.Request) -> web.Response:
        """A kept run's output, as ansible-playbook printed it: for a logged-in user only,
        even on a read-only console (a run's output can show host variables)."""
        viewer = self._viewer(request)
        if not viewer.known:
            raise web.HTTPFound("/console/login?next=" + quote(request.path_qs, safe=""))
        try:
            text = self.evidence.stdout(request.match_info["run_id"])
        except EngineError as exc:
            raise web.HTTPNotFound(text=str(exc)) from exc
        return web.Response(text=text, content_type="text/plain", headers=HEADERS)

    # --- now --------------------------------------------------------------------------

    async def now(self, request: web.Request) -> web.Response:
        """Open episodes, approvals, silences, the breaker (and power budgets, once there)."""
        viewer = self._viewer(request)
        status = await self.commands.status()
        budgets = await self.budgets() if self.budgets is not None else None
        message = request.query.get("msg", "")[:600]
        return await self._page(
            "now.html",
            request,
            viewer,
            s=status,
            budgets=budgets,
            message=message,
            ok=request.query.get("ok") == "1",
            states=[s.value for s in NodeState],
        )

    async def _act(self, request: web.Request, words: list[str]) -> web.Response:
        """Run one command as the viewer; back to the Now page with its answer."""
        viewer = self.auth.viewer(request)
        form = await request.post()
        if not viewer.known:
            raise web.HTTPUnauthorized(text="log in to act (/console/login)")
        refused = self.auth.form_refused(request, viewer, str(form.get("form_token", "")))
        if refused is not None:
            raise web.HTTPForbidden(text=refused)
        caller = Caller.of("console", viewer.user, channel="console")
        try:
            reply, ok = await self.commands.execute(shlex.join(words), caller), True
        except CommandError as exc:
            reply, ok = str(exc), False
        raise web.HTTPSeeOther(
            f"/console/now?ok={int(ok)}&msg=" + quote(reply.splitlines()[0][:500] if reply else "")
        )

    async def answer(self, request: web.Request) -> web.Response:
        """Approve or deny a held action, with a reason."""
        form = await request.post()
        ident, verb = request.match_info["id"], str(form.get("answer", ""))
        reason = _field(form, "reason", MAX_REASON)
        if not APPROVAL_ID.match(ident) or verb not in ("approve", "deny"):
            raise web.HTTPBadRequest(text="answer approve or deny to an approval id")
        if not reason:
            raise web.HTTPBadRequest(text="say why (a reason is kept in the audit trail)")
        return await self._act(request, [verb, ident, *reason.split()])

    async def silence(self, request: web.Request) -> web.Response:
        """Create a silence: target, duration, reason."""
        form = await request.post()
        target = _field(form, "target", MAX_TARGET)
        duration = _field(form, "duration", MAX_DURATION)
        reason = _field(form, "reason", MAX_REASON)
        if not (target and duration and reason):
            raise web.HTTPBadRequest(text="a silence needs a target, a duration and a reason")
        return await self._act(request, ["silence", target, duration, *reason.split()])

    async def expire(self, request: web.Request) -> web.Response:
        """End a silence now."""
        ident = request.match_info["id"]
        if not SILENCE_ID.match(ident):
            raise web.HTTPBadRequest(text="not a silence id")
        return await self._act(request, ["unsilence", ident])

    async def breaker(self, request: web.Request) -> web.Response:
        """Reset or half-open the fleet breaker."""
        form = await request.post()
        to = str(form.get("to", ""))
        if to not in ("reset", "half-open"):
            raise web.HTTPBadRequest(text="reset or half-open")
        return await self._act(request, ["breaker", to])

    # --- login ------------------------------------------------------------------------

    async def login_page(self, request: web.Request) -> web.Response:
        """The token form (a proxy's header needs none), saying why a login is asked."""
        viewer = self.auth.viewer(request)
        target = _next(request.query.get("next"))
        return await self._login(request, viewer, 200, target, "")

    async def _login(
        self, request: web.Request, viewer: Viewer, status: int, target: str, error: str
    ) -> web.Response:
        run_id = target.removeprefix("/console/runs/")
        return await self._page(
            "login.html",
            request,
            viewer,
            status,
            next=target,
            error=error,
            run_id=run_id if RUN_ID.match(run_id) else "",
            open_to_read=self.anonymous_read,
            tokens=bool(self.settings.tokens),
            proxy=bool(self.settings.user_header),
        )

    async def login(self, request: web.Request) -> web.Response:
        """Exchange a token for a session cookie (HttpOnly, SameSite=Strict, Secure over TLS)."""
        form = await request.post()
        # Judged after the form is read, with no wait between the check and the count: a
        # check before the read let every connection that sent its body at once through.
        self.auth.refuse_if_throttled(request)
        target = _next(str(form.get("next", "")))
        user = self.auth.user_for_token(_field(form, "token", 512))
        if user is None or not self.auth.same_origin(request):
            self.auth.failed(request, Failure.FORM)
            return await self._login(request, Viewer(), 401, target, "unknown token")
        response = web.HTTPSeeOther(target)
        response.set_cookie(
            COOKIE,
            self.auth.session_cookie(user),
            max_age=int(self.settings.session_s),
            httponly=True,
            samesite="Strict",
            secure=self.auth.secure(request),
            path="/console",
        )
        raise response

    async def logout(self, request: web.Request) -> web.Response:
        """End the session: here, and the cookie in the browser."""
        self.auth.end_session(request)
        response = web.HTTPSeeOther("/console/fleet")
        response.del_cookie(COOKIE, path="/console")
        raise response


def _compact(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


def _field(form: Mapping[str, Any], name: str, limit: int) -> str:
    value = str(form.get(name, "")).strip()
    if len(value) > limit:
        raise web.HTTPBadRequest(text=f"{name}: at most {limit} characters")
    return value


def _bounded_int(value: str, high: int, low: int = 0) -> int:
    if not value.isdigit() or len(value) > 12:
        raise web.HTTPBadRequest(text=f"not a whole number: {value[:20]!r}")
    return max(low, min(int(value), high))


def _next(value: str | None) -> str:
    """Where to go after logging in: only a console page of this server."""
    if value and value.startswith("/console/") and not value.startswith("//"):
        return value[:500]
    return "/console/now"


def _sections(domains: Domains, kind: str, status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The fleet by one kind of failure domain: each domain's nodes, those not healthy,
    and its open domain episode."""
    unhealthy = {r["node"]: r["state"] for r in status["unhealthy"]}
    episodes = {(e["kind"], e["name"]): e for e in status.get("domain_episodes", [])}
    out = []
    for (k, name), hosts in sorted(domains.members.items()):
        if k != kind:
            continue
        out.append(
            {
                "name": name,
                "group": domains.group(k, name),
                "nodes": len(hosts),
                "out": sorted((h, unhealthy[h]) for h in hosts if h in unhealthy),
                "episode": episodes.get((k, name)),
            }
        )
    return out


def _states(status: Mapping[str, Any], nodes: Sequence[str]) -> dict[str, str]:
    """States of the listed nodes that are not healthy (the rest are)."""
    wanted = set(nodes)
    return {r["node"]: r["state"] for r in status["unhealthy"] if r["node"] in wanted}


def _summary(status: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "counts": status["counts"],
        "breaker": status["breaker"]["state"],
        "approvals": len(status["approvals"]),
        "episodes": len(status["episodes"]),
        "engine": status["engine"]["running"],
        "engine_line": status["engine"]["line"],
        "dry_run": status["dry_run"],
        "dry_run_why": status.get("dry_run_why", ""),
    }
