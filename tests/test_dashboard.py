"""The swarm's health page: the document as a pure function of what was read (forks, bans, chart
points, dead peers dropped), the read-only server, bad input to `dashboard`, and a real swarm
seen through the page in headless Chromium."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from diloco_peer.coordinator_free.allowlist import Allowlist
from diloco_peer.coordinator_free.dashboard import MAX_POINTS, Timeline, dashboard_document
from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.swarm_view import HEAD_TTL_S, HeadBook
from diloco_peer.errors import BadInput
from diloco_peer.identity import Identity
from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm, kill_main, spawn
from diloco_peer.peer.dashboard import DashboardServer, Source

A, B, C = "Apeer", "Bpeer", "Cpeer"
H0, H1 = "0" * 64, "1" * 64
NOW = 1_000_000.0
PY = list(PEER_COMMAND)
NANO = ["--model", "nano", "--inner-steps", "10"]


def head(peer: str, version: int = 0, state_hash: str = H0, **fields: Any) -> PeerHead:
    fields.setdefault("updated", NOW)
    return PeerHead(peer_id=peer, version=version, state_hash=state_hash, **fields)


def document(*heads: PeerHead, timeline: Timeline | None = None, now: float = NOW) -> dict:
    book = HeadBook(me="")
    book.merge({h.peer_id: h for h in heads}, now)
    return dashboard_document("t", book, now, timeline=timeline or Timeline(), manifest=None)


# ------------------------------------------------------------------ the document (pure)


def test_one_branch_lists_every_live_peer_with_one_head_hash() -> None:
    doc = document(head(A, 3, speed=2.0, rss_mb=120.0), head(B, 3), head(C, 2, client=True))
    assert [p["peer_id"] for p in doc["peers"]] == [A, B, C]
    assert doc["head_version"] == 3 and doc["head_hashes"] == [H0] and doc["live_count"] == 3
    assert doc["forks"] == {} and doc["banned"] == {}
    first = doc["peers"][0]
    assert first["speed"] == 2.0 and first["rss_mb"] == 120.0 and first["contribution"] is None
    assert doc["peers"][2]["client"] is True
    json.dumps(doc, allow_nan=False)  # the JSON endpoint's body


def test_two_hashes_at_one_version_are_a_fork() -> None:
    doc = document(head(A, 4, H0), head(B, 4, H1), head(C, 4, H1))
    assert doc["forks"] == {"4": [H0, H1]}
    assert doc["head_hashes"] == [H0, H1]


def test_bans_say_who_bans_whom_and_why() -> None:
    doc = document(head(A, 2, bans={C: "bad norm"}), head(B, 2, bans={C: "bad digest"}), head(C, 2))
    assert set(doc["banned"][C]["by"]) == {A, B}
    assert sorted(doc["banned"][C]["reasons"]) == ["bad digest", "bad norm"]
    assert {p["peer_id"]: p["banned_by"] for p in doc["peers"]} == {A: 0, B: 0, C: 2}


def test_dead_and_departed_peers_are_dropped() -> None:
    doc = document(
        head(A, 5),
        head(B, 5, updated=NOW - HEAD_TTL_S),  # silent for a TTL: gone (SIGKILL)
        head(C, 5, updated=0.0),  # published its departure
    )
    assert [p["peer_id"] for p in doc["peers"]] == [A] and doc["live_count"] == 1
    assert document(now=NOW)["head_version"] is None  # nobody live: an empty page, no error


def test_the_chart_has_a_point_per_version_the_heads_reached() -> None:
    timeline = Timeline()
    timeline.observe_heads({A: head(A, 0), B: head(B, 0)}, NOW)
    # B's loss at version 0 is its next phase's, which is not version 0's: not read
    timeline.observe_heads({A: head(A, 0), B: head(B, 0, loss=4.0, in_group=True)}, NOW + 1)
    timeline.observe_heads({A: head(A, 1, loss=3.2), B: head(B, 0)}, NOW + 5)
    timeline.observe_heads({A: head(A, 1, loss=3.0, in_group=True), B: head(B, 1)}, NOW + 6)
    timeline.observe_heads({A: head(A, 2, loss=2.5), B: head(B, 2, loss=2.7)}, NOW + 12)
    chart = document(head(A, 2), timeline=timeline)["chart"]
    assert [p["version"] for p in chart] == [0, 1, 2]
    assert chart[0]["loss"] is None and chart[1]["loss"] == pytest.approx(3.2)  # taken once
    assert [p["time"] for p in chart] == [NOW, NOW + 5, NOW + 12]  # first seen at that version
    assert chart[1]["peers"] == 2 and chart[2]["loss"] == pytest.approx(2.6)


def test_a_peers_round_events_give_ppl_bytes_and_contributions() -> None:
    timeline = Timeline()
    timeline.observe_heads({A: head(A, 1, loss=9.0)}, NOW)
    events = [
        {"event": "start", "version": 0, "peer": A},
        {"event": "round", "version": 1, "peer": A, "time": NOW - 1, "loss": 3.0, "ppl": 20.0,
         "bytes_sent": 100, "bytes_received": 150, "group_size": 2, "members": [A, B],
         "steps": 10, "shards": {"0": 40}},
        {"event": "round", "version": 2, "peer": A, "time": NOW + 9, "loss": 2.0, "ppl": None,
         "bytes_sent": 10, "bytes_received": 10, "group_size": 2, "members": [A, B],
         "steps": 10, "shards": {"0": 20, "3": 20}},
        {"event": "round", "version": "x"},  # a torn or hostile line: ignored
    ]  # fmt: skip
    timeline.observe_events(events)
    timeline.observe_heads({A: head(A, 1, loss=9.0)}, NOW + 10)  # the log's point stays exact
    doc = document(head(A, 2), head(B, 2), timeline=timeline)
    chart = {p["version"]: p for p in doc["chart"]}
    assert chart[1]["loss"] == 3.0 and chart[1]["ppl"] == 20.0 and chart[1]["bytes"] == 250
    assert chart[2]["ppl"] is None and chart[2]["bytes"] == 20
    assert doc["contributions"][A] == {"rounds": 2, "steps": 20, "samples": 80}
    assert doc["contributions"][B] == {"rounds": 2, "steps": 0, "samples": 0}
    assert doc["peers"][0]["contribution"] == doc["contributions"][A]


def test_round_events_that_list_every_members_contribution_count_them_all() -> None:
    """A round event's `contributions` (each member's [steps, samples] from its signed header,
    Guard.contributions) gives every member's totals, not only the serving peer's."""
    timeline = Timeline()
    timeline.observe_events(
        [
            {
                "event": "round",
                "version": v,
                "peer": A,
                "time": NOW + v,
                "members": [A, B],
                "steps": 10,
                "shards": {"0": 40},
                "contributions": {A: [10, 40], B: [7, 28]},
            }
            for v in (1, 2)
        ]
        + [
            {
                "event": "round",
                "version": 3,
                "peer": A,
                "members": [A, C],
                "contributions": {C: ["x", -1], 5: [1, 1], A: [1]},
            }
        ]
    )  # fmt: skip  (hostile values)
    doc = document(head(A, 3), head(B, 3), head(C, 3), timeline=timeline)
    assert doc["contributions"][A] == {"rounds": 3, "steps": 20, "samples": 80}
    assert doc["contributions"][B] == {"rounds": 2, "steps": 14, "samples": 56}
    assert doc["contributions"][C] == {"rounds": 1, "steps": 0, "samples": 0}


def test_the_timeline_keeps_the_newest_points_only() -> None:
    timeline = Timeline()
    for v in range(MAX_POINTS + 10):
        timeline.observe_heads({A: head(A, v)}, NOW + v)
    versions = [p["version"] for p in timeline.chart()]
    assert len(versions) == MAX_POINTS and versions[-1] == MAX_POINTS + 9


# ------------------------------------------------------------------ the server (no swarm)


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, "", b""


@pytest.mark.timeout(60)
def test_the_server_is_read_only_and_the_page_needs_no_network() -> None:
    heads = {A: head(A, 1, updated=time.time()), B: head(B, 1, updated=time.time())}
    source = Source(run="t", read_heads=lambda: heads, manifest={"run_name": "t"})
    server = DashboardServer("127.0.0.1", 0, source, refresh_s=0.2)
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        status, kind, page = _get(base + "/")
        assert status == 200 and kind.startswith("text/html")
        assert b"<svg" in page and b"/api/swarm" in page
        assert b"http://" not in page.replace(b"http://www.w3.org/2000/svg", b"")
        assert b"https://" not in page and b"src=" not in page  # nothing from outside
        deadline = time.monotonic() + 10
        while (doc := json.loads(_get(base + "/api/swarm")[2]))["live_count"] < 2:
            assert time.monotonic() < deadline, doc
            time.sleep(0.1)
        assert doc["run"] == "t" and doc["manifest"] == {"run_name": "t"}
        assert _get(base + "/other")[0] == 404
        for method in ("POST", "PUT", "DELETE"):
            request = urllib.request.Request(base + "/api/swarm", data=b"{}", method=method)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(request, timeout=10)
            assert e.value.code == 501
        with pytest.raises(BadInput, match="cannot serve the dashboard"):
            DashboardServer("127.0.0.1", server.port, source)  # the port is taken
    finally:
        server.shutdown()
        server.shutdown()


# ------------------------------------------------------------------ bad input to the command


def _dashboard(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PY, "dashboard", *args], capture_output=True, text=True, timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _one_line_exit_2(out: subprocess.CompletedProcess[str], says: str) -> None:
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco-peer: error: "), out.stderr
    assert says in lines[0] and "Traceback" not in out.stderr


@pytest.mark.timeout(120)
def test_bad_input_is_one_line_and_exit_2() -> None:
    nobody = f"/ip4/127.0.0.1/tcp/9/p2p/{Identity.generate().peer_id_str}"
    cases = [
        (("--swarm", nobody, "--run", "t", "--port", "0"), "cannot reach the swarm"),
        (("--swarm", "not-an-address", "--run", "t"), "cannot reach the swarm"),
        (("--swarm", nobody, "--port", "70000"), "--port"),
        (("--swarm", nobody, "--port", "http"), "--port"),
        (("--swarm", nobody, "--run", "no spaces"), "run name"),
        (("--swarm", nobody, "--refresh-s", "0"), "--refresh-s"),
    ]
    # all at once: each case is a process of its own, and most of its time is imports
    with ThreadPoolExecutor(len(cases)) as pool:
        outs = list(pool.map(lambda case: _dashboard(*case[0]), cases))
    for (_, says), out in zip(cases, outs, strict=True):
        _one_line_exit_2(out, says)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ a real swarm in a browser


def _start_dashboard(swarm: LocalSwarm, maddr: str, port: int, *extra: str) -> None:
    """`dashboard` of run t on `port`, refreshing every second; stopped with the peers,
    whatever happens."""
    argv = [*PY, "dashboard", "--swarm", maddr, "--run", "t", "--port", str(port),
            "--refresh-s", "1", *extra]  # fmt: skip
    swarm.procs.append(spawn(argv, stderr=swarm.folder / "dashboard.err"))


def _browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def _page(driver: Any) -> dict[str, Any]:
    """What the page shows now: the peer rows (id, version, hash), the head hashes, the chart."""
    return driver.execute_script(
        """
        const rows = [...document.querySelectorAll('#peers tbody tr')];
        return {
          peers: rows.map(r => r.dataset.peer),
          versions: rows.map(r => +r.querySelector('td.version').textContent),
          hashes: rows.map(r => r.querySelector('td.hash').textContent),
          head: document.getElementById('head-version').textContent,
          head_hashes: document.getElementById('head-hashes').textContent,
          points: document.querySelectorAll('#chart-loss circle.point').length,
        };
        """
    )


def _wait_page(driver: Any, timeout_s: float, ok: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        shown = _page(driver)
        if ok(shown):
            return shown
        if time.monotonic() > deadline:
            raise TimeoutError(f"the page never showed what was expected: {shown}")
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_the_page_shows_the_live_swarm_and_drops_a_killed_peer(swarm: LocalSwarm) -> None:
    """Slow (80-100 s on two busy cores, most of it the head TTL): the default suite is near
    its 15 minutes. Bad input that needs a live swarm (an unknown run, a taken port) is
    checked here too, on the same swarm."""
    served = _free_port()
    a, log_a = swarm.start("a", *NANO, "--expected-peers", "3", "--dashboard-port", str(served))
    maddr = swarm.address(log_a, 90, proc=a)
    b, log_b = swarm.start("b", "--swarm", maddr)
    c, log_c = swarm.start("c", "--swarm", maddr)
    port = _free_port()
    _start_dashboard(swarm, maddr, port)
    ids = {name: swarm.wait_event(log, "start", 120)["peer"] for name, log in
           (("a", log_a), ("b", log_b), ("c", log_c))}  # fmt: skip
    driver = _browser()
    try:
        deadline = time.monotonic() + 60
        while True:  # the dashboard process reads the swarm before it serves
            try:
                driver.get(f"http://127.0.0.1:{port}/")
                break
            except Exception:
                assert time.monotonic() < deadline, (swarm.folder / "dashboard.err").read_text()
                time.sleep(1)

        def settled(p: dict[str, Any]) -> bool:  # 3 peers at one version and hash, 2 points
            return (sorted(p["peers"]) == sorted(ids.values()) and len(set(p["versions"])) == 1
                    and p["versions"][0] >= 2 and len(set(p["hashes"])) == 1
                    and "," not in p["head_hashes"] and p["points"] >= 2)  # fmt: skip

        shown = _wait_page(driver, 150, settled)
        assert shown["head"] == str(shown["versions"][0])
        # The peer serves the same page, its chart fed by its event log as well.
        with urllib.request.urlopen(f"http://127.0.0.1:{served}/api/swarm", timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["served_by"] == ids["a"] and doc["manifest"]["run_name"] == "t"
        # Bad input against a live swarm: a run it does not hold, a port already taken.
        _one_line_exit_2(_dashboard("--swarm", maddr, "--run", "nope", "--port", "0"),
                         "no manifest for run nope")  # fmt: skip
        _one_line_exit_2(_dashboard("--swarm", maddr, "--run", "t", "--port", str(port)),
                         "cannot serve the dashboard")  # fmt: skip
        # every member's steps and samples, from the signed headers its round events list
        assert all(doc["contributions"][i]["steps"] >= 10 for i in ids.values()), doc
        assert all(doc["contributions"][i]["samples"] > 0 for i in ids.values()), doc
        assert any(p["ppl"] is not None or p["bytes"] for p in doc["chart"])

        kill_main(c)  # SIGKILL the main process alone, as a crash does
        killed = time.monotonic()
        _wait_page(driver, HEAD_TTL_S + 15, lambda p: ids["c"] not in p["peers"])
        gone_s = time.monotonic() - killed
        assert gone_s <= HEAD_TTL_S + 15, gone_s
        assert sorted(_page(driver)["peers"]) == sorted([ids["a"], ids["b"]])
    finally:
        driver.quit()


@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_a_private_swarms_page_shows_only_listed_keys(swarm: LocalSwarm, tmp_path: Path) -> None:
    """Issue 20, item 2: read under an allowlisted key with the run's allowlist, the page lists
    the two listed peers and never a key off the list that runs alongside them (its heads are
    dropped); an allowlist signed by someone else than the run owner is one line, exit 2."""
    owner, member, watcher, stranger, rogue = (Identity.generate() for _ in range(5))
    keys = {}
    for name, identity in (("owner", owner), ("member", member), ("watcher", watcher),
                           ("stranger", stranger), ("rogue", rogue)):  # fmt: skip
        keys[name] = tmp_path / f"{name}.key"
        identity.save(keys[name])
    allowlist, rogue_list = tmp_path / "allowlist", tmp_path / "rogue-list"
    # the page reads under a listed key of its own: a key is one live node at a time
    listed_keys = [owner.public_key, member.public_key, watcher.public_key]
    Allowlist.create(owner, "t", listed_keys).save(allowlist)
    Allowlist.create(rogue, "t", [rogue.public_key, member.public_key]).save(rogue_list)
    private = ["--allowlist", str(allowlist)]
    a, log_a = swarm.start("owner", *NANO, "--identity", str(keys["owner"]), *private)
    maddr = swarm.address(log_a, 90, proc=a)
    swarm.start("member", "--swarm", maddr, "--identity", str(keys["member"]), *private)
    swarm.start("stranger", "--swarm", maddr, "--identity", str(keys["stranger"]))
    port = _free_port()
    _start_dashboard(
        swarm, maddr, port, "--identity", str(keys["watcher"]), "--allowlist", str(allowlist)
    )
    listed = {owner.peer_id_str, member.peer_id_str}
    deadline, seen = time.monotonic() + 180, set()
    while seen != listed:
        assert time.monotonic() < deadline, (seen, (swarm.folder / "dashboard.err").read_text())
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/swarm", timeout=10) as r:
                doc = json.loads(r.read())
            seen = {p["peer_id"] for p in doc["peers"]}
            assert stranger.peer_id_str not in seen
        except (urllib.error.URLError, ConnectionError):
            pass  # not serving yet
        time.sleep(1.0)
    # the stranger has been running all along (it publishes heads of its own)
    assert swarm.wait_event(tmp_path / "stranger.jsonl", "start", 60)
    assert stranger.peer_id_str not in {p["peer_id"] for p in doc["peers"]}
    _one_line_exit_2(_dashboard("--swarm", maddr, "--run", "t", "--port", "0", "--identity",
                                str(keys["rogue"]), "--allowlist", str(rogue_list)),
                     "signed by")  # fmt: skip
