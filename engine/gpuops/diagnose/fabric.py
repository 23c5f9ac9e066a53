"""Grade 4, the fabric: `ib_write_bw` per HCA against a known-good peer, and which side
is bad when a pair fails.

A pair's bandwidth is the slower end's, so one failing pair cannot say which node is
at fault. Google's Cluster Health Scanner answers with a second pass: both nodes of the
failing pair are paired again with another known-good peer, and the one that fails
again is the bad one. Here the node under test is paired with `peers[0]`; when that
pair fails on any HCA, node and `peers[0]` are each paired with `peers[1]`:

    node+p1 ok                        the node passes
    node+p2 fails, p1+p2 passes       the node is at fault (p1 cleared)
    node+p2 passes, p1+p2 fails       p1 is at fault (the node passes; p1 is named)
    both fail                         the node fails; p2 may be bad too (said so)
    both pass                         the first failure did not repeat: the node passes

The engine picks the peers (`pick_peers`): in no failure domain of the node (its rack,
PDU, cooling loop, leaf switch or NVLink domain: gpuops.inventory.domains), not out of
service or under remediation, spread over the fleet by a
stable hash so the same few nodes are not everyone's peer.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Iterable, Mapping, Sequence

from gpuops.diagnose import parsers
from gpuops.diagnose.results import Check
from gpuops.errors import DiagnosticsError

PEERS = 2  # the first peer, and the second pass's


def pair_name(a: str, b: str) -> str:
    """How outputs and checks name a pair: `node-a~node-b` (the client first)."""
    return f"{a}~{b}"


def pair_checks(pair: str, reports: Mapping[str, str], bound_gbps: float) -> list[Check]:
    """Each HCA's `ib_write_bw` report of one pair, judged; a pair with no report fails."""
    if not reports:
        return [Check(name=f"ib_write_bw:{pair}", ok=False, detail="no report: did it run?")]
    checks = []
    for hca, text in sorted(reports.items()):
        try:
            found = parsers.ib_write_bw(text, bound_gbps, hca)
        except DiagnosticsError as exc:  # not a report: the HCA's check fails, saying why
            found = [Check(name=f"ib_write_bw:{hca}", ok=False, detail=str(exc))]
        checks += [c.model_copy(update={"detail": f"{pair}: {c.detail}"}) for c in found]
    return checks


def judged(text: str, bound_gbps: float) -> list[Check]:
    """The playbook's fabric output (JSON: `node`, `peers`, `passes`) judged."""
    try:
        doc = parsers.loads("fabric", text)
        node, peers, passes = str(doc["node"]), [str(p) for p in doc["peers"]], doc["passes"]
        reports = {
            str(pair): {str(h): str(r) for h, r in by_hca.items()}
            for pair, by_hca in passes.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DiagnosticsError("fabric", f"not the fabric passes' JSON: {exc}") from exc
    return verdict(node, peers, reports, bound_gbps)


def verdict(
    node: str,
    peers: Sequence[str],
    passes: Mapping[str, Mapping[str, str]],
    bound_gbps: float,
) -> list[Check]:
    """The node's fabric checks from the passes run (`passes[pair_name(a, b)][hca]` is
    the client's report): the pair that decides, and `fabric:verdict` saying who is bad."""
    if not peers:
        return [Check(name="fabric:verdict", ok=False, detail="no known-good peer to pair with")]
    first_peer = peers[0]
    first = pair_checks(
        pair_name(node, first_peer), passes.get(pair_name(node, first_peer), {}), bound_gbps
    )
    if all(c.ok for c in first):
        return [*first, _said(True, f"{node} with {first_peer}: every HCA at rate")]
    slow = ", ".join(c.describe() for c in first if not c.ok)
    if len(peers) < 2:
        return [*first, _said(False, f"{node} with {first_peer} failed ({slow}); no second peer")]
    second_peer = peers[1]
    mine = pair_checks(
        pair_name(node, second_peer), passes.get(pair_name(node, second_peer), {}), bound_gbps
    )
    theirs = pair_checks(
        pair_name(first_peer, second_peer),
        passes.get(pair_name(first_peer, second_peer), {}),
        bound_gbps,
    )
    node_bad, peer_bad = not all(c.ok for c in mine), not all(c.ok for c in theirs)
    said = f"{node} with {first_peer} failed ({slow}); second pass with {second_peer}: "
    if node_bad and not peer_bad:
        said += f"{node} fails again, {first_peer} passes: {node} is at fault"
    elif peer_bad and not node_bad:
        said += f"{first_peer} fails, {node} passes: {first_peer} is at fault, not {node}"
    elif node_bad:
        said += f"both fail again: {node} is at fault, and {second_peer} may be too"
    else:
        said += "both pass: the first failure did not repeat"
    return [*mine, _said(not node_bad, said, blamed=_blamed(node, first_peer, node_bad, peer_bad))]


def _blamed(node: str, peer: str, node_bad: bool, peer_bad: bool) -> str:
    return ",".join(n for n, bad in ((node, node_bad), (peer, peer_bad and not node_bad)) if bad)


def _said(ok: bool, detail: str, blamed: str = "") -> Check:
    return Check(
        name="fabric:verdict", ok=ok, detail=detail + (f" [blamed: {blamed}]" if blamed else "")
    )


def pick_peers(
    node: str,
    hosts: Iterable[str],
    domains: Mapping[str, Mapping[str, str]],
    out: Collection[str],
    n: int = PEERS,
) -> list[str]:
    """Up to `n` known-good peers for `node`: sharing none of its failure domains (`domains`:
    each host's kind -> name), not in `out` (out of service, under remediation, or held),
    in a stable order of their own."""
    mine = domains.get(node, {})

    def apart(other: str) -> bool:
        theirs = domains.get(other, {})
        return not any(theirs.get(kind) == name for kind, name in mine.items())

    candidates = [h for h in hosts if h != node and h not in out and apart(h)]
    return sorted(candidates, key=lambda h: (zlib.crc32(f"{node}|{h}".encode()), h))[:n]
