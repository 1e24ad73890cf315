"""A real multi-node Ray cluster on one machine: one network namespace per node.

Each node gets its own network stack (a veth on a private bridge, its own address from the
benchmark range 198.18.0.0/15, its own loopback) and runs `ray start` inside it, so node
addresses, interface selection, partitions and node loss are real. Traffic only goes to
addresses inside namespaces this module created.

Needs root with CAP_NET_ADMIN (`ip netns`); `NetnsCluster.available()` says why not.
Teardown kills every process by the PIDs in each namespace (never `ray stop`, which would
kill every Ray process on the machine, the test session's own cluster included) and
removes every namespace, link and temp dir, also after a failed test.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from service.cluster.front_door import FRONT_DOOR_ENV
from tests.conftest import TEST_CLUSTER_ENV

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
HEAD_PORT = 6379
SERVE_PORT = 8000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@dataclass
class Node:
    name: str  # network namespace
    ip: str
    host_veth: str
    temp_dir: str
    num_cpus: float
    num_gpus: int
    head: bool = False
    alive: bool = True


# Where the last cluster's head left its Serve logs (NetnsCluster.shutdown).
KEPT_LOGS = Path(tempfile.gettempdir()) / "gangserve-netns-serve-logs"


@dataclass
class NetnsCluster:
    """Build with `start()`, always `shutdown()` (the fixture does)."""

    num_cpus_per_node: float = 2
    # False: every node its own GANGSERVE_STATE_DIR (no shared directory; records and
    # artifacts must then live in a database and a bucket, given through `extra_env`).
    shared_state: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    servers: dict[str, object] = field(default_factory=dict)  # what the test runs for the cluster
    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000:04d}")
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.subnet = f"198.18.{100 + os.getpid() % 150}"
        self.bridge = f"gsbr{self.tag}"
        self.bridge_mac = f"02:67:73:00:{self.tag[:2]}:{self.tag[2:]}"  # locally administered, unicast
        self.token = secrets.token_hex(32)
        self.work = Path(tempfile.mkdtemp(prefix=f"gs-netns-{self.tag}-"))
        self.state_dir = self.work / "state"  # shared storage: every node sees this path
        self.state_dir.mkdir(mode=0o700)
        self.api_token = secrets.token_urlsafe(24)
        self._bridge_up = False

    # -- capability ----------------------------------------------------------------------
    @staticmethod
    def available() -> str | None:
        """None if namespaces can be built here, else why not."""
        if shutil.which("ip") is None:
            return "iproute2's `ip` is not installed"
        if os.geteuid() != 0:
            return "needs root (CAP_NET_ADMIN) for ip netns"
        probe = f"gsprobe{os.getpid() % 100000}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    # -- life cycle ------------------------------------------------------------------------
    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def url(self) -> str:
        return f"http://{self.head.ip}:{SERVE_PORT}"

    @property
    def gateway(self) -> str:
        """The host's address on the cluster's bridge: where servers the test runs for the
        cluster (a database, an object store) listen so every node can reach them."""
        return f"{self.subnet}.1"

    def node_state_dir(self, node: Node) -> Path:
        """`node`'s GANGSERVE_STATE_DIR: the shared one, or its own (`shared_state=False`)."""
        return self.state_dir if self.shared_state else self.work / f"state-{node.name}"

    def wipe_state(self, node: Node) -> None:
        """Empty `node`'s own state dir (a pod restarted with a fresh emptyDir)."""
        path = self.node_state_dir(node)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700)

    def env(self, node: Node | None = None) -> dict[str, str]:
        """The environment of every process of this cluster (Ray token auth on), on `node`
        (default the head)."""
        node = node or (self.nodes[0] if self.nodes else None)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "GANGSERVE_"))}
        state = self.node_state_dir(node) if node is not None else self.state_dir
        state.mkdir(mode=0o700, exist_ok=True)
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.token,
            GANGSERVE_STATE_DIR=str(state),
            GANGSERVE_API_TOKEN=self.api_token,
            PYTHONPATH=str(ROOT),
            **FRONT_DOOR_ENV,  # the product's front door, as the KubeRay manifest sets it
            **TEST_CLUSTER_ENV,  # a stopping ingress replica's 30 s window: shortened (tests/conftest.py)
            **self.extra_env,
        )
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the service must choose by itself
            env.pop(var, None)
        return env

    def start(self, gpus_per_node: list[int], before_nodes: Callable[[], None] | None = None) -> "NetnsCluster":
        """Bridge, then `before_nodes()` (servers binding the gateway address, which exists
        from now on), then one node per entry of `gpus_per_node`."""
        # A fixed MAC: a bridge without one takes the lowest MAC of its ports, so a node added
        # later (add_node after a node loss) can change it, and every node's ARP entry for the
        # gateway then names a MAC the bridge no longer answers to: their packets to the host
        # (the tests' clients, PostgreSQL, S3) are dropped until that entry is resolved again,
        # seconds later (the node-loss test's "held answers": logged as sent by HAProxy, never
        # received). A bridge given its address keeps it.
        _ip("link", "add", self.bridge, "address", self.bridge_mac, "type", "bridge")
        self._bridge_up = True
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        if before_nodes is not None:
            before_nodes()
        for gpus in gpus_per_node:
            self.add_node(num_gpus=gpus)
        return self

    def add_node(self, num_gpus: int = 0) -> Node:
        index = len(self.nodes) + 1
        node = Node(
            name=f"gs{self.tag}n{index}", ip=f"{self.subnet}.{index + 1}", host_veth=f"gsv{self.tag}n{index}",
            temp_dir=str(self.work / f"ray-n{index}"), num_cpus=self.num_cpus_per_node, num_gpus=num_gpus,
            head=not self.nodes,
        )
        _ip("netns", "add", node.name)
        self.nodes.append(node)
        _ip("link", "add", node.host_veth, "type", "veth", "peer", "name", "eth0", "netns", node.name)
        _ip("link", "set", node.host_veth, "master", self.bridge)
        _ip("link", "set", node.host_veth, "up")
        _ip("-n", node.name, "addr", "add", f"{node.ip}/24", "dev", "eth0")
        _ip("-n", node.name, "link", "set", "eth0", "up")
        _ip("-n", node.name, "link", "set", "lo", "up")
        self._ray_start(node)
        return node

    def _ray_start(self, node: Node) -> None:
        cmd = [RAY, "start", f"--node-ip-address={node.ip}", f"--temp-dir={node.temp_dir}",
               f"--num-cpus={node.num_cpus}", f"--num-gpus={node.num_gpus}", "--disable-usage-stats"]
        if node.head:
            # Node loss is noticed in ~5 s instead of ~30 s (so the tests stay short).
            cmd += ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false",
                    '--system-config={"health_check_period_ms": 1000, "health_check_failure_threshold": 5}']
        else:
            cmd += [f"--address={self.head.ip}:{HEAD_PORT}"]
        if node.head:
            self._start_front_door_log(node)
        for attempt in range(3):
            try:
                self.run_in(node, cmd, timeout_s=120)
                break
            except RuntimeError as exc:
                # Ray waits a fixed 30 s for its own raylet to register; on a loaded 2-core
                # machine a start can miss that. Clear what the attempt left and try again.
                if "timed out during startup" not in str(exc) or attempt == 2:
                    raise
                self.kill_node(node)
        node.alive = True

    @property
    def front_door_log(self) -> Path:
        return self.work / "front-door.log"

    def _start_front_door_log(self, head: Node) -> None:
        """HAProxy's access log on the head (Serve renders `log 127.0.0.1:514`, UDP syslog, in the
        head's own namespace) appended to `front_door_log`, each line after its arrival's
        wall-clock time: what the front door saw of a request a fault test finds unanswered.
        The sink is one of the head's processes: a head kill stops it, a head start starts it."""
        sink = ("import socket, sys, time\n"
                "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('127.0.0.1', 514))\n"
                "out = open(sys.argv[1], 'a', buffering=1)\n"
                "while True:\n"
                "    line = s.recv(65535).decode('utf-8', 'replace').strip()\n"
                "    out.write(f'{time.time():.3f} {line}\\n')\n")
        subprocess.Popen(["ip", "netns", "exec", head.name, sys.executable, "-c", sink, str(self.front_door_log)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def front_door_lines(self, since_wall: float, until_wall: float) -> list[str]:
        """The front door's access-log lines that arrived in [since_wall, until_wall] (time.time())."""
        try:
            text = self.front_door_log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        lines = []
        for line in text.splitlines():
            stamp, _, rest = line.partition(" ")
            try:
                at = float(stamp)
            except ValueError:
                continue
            if since_wall <= at <= until_wall:
                lines.append(rest)
        return lines

    def restart_all(self, wipe_state: bool) -> None:
        """A full restart: every process of every node killed, then Ray started again on the
        same nodes (a new cluster: new GCS, nothing of the old one survives); with
        `wipe_state`, every node's own state dir is emptied first (fresh pods)."""
        for node in reversed(self.nodes):
            self.kill_node(node)
        for node in self.nodes:
            if wipe_state:
                self.wipe_state(node)
        self._ray_start(self.head)
        # The other nodes join the new head side by side: a `ray start` is mostly waiting
        # (its raylet's registration), ~5-10 s a node here, and nodes of a real cluster come
        # back together too. Each start is bounded (run_in's timeout, three attempts).
        workers = [node for node in self.nodes if not node.head]
        with ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
            for done in [pool.submit(self._ray_start, node) for node in workers]:
                done.result()

    def run_in(self, node: Node, cmd: list[str], timeout_s: float, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside `node`'s namespace with the cluster's environment."""
        done = subprocess.run(["ip", "netns", "exec", node.name, *cmd], env=self.env(node), capture_output=True,
                              text=True, timeout=timeout_s, cwd=str(ROOT))
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} in {node.name} exited {done.returncode}:\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def python(self, code: str, timeout_s: float = 240, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Python driver on the head node (it connects to this cluster)."""
        return self.run_in(self.head, [sys.executable, "-c", code], timeout_s=timeout_s, check=check)

    def pids(self, node: Node) -> list[int]:
        out = _ip("netns", "pids", node.name, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def kill_node(self, node: Node) -> None:
        """Every process of the node dies at once (SIGKILL), as in a machine loss."""
        for _ in range(5):  # a dying raylet may still be forking workers
            pids = self.pids(node)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        node.alive = False

    def link(self, node: Node, up: bool) -> None:
        """Cut (or restore) the node's only network link: a partition, its processes keep running."""
        _ip("-n", node.name, "link", "set", "eth0", "up" if up else "down")

    def shutdown(self) -> None:
        for node in reversed(self.nodes):
            self.kill_node(node)
        for node in self.nodes:
            _ip("link", "del", node.host_veth, check=False)
            _ip("netns", "del", node.name, check=False)
        if self._bridge_up:
            _ip("link", "del", self.bridge, check=False)
        self._keep_serve_logs()
        shutil.rmtree(self.work, ignore_errors=True)

    def _keep_serve_logs(self) -> None:
        """The head's Serve logs (the ingress's request lines, the replicas' warnings) and the
        front door's access log outlive the
        cluster in KEPT_LOGS, replaced by each run: a fault test's failure can be read after it."""
        logs = Path(self.nodes[0].temp_dir) / "session_latest" / "logs" / "serve" if self.nodes else None
        if logs is not None and logs.is_dir():
            shutil.rmtree(KEPT_LOGS, ignore_errors=True)
            shutil.copytree(logs, KEPT_LOGS, dirs_exist_ok=True)
            if self.front_door_log.exists():
                shutil.copy(self.front_door_log, KEPT_LOGS / self.front_door_log.name)
