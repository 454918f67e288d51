"""`diloco-peer doctor`: its estimates, verdicts and fixes without a network, and one real run
against a founding peer on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import functools
import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from diloco_peer.config import RunSpec
from diloco_peer.coordinator_free.manifest import (
    PROTOCOL_VERSION,
    Manifest,
    ManifestError,
    SignedManifest,
    SwarmSettings,
)
from diloco_peer.errors import BadInput
from diloco_peer.identity import Identity
from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm
from diloco_peer.peer.doctor import DoctorSpec, Report, verdicts
from diloco_peer.peer.doctor_checks import (
    CLOCK_FAIL_S,
    Check,
    clock_check,
    heads_offset,
    is_public,
    manifest_checks,
    peek_manifest,
    ping_offset,
    port_check,
    reachability_check,
    relay_check,
)

NANO = ["--model", "nano", "--inner-steps", "10"]
PY = list(PEER_COMMAND)

MADDR = "/ip4/127.0.0.1/tcp/31337/p2p/QmR3Jr2LgLETdxHK8uPbTvdBkfrncaffKNwcuBWv1NhT3z"
PEER = MADDR.rsplit("/", 1)[1]


def _fixes_named(check: Check) -> None:
    """Every non-pass carries a fix; every pass none."""
    assert (check.fix is not None) == (check.status in ("WARN", "FAIL")), check


# ------------------------------------------------------------------ clock


def test_ping_offset_takes_the_shortest_round_trip() -> None:
    # Their clock is 2 s ahead; the second ping had a 0.1 s round trip, the first a 1 s one
    # answered late (stamped near our receive time).
    samples = [(100.0, 102.9, 101.0), (200.0, 202.05, 200.1), (300.0, 302.4, 300.5)]
    offset, error = ping_offset(samples)
    assert offset == pytest.approx(2.0)
    assert error == pytest.approx(0.05)


def test_heads_offset_is_the_median_peers_interval() -> None:
    now = 1000.0
    # Three peers published 1, 5 and 10 s ago with our clock; one broken peer is an hour ahead.
    updated = [now - 1, now - 5, now - 10, now + 3600]
    low, high = heads_offset(updated, now, slack_s=16.0)
    assert (low, high) == pytest.approx((-3.0, 13.0))  # median of -1, -5, -10, +3600
    assert low <= 0 <= high  # our clock agrees with the majority


def test_heads_offset_bounds_a_clock_that_is_behind() -> None:
    # Our clock is 30 s ahead of everyone: the freshest heads look 30+ s old.
    now = 1000.0
    low, high = heads_offset([now - 30 - a for a in (0.5, 2, 7)], now, slack_s=16.0)
    assert high < -CLOCK_FAIL_S


@pytest.mark.parametrize(
    ("ping", "heads", "status"),
    [
        ((0.2, 0.01), None, "PASS"),
        ((1.5, 0.01), None, "WARN"),
        ((-1.5, 0.01), None, "WARN"),
        ((4.0, 0.01), None, "FAIL"),
        ((-9.0, 0.5), (-9.0, 6.0), "FAIL"),
        ((3.5, 0.6), None, "WARN"),  # 2.9 s proven: above the WARN limit, not the FAIL one
        (None, (-2.0, 14.0), "PASS"),  # the heads' interval holds 0
        (None, (5.0, 21.0), "FAIL"),  # the swarm is at least 5 s ahead
        (None, (-20.0, -4.0), "FAIL"),  # at least 4 s behind
        (None, (-17.5, -1.5), "WARN"),
        (None, None, "SKIP"),
    ],
)
def test_clock_verdict(ping: tuple | None, heads: tuple | None, status: str) -> None:
    check = clock_check(ping, heads)
    assert check.status == status, check
    if status != "SKIP":
        _fixes_named(check)
    if status in ("WARN", "FAIL"):
        assert "timedatectl set-ntp true" in check.fix
    if ping is not None:
        assert f"{abs(ping[0]):.2f} s" in check.detail


# ------------------------------------------------------------------ reachability, port, relays


def test_reachability_verdicts_and_fixes() -> None:
    local = {"own_addrs": ["/ip4/127.0.0.1/tcp/5/p2p/Qm"], "peer_addrs": [MADDR]}
    assert reachability_check({}, 0).status == "SKIP"

    refused = reachability_check({"validated": {PEER: False}, **local}, 31337)
    assert refused.status == "WARN"
    assert "open TCP port 31337 on your router" in refused.fix
    assert "--announce /ip4/PUBLIC_IP/tcp/31337" in refused.fix

    silent = reachability_check({"validated": {PEER: True}, "dial_wait_s": 20.0, **local}, 0)
    assert silent.status == "WARN" and "within 20 s" in silent.detail
    assert "--port P" in silent.fix and "--client-mode" in silent.fix

    no_time = reachability_check({"validated": {PEER: True}, "hang_ups": 0, **local}, 0)
    assert no_time.status == "SKIP" and "--timeout-s" in no_time.detail
    ok = {"validated": {PEER: True}, "dialed_back_s": 3.14}
    passed = reachability_check({**ok, **local}, 0)
    assert passed.status == "PASS" and "3.1 s" in passed.detail

    behind_nat = {"own_addrs": ["/ip4/192.168.1.7/tcp/4000/p2p/Qm"],
                  "peer_addrs": ["/ip4/8.8.8.8/tcp/31337"]}  # fmt: skip
    lan_only = reachability_check({**ok, **behind_nat}, 4000)
    assert lan_only.status == "WARN" and "192.168.1.7" in lan_only.detail
    for check in (refused, silent, passed, lan_only):
        _fixes_named(check)


def test_is_public() -> None:
    assert is_public("/ip4/8.8.8.8/tcp/1")
    assert is_public("/dns4/swarm.example.org/tcp/1")
    assert not is_public("/ip4/10.0.0.2/tcp/1")
    assert not is_public("/ip4/127.0.0.1/tcp/1")
    assert not is_public("/ip6/::1/tcp/1")
    assert not is_public("/ip4/100.64.0.1/tcp/1")  # carrier-grade NAT


def test_port_check_names_a_taken_port_and_the_fix() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        check = port_check("127.0.0.1", port)
    assert check.status == "FAIL" and str(port) in check.detail
    assert f"sport = :{port}" in check.fix and "--port" in check.fix
    assert port_check("127.0.0.1", 0).status == "PASS"
    foreign = port_check("192.0.2.1", 0)  # TEST-NET-1: not an address of this machine
    assert foreign.status == "FAIL" and "--host 0.0.0.0" in foreign.fix


def test_relays() -> None:
    circuit = "/ip4/8.8.8.8/tcp/1/p2p/QmA/p2p-circuit"
    assert relay_check([MADDR, circuit], reachable=False).status == "PASS"
    assert relay_check([MADDR], reachable=True).status == "PASS"
    none = relay_check([MADDR], reachable=False)
    assert none.status == "WARN" and none.fix


# ------------------------------------------------------------------ manifest


@pytest.fixture(scope="module")
def owner() -> Identity:
    return Identity.generate()


def _fields(signed: SignedManifest) -> dict:
    m = signed.manifest
    return {"verified": True, "owner": signed.owner_peer_id, "digest": signed.digest,
            "protocol_version": m.protocol_version, "model": m.run.model, "data": m.run.data,
            "tokenizer": m.run.tokenizer}  # fmt: skip


def test_a_compatible_manifest_passes(owner: Identity, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello swarm\n")
    signed = Manifest.create("r", RunSpec(model="nano", data=str(corpus)), SwarmSettings(), owner)
    checks = manifest_checks(_fields(signed))
    assert [c.name for c in checks] == ["manifest", "protocol", "model", "data source"]
    assert all(c.status == "PASS" for c in checks), checks


def test_a_newer_protocol_is_named_with_the_upgrade_fix(owner: Identity) -> None:
    newer = PROTOCOL_VERSION + 1
    body = Manifest(run_name="r", protocol_version=newer, run=RunSpec(), swarm=SwarmSettings(),
                    owner_public_key=owner.public_key, created=1.0)  # fmt: skip
    raw = body.sign(owner).to_bytes()
    with pytest.raises(ManifestError) as refused:  # what fetch_manifest meets in the swarm
        SignedManifest.from_bytes(raw, expected_run="r")
    checks = manifest_checks({"error": str(refused.value), "copies": 1, **peek_manifest(raw)})
    by_name = {c.name: c for c in checks}
    assert by_name["manifest"].status == "FAIL"
    protocol = by_name["protocol"]
    assert protocol.status == "FAIL"
    assert f"protocol v{newer}, this build speaks v{PROTOCOL_VERSION}" in protocol.fix
    assert protocol.fix.startswith("upgrade diloco-peer")
    assert "unverified" in protocol.detail
    older = manifest_checks({"error": "x", "copies": 1, "protocol_version": 0})
    assert "older diloco-peer release" in older[1].fix


def test_an_unknown_preset_and_missing_files_fail(owner: Identity, tmp_path: Path) -> None:
    body = Manifest.create("r", RunSpec(), SwarmSettings(), owner).manifest.to_dict()
    body["run"] = {**body["run"], "model": "9000b", "tokenizer": str(tmp_path / "tok.json")}
    raw = json.dumps({"manifest": json.dumps(body), "signature": ""})
    checks = {c.name: c for c in manifest_checks({"error": "refused", "copies": 1,
                                                  **peek_manifest(raw)})}  # fmt: skip
    assert checks["model"].status == "FAIL" and "'9000b'" in checks["model"].detail
    assert checks["model"].fix.startswith("upgrade diloco-peer")
    assert checks["data source"].status == "FAIL"  # the tokenizer file is not here
    assert "tok.json" in checks["data source"].fix


@pytest.mark.parametrize(
    ("data", "status"),
    [
        ("builtin:python-stdlib", "PASS"),
        ("builtin:no-such-corpus", "FAIL"),
        ("hf:wikitext:wikitext-2-raw-v1", "WARN"),
        ("roneneldan/TinyStories", "WARN"),
        ("/nonexistent/corpus.jsonl", "FAIL"),
    ],
)
def test_data_source_verdicts(data: str, status: str) -> None:
    fields = {"verified": True, "owner": "Qm12345678", "digest": "0" * 64, "data": data,
              "tokenizer": "bytes", "protocol_version": PROTOCOL_VERSION, "model": "nano"}  # fmt: skip
    check = manifest_checks(fields)[-1]
    assert check.name == "data source" and check.status == status, check
    _fixes_named(check)
    if status == "WARN":
        assert "needs network access to the datasets hub" in check.detail


def test_no_manifest_points_at_the_run_name() -> None:
    (check,) = manifest_checks({"error": "no manifest for run x found in the swarm", "copies": 0})
    assert check.status == "FAIL" and "--run NAME" in check.fix
    assert peek_manifest(b"\xff not json") == {}


# ------------------------------------------------------------------ spec, report


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"swarm": ("not-a-maddr",)}, "bad --swarm address"),
        ({"swarm": ("/ip4/127.0.0.1/tcp/1",)}, "/p2p/PEER_ID"),
        ({"swarm": ()}, "at least one"),
        ({"host": "localhost"}, "--host"),
        ({"port": 70000}, "--port"),
        ({"timeout_s": 0.0}, "--timeout-s"),
        ({"announce": ("/ip4/1.2.3.4/tcp/0",)}, "explicit port"),
        ({"run": "no spaces"}, "run name"),
    ],
)
def test_bad_input_is_refused(changes: dict, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        DoctorSpec(**{"swarm": (MADDR,), **changes})


def test_report_order_exit_code_and_json() -> None:
    spec = DoctorSpec(swarm=(MADDR,), port=31337)
    port = Check("port", "FAIL", "in use", "pick another")
    unreachable = verdicts({"connect_error": "failed to connect"}, port, spec)
    assert [c.name for c in unreachable] == [
        "swarm reachable", "reachable from outside", "clock offset", "port", "relays", "manifest",
    ]  # fmt: skip
    assert [c.status for c in unreachable] == ["FAIL", "SKIP", "SKIP", "FAIL", "SKIP", "SKIP"]
    report = Report(checks=unreachable, measured={"connect_error": "failed to connect"})
    assert report.exit_code == 1
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["ok"] is False and doc["checks"][0]["fix"]
    assert unreachable[0].line().startswith("FAIL  swarm reachable: ")
    assert "  -> fix: " in unreachable[0].line()

    m = {"connect_s": 2.0, "live_peers": 0, "validated": {PEER: True}, "dialed_back_s": 1.0,
         "manifest": {"error": "none", "copies": 0}}  # fmt: skip
    checks = verdicts(m, dataclasses.replace(port, status="PASS", fix=None), spec)
    assert checks[0].status == "WARN" and "--run NAME" in checks[0].fix  # no heads: wrong run?
    warned = Report(checks=[c for c in checks if c.status != "FAIL"], measured={})
    assert warned.exit_code == 0
    skipped = verdicts(m, port, spec)[1]
    assert skipped.status == "SKIP" and "31337" in skipped.detail  # fixed port taken


# ------------------------------------------------------------------ the command


@pytest.mark.timeout(60)
def test_cli_bad_maddr_exits_2_with_one_line() -> None:
    out = subprocess.run([*PY, "doctor", "--swarm", "not-a-maddr"],
                         capture_output=True, text=True, timeout=50)  # fmt: skip
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "not-a-maddr" in lines[0], out.stderr


@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_doctor_against_a_real_founder(swarm: LocalSwarm) -> None:
    _, log = swarm.start("a", *NANO)
    maddr = swarm.wait_event(log, "start", 150)["maddrs"][0]
    base = [*PY, "doctor", "--swarm", maddr, "--run", "t", "--json", "--host", "127.0.0.1",
            "--timeout-s", "90"]  # fmt: skip
    out = subprocess.run(base, capture_output=True, text=True, timeout=140)
    assert out.stdout.count("\n") == 1, out.stdout  # one JSON document, nothing else
    doc = json.loads(out.stdout)
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert out.returncode == 0, (doc, out.stderr[-2000:])
    for name in ("swarm reachable", "port", "manifest", "protocol", "model", "data source"):
        assert status[name] == "PASS", doc
    assert status["clock offset"] == "PASS", doc  # one machine, one clock
    # The founder dialed the doctor's node afresh after it hung up (its next head's store).
    assert status["reachable from outside"] == "PASS", doc
    assert doc["measured"]["live_peers"] == 1
    assert abs(doc["measured"]["clock_offset_s"][0]) < 0.5
    assert "doctor: " in out.stderr  # progress goes to stderr


@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_doctor_warns_when_nobody_can_dial_back(swarm: LocalSwarm) -> None:
    """The control of the test above: announcing a closed port, the node cannot be dialed
    afresh, and the doctor says so. (hivemind's validated ping alone still passes here: it
    rides our own connection.)"""
    _, log = swarm.start("a", *NANO)
    maddr = swarm.wait_event(log, "start", 150)["maddrs"][0]
    base = [*PY, "doctor", "--swarm", maddr, "--run", "t", "--json", "--host", "127.0.0.1",
            "--timeout-s", "90"]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    out = subprocess.run([*base, "--announce", f"/ip4/127.0.0.1/tcp/{closed}"],
                         capture_output=True, text=True, timeout=140)  # fmt: skip
    doc = json.loads(out.stdout)
    reach = next(c for c in doc["checks"] if c["name"] == "reachable from outside")
    assert reach["status"] == "WARN", doc
    assert "--announce /ip4/PUBLIC_IP/tcp/" in reach["fix"]
    assert all(doc["measured"]["validated"].values())
    assert out.returncode == 0  # a warning is not a failure


async def _forget(_dht: object, node: object, peer: str) -> bool:
    """In a founder's DHT process: drop `peer` from the routing table, as hivemind does when a
    request to it gets no answer (a store under way when the doctor hung up)."""
    from hivemind.p2p import PeerID

    table = node.protocol.routing_table  # type: ignore[attr-defined]
    node_id = table.get(peer_id=PeerID.from_base58(peer))
    if node_id is None:
        return False
    del table[node_id]
    return True


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_a_peer_that_dropped_the_doctor_at_the_hang_up_dials_it_after_the_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CI saw a false "reachable from outside" WARN once: no dial-back. A founder whose store to
    the doctor's node failed as the node hung up drops it from its routing table and stores
    its head elsewhere from then on. Two real DHT nodes on 127.0.0.1: the founder stores the
    key nearest the doctor every second but has dropped it; the doctor's first wait sees no
    dial-back, its ping puts it back, and the founder dials it after the second hang-up."""
    import threading

    from hivemind.dht import DHT
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    from diloco_peer.peer import doctor_probe

    monkeypatch.setattr(doctor_probe, "HEARTBEAT_S", 2.0)  # each wait: 2 + 5 s
    host = ["/ip4/127.0.0.1/tcp/0"]
    founder = DHT(start=True, host_maddrs=host)
    doctor = DHT(start=True, host_maddrs=host, node_id=DHTID.generate(source="heads"),
                 initial_peers=[str(a) for a in founder.get_visible_maddrs()])  # fmt: skip
    stop = threading.Event()

    def heartbeat() -> None:  # the founder's head, stored at the nodes nearest its key
        while not stop.wait(1.0):
            founder.store("heads", b"head", get_dht_time() + 30)

    beat = threading.Thread(target=heartbeat, daemon=True)
    try:
        me = doctor.peer_id.to_base58()
        forgot = founder.run_coroutine(functools.partial(_forget, peer=me), return_future=True)
        assert forgot.result(timeout=10)
        beat.start()
        peers = [founder.peer_id.to_base58()]
        m: dict[str, Any] = {"validated": dict.fromkeys(peers, True)}
        doctor_probe._dial_back(doctor, m, peers, left=lambda cap: cap, progress=lambda s: None)
    finally:
        stop.set()
        beat.join(timeout=15)
        doctor.shutdown()
        founder.shutdown()
    assert m["hang_ups"] == 2 and m["dialed_back_s"] is not None, m
    assert m["dial_wait_s"] == pytest.approx(14.0)
    check = reachability_check(m, 0)
    assert check.status == "PASS" and "the second time" in check.detail, check
