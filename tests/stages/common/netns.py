"""Two "nodes" on one box for tests: each a network namespace with its own address, hosts file and launcher.

Each namespace gets one end of a veth pair (10.231.N.1 and .2), its loopback, its own hostname (its processes
start in their own UTS namespace, `unshare --uts`) and an /etc/hosts that names both nodes (`ip netns exec`
mounts /etc/netns/<name>/hosts over /etc/hosts). So, as on two real machines, the rendezvous finds its host,
the launcher's MASTER_ADDR (its host's name) resolves to that node, and gloo binds where its peers reach it.
The two reach each other only through those addresses. Needs root, iproute2 and util-linux's `unshare`;
`why_not()` says what is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Node:
    name: str       # the namespace
    address: str    # its veth address
    interface: str  # its end of the veth pair

    def start(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`python argv` in this node's namespace (stdout and stderr piped)."""
        environment = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": self.interface,
                       **(env or {})}
        command = ["ip", "netns", "exec", self.name, "unshare", "--uts", "sh", "-c",
                   'hostname "$0" && exec "$@"', self.name, sys.executable, *argv]
        return subprocess.Popen(command, cwd=cwd, env=environment, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def pids(self) -> list[int]:
        """Every process running in this node's namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, check=True)
        return [int(pid) for pid in out.stdout.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process of the node at once (a node lost, as far as its peers can tell)."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids


def why_not() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI has it)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "no `ip` (iproute2) or `unshare` (util-linux) to make the namespaces with"
    probe = f"alignflow-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def make_two_nodes(tag: str) -> tuple[Node, Node]:
    """Two namespaces joined by a veth pair, on a subnet picked from the pid (parallel sessions apart)."""
    subnet = 10 + os.getpid() % 200
    nodes = tuple(Node(f"af-{tag}-{side}", f"10.231.{subnet}.{i + 1}", f"afv{tag[:6]}{side}")
                  for i, side in enumerate("ab"))
    remove_two_nodes(nodes)
    names = "".join(f"{node.address} {node.name}\n" for node in nodes)
    for node in nodes:
        _ip("netns", "add", node.name)
        hosts = Path("/etc/netns") / node.name / "hosts"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(f"127.0.0.1 localhost\n{names}")
    a, b = nodes
    _ip("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
    for node in nodes:
        _ip("link", "set", node.interface, "netns", node.name)
        _ip("-n", node.name, "addr", "add", f"{node.address}/24", "dev", node.interface)
        _ip("-n", node.name, "link", "set", node.interface, "up")
        _ip("-n", node.name, "link", "set", "lo", "up")
    return a, b


def remove_two_nodes(nodes: tuple[Node, ...]) -> None:
    """Kill what still runs in the namespaces, then remove them (their veth ends go with them)."""
    for node in nodes:
        if subprocess.run(["ip", "netns", "pids", node.name], capture_output=True).returncode == 0:
            node.kill_all()
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / node.name, ignore_errors=True)
