"""DHT requests behind a bulk transfer on a slow link (the chaotic netlab runs, issue 18 notes).

Needs root. Two hosts of a `diloco_peer.netlab.NetLab`, each link shaped to --mbit both ways. A
donor serves a state of --mbytes (`StateServer`); a reader on the other host downloads it
again and again (`download_state`, what a catch-up does) while, every half second, it stores
its subkey under one DHT key, reads the key back (what a head publish and a head read do) and
counts the peers in its routing table. The DHT's requests and the download share one libp2p
connection, so a DHT reply waits behind the state's bytes queued before it; hivemind deletes a
node from its routing table after one request unanswered for `wait_timeout` seconds (3 by
default), and a peer that lost the others from its table reads heads from its own storage only.
No Rejoiner runs here (a swarm peer's pings the lost peers back every 2 s).

Per run (one --wait-timeouts value, one repeat): the store-and-read seconds before the first
download and during the downloads (median, max), how many reads found the donor missing from
the routing table, and each download's seconds.

    python bench/dht_behind_bulk.py --mbit 1 --wait-timeouts 3,10 --repeats 2

Prints progress on stderr and one JSON document on stdout. Every process is killed by process
group and every namespace deleted on the way out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common

from diloco_peer.identity import Identity
from diloco_peer.local_swarm import kill_session, spawn
from diloco_peer.netlab import Host, NetLab

PORT = 31400
STARTUP_S = 90.0
_T0 = time.time()

# argv: role (donor|reader), its ip, its key file, wait_timeout, its output file, then the
# reader's: the donor's multiaddr, seconds to run, the state's bytes. One JSON line per report.
_WORKER = """
import json, sys, threading, time
import torch
from hivemind.dht import DHT
from hivemind.utils import get_dht_time
from safetensors.torch import save
from diloco_peer.coordinator_free.rejoin import routed_peers
from diloco_peer.coordinator_free.state_transfer import StateBlob, StateServer, download_state
from diloco_peer.p2p.service import P2PService

role, ip, key, wait_timeout, out = sys.argv[1:6]
initial = sys.argv[6:7] if role == "reader" else []
dht = DHT(start=True, host_maddrs=[f"/ip4/{ip}/tcp/{PORT}"], identity_path=key,
          initial_peers=initial, startup_timeout=30, wait_timeout=float(wait_timeout))
service = P2PService(dht)
service.start()
service.wait_until_ready(timeout_s=30)
me = dht.peer_id.to_base58()
sink = open(out, "w")

def say(**report):
    sink.write(json.dumps({"t": time.time(), **report}) + "\\n")
    sink.flush()

if role == "donor":
    numel = int(sys.argv[6]) // 4
    data = save({"x": torch.randn(numel)}, metadata={"version": "1"})
    blob = StateBlob(version=1, state_hash="a" * 64, data=data)
    server = StateServer(service, "bulk", lambda: blob)
    server.start()
    server.wait_until_ready(timeout_s=30)
    say(maddr=f"/ip4/{ip}/tcp/{PORT}/p2p/{me}")
    while True:
        time.sleep(1.0)
donor = initial[0].rsplit("/", 1)[1]
seconds, nbytes = float(sys.argv[7]), int(sys.argv[8])
end = time.time() + seconds
state = {"downloading": False}

def downloads():
    time.sleep(5.0)  # a few reads on a quiet link first
    while time.time() < end - 5.0:
        t0, state["downloading"] = time.time(), True
        try:
            got = download_state(service, "bulk", donor, timeout_s=120, max_bytes=2 * nbytes)
            say(download_s=time.time() - t0, bytes=len(got.data))
        except Exception as e:
            say(download_error=str(e)[:200])
    state["downloading"] = False

threading.Thread(target=downloads, daemon=True).start()
while time.time() < end:
    t0, during = time.time(), state["downloading"]
    try:
        dht.store("k", me, get_dht_time() + 30, subkey=me, return_future=True).result(timeout=20)
        dht.get("k", latest=True, return_future=True).result(timeout=20)
        failed = False
    except Exception:
        failed = True
    took = time.time() - t0
    table = routed_peers(dht, timeout_s=4)
    say(rw_s=took, failed=failed, donor_routed=donor in table, during=during)
    time.sleep(0.5)
say(done=True)
""".replace("{PORT}", str(PORT))


def say(text: str) -> None:
    print(f"[dht_behind_bulk {time.time() - _T0:6.1f}s] {text}", file=sys.stderr, flush=True)


def worker(host: Host, args: list[str], err: Path) -> subprocess.Popen[bytes]:
    argv = host.argv([sys.executable, "-c", _WORKER, *args])
    return spawn(argv, stderr=err, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def first_line(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if path.exists() and path.read_text().strip():
            return json.loads(path.read_text().splitlines()[0])
        if proc.poll() is not None:
            raise RuntimeError(f"the donor exited ({proc.returncode}): see {path.parent}")
        time.sleep(0.5)
    raise TimeoutError(f"the donor did not start within {timeout_s:.0f} s")


def one_run(hosts: list[Host], a: argparse.Namespace, wait_timeout: float, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    keys = []
    for i in range(2):
        keys.append(folder / f"key{i}")
        keys[-1].write_bytes(Identity.generate().to_bytes())
    nbytes = int(a.mbytes * 1e6)
    procs = []
    try:
        donor_out = folder / "donor.jsonl"
        procs.append(worker(hosts[0], ["donor", hosts[0].ip, str(keys[0]), str(wait_timeout),
                                       str(donor_out), str(nbytes)], folder / "donor.err"))  # fmt: skip
        maddr = first_line(donor_out, procs[0], STARTUP_S)["maddr"]
        reader_out = folder / "reader.jsonl"
        procs.append(worker(hosts[1], ["reader", hosts[1].ip, str(keys[1]), str(wait_timeout),
                                       str(reader_out), maddr, str(a.seconds), str(nbytes)],
                            folder / "reader.err"))  # fmt: skip
        procs[1].wait(timeout=a.seconds + STARTUP_S)
    finally:
        for proc in procs:
            kill_session(proc)
    rows = [json.loads(line) for line in reader_out.read_text().splitlines()]
    reads = [r for r in rows if "rw_s" in r]
    quiet = [r["rw_s"] for r in reads if not r["during"]]
    busy = [r["rw_s"] for r in reads if r["during"]]
    return {
        "wait_timeout_s": wait_timeout,
        "reads": len(reads),
        "reads_during_downloads": len(busy),
        "quiet_rw_s_median": statistics.median(quiet) if quiet else None,
        "busy_rw_s_median": statistics.median(busy) if busy else None,
        "busy_rw_s_max": max(busy) if busy else None,
        "failed_reads": sum(r["failed"] for r in reads),
        "donor_missing_from_table": sum(not r["donor_routed"] for r in reads),
        "first_missing_s": next(
            (round(r["t"] - reads[0]["t"], 1) for r in reads if not r["donor_routed"]), None
        ),
        "downloads_s": [round(r["download_s"], 1) for r in rows if "download_s" in r],
        "download_errors": [r["download_error"] for r in rows if "download_error" in r],
    }


def main() -> int:
    _common.exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mbit", type=float, default=1.0)
    p.add_argument("--mbytes", type=float, default=4.0, help="the state's size, MB")
    p.add_argument("--wait-timeouts", default="3,10", help="hivemind's wait_timeout, s")
    p.add_argument("--seconds", type=float, default=60.0, help="the reader's run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    folder = Path(time.strftime("/tmp/dht-bulk-%Y%m%d-%H%M%S"))
    runs = []
    with NetLab() as lab:
        hosts = [lab.add_host(up_mbit=a.mbit, down_mbit=a.mbit) for _ in range(2)]
        for rep in range(a.repeats):
            for wait_timeout in [float(w) for w in a.wait_timeouts.split(",")]:
                name = f"w{wait_timeout:g}-{rep}"
                say(f"{name}: starting")
                run = one_run(hosts, a, wait_timeout, folder / name)
                run["repeat"] = rep
                runs.append(run)
                say(f"{name}: donor missing in {run['donor_missing_from_table']} of "
                    f"{run['reads']} reads; store+read {run['quiet_rw_s_median']:.2f} s quiet, "
                    f"{run['busy_rw_s_median'] or 0:.2f} s (max {run['busy_rw_s_max'] or 0:.2f})"
                    f" during downloads of {run['downloads_s']} s")  # fmt: skip
    doc = {"command": "python bench/dht_behind_bulk.py " + " ".join(sys.argv[1:]),
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "wall_s": time.time() - _T0, "runs": runs}  # fmt: skip
    text = json.dumps(doc, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
