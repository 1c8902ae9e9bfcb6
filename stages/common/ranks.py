"""A stage on several ranks: torchrun's elastic launch from the stage's own entry point, and each rank's role.

What it is: when a stage's section asks for more than one process (`<stage>.resources`), `stage_main`
hands the same command line to `launch`, which starts the ranks with `torch.distributed`'s elastic
launcher (the library behind `torchrun`); each rank runs the stage's `run(spec)` with RANK/WORLD_SIZE
set, rank 0 tracks and publishes, and the launcher reports one StageResult, so the stage contract
(one spec in, one manifest out, one result line) does not change. What it is not: a scheduler; on
many nodes each node runs this same command and they meet at `resources.rdzv_endpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from alignflow.config import ResourcesConfig
from alignflow.contract import StageSpec

# Where each rank writes its exit code and result line, so the launcher can tell which rank failed and why.
RANK_RESULTS_VAR = "ALIGNFLOW_RANK_RESULTS"
# The launcher's pid: its ranks die with it (the elastic launcher starts them in their own sessions, so a
# SIGKILL of the stage process would leave them training and writing into an output a retry re-creates).
LAUNCHER_PID_VAR = "ALIGNFLOW_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def rank() -> int:
    """This process's global rank (0 when not launched on several ranks)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    """Whether this rank tracks, writes and publishes (rank 0)."""
    return rank() == 0


def launched() -> bool:
    """Whether this process is one of the ranks a launcher started (torchrun sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_launcher() -> None:
    """Make the kernel SIGKILL this rank when the launcher that started it dies (Linux; a no-op elsewhere)."""
    launcher = os.environ.get(LAUNCHER_PID_VAR)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(launcher):  # it died before the line above: nothing would signal us
        os._exit(1)


def stage_resources(spec: StageSpec) -> ResourcesConfig:
    """The `resources` of the stage's own config section (1 x 1 when the section has none)."""
    section = spec.config.get(spec.stage)
    raw = section.get("resources") if isinstance(section, dict) else None
    return ResourcesConfig.model_validate(raw or {})


def local_share(indices: list[int]) -> list[int]:
    """This rank's contiguous share of a global batch (its length divides by the world size:
    see `check_training_section`)."""
    per_rank = len(indices) // world_size()
    return indices[rank() * per_rank:(rank() + 1) * per_rank]


def sum_over_ranks(*values: float) -> list[float]:
    """The sum of each value over all ranks (float64; no collective on one rank)."""
    if world_size() == 1:
        return list(values)
    import torch

    total = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(total)
    return total.tolist()


def from_main(value: Any) -> Any:
    """`value` as rank 0 holds it, on every rank: one broadcast of the pickled object
    (other ranks pass None). No collective on one rank."""
    if world_size() == 1:
        return value
    import torch

    box = [value if is_main() else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gathered_rows(local: Any) -> Any:
    """The ranks' equal-shaped tensors joined along dim 0 in rank order, on every rank (all_gather;
    `local` itself on one rank)."""
    if world_size() == 1:
        return local
    import torch

    parts = [torch.empty_like(local) for _ in range(world_size())]
    torch.distributed.all_gather(parts, local.contiguous())
    return torch.cat(parts)


def barrier() -> None:
    """Wait for every rank (no-op on one rank)."""
    if world_size() > 1:
        import torch

        torch.distributed.barrier()


def write_rank_result(code: int, line: str) -> None:
    """Leave this rank's exit code and result line for the launcher (no-op outside a launch)."""
    folder = os.environ.get(RANK_RESULTS_VAR)
    if folder:
        path = Path(folder) / f"rank{rank()}.json"
        path.write_text(json.dumps({"code": code, "line": line}))


# Each rank's place (node, host, address, pid) in the launcher's store, so a rank that loses a peer in a
# collective can say which node and rank it lost: the peer's launcher may have died with it, and nothing else
# will.
PLACE_KEY = "alignflow/rank-place/"
# gloo names the far end of a broken pair: "Connection closed by peer [10.0.0.2]:41234"
PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")
# NCCL's "Last error" line in torch's DistBackendError names the peer as host<port>, by name or address:
# "socketProgress: Connection closed by remote peer node-b<42830>", "NET/IB : Got completion from peer
# 10.0.35.1<49189> with error 12".
NCCL_PEER = re.compile(r"\bpeer ([A-Za-z0-9_.:-]+)<\d+>")


def peer_names(text: str) -> set[str]:
    """The addresses and host names a collective's error names as the broken connection's other end."""
    return set(PEER_ADDRESS.findall(text)) | set(NCCL_PEER.findall(text))


def _is_named(place: dict, names: set[str]) -> bool:
    """Whether a rank's recorded place (address, host) is one of `names`; a host name matches by its first
    label too, as NCCL may print the short name of a host whose gethostname() is fully qualified."""
    short = {name.split(".")[0] for name in names if not name.replace(".", "").isdigit() and ":" not in name}
    return place["address"] in names or place["host"] in names or place["host"].split(".")[0] in short


def _launcher_store(timeout_s: float):
    """A client of the store the elastic launcher's rendezvous hosts (MASTER_ADDR:MASTER_PORT), or None."""
    if not launched() or "MASTER_ADDR" not in os.environ:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def address_towards(host: str) -> str:
    """The local IP address this process reaches `host` (a name or an address) from: the one its peers see."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def record_place() -> None:
    """Write this rank's node, host, address and pid to the launcher's store (no-op outside a launch)."""
    if world_size() == 1 or not launched():
        return
    store = _launcher_store(30.0)
    place = {"node": int(os.environ.get("GROUP_RANK", "0")), "host": socket.gethostname(),
             "address": address_towards(os.environ["MASTER_ADDR"]), "pid": os.getpid()}
    store.set(f"{PLACE_KEY}{rank()}", json.dumps(place))


def lost_peer(exc: BaseException) -> str | None:
    """One line naming the node, ranks and pids behind the broken connection that `exc` reports (gloo names
    the peer's address, NCCL its host or address: peer_names), or None when it names none or the places
    cannot be read (the store's node is gone)."""
    names = peer_names(str(exc))
    if not names or not launched():
        return None
    try:
        store = _launcher_store(3.0)
        places = {r: json.loads(store.get(f"{PLACE_KEY}{r}")) for r in range(world_size())}
    except Exception:  # noqa: BLE001 - the store's node may be the one that died: say nothing more
        return None
    if _is_named(places[rank()], names):
        return None  # a rank of this node: its launcher names it, with its signal
    lost = {r: p for r, p in places.items() if _is_named(p, names)}
    if not lost:
        return None
    nodes = sorted({(p["node"], p["host"], p["address"]) for p in lost.values()})
    who = "; ".join(
        f"node {node} ({host}, {address}): "
        + ", ".join(f"rank {r} (pid {p['pid']})" for r, p in sorted(lost.items()) if p["node"] == node)
        for node, host, address in nodes)
    # gloo's first line says what broke; NCCL's first is "NCCL error in: <file>:<line>", its last the socket.
    lines = [line for line in str(exc).splitlines() if line.strip()]
    reason = (lines[-1] if NCCL_PEER.search(lines[-1]) else lines[0])[-160:]
    return (f"lost {who}, seen by rank {rank()} of {world_size()} in a collective ({reason}): its processes "
            "died or its network went; that node's own log has its signal, if its launcher lived")


def failed_rank_of(failures: dict, reports: dict) -> int:
    """The rank whose failure caused the others' (failures: torchelastic's per-rank records with `exitcode`
    and `timestamp`; reports: the ranks that wrote a result).

    A rank that died without a word (killed, or a hard crash) comes before one that reported an error, as its
    peers then report the broken connection (gloo's "Connection closed by peer" reached rank 0 in the same
    ~0.5 s monitor pass as rank 1's SIGKILL); else the first to fail. A rank ended by SIGTERM without a word
    comes last: that is the launcher stopping the survivors of another rank's failure, and it can land in the
    same monitor pass as the failure it follows."""

    def cause_order(r: int) -> tuple[int, float, int]:
        stopped_by_launcher = r not in reports and failures[r].exitcode == -signal.SIGTERM
        return (2 if stopped_by_launcher else int(r in reports), failures[r].timestamp, r)

    return min(failures, key=cause_order)


def launch(
    spec: StageSpec, module: str, argv: list[str], resources: ResourcesConfig
) -> tuple[int, str | None]:
    """Run `python -m module argv` on `resources` ranks; (exit code, the failure message for the result line,
    None when rank 0 reported on its own).

    Rank 0 prints the stage's result line itself. When it could not (another rank failed first and the
    launcher stopped it, or it was killed), the message names the first failed rank and its reason: the
    rank's own one-line error when it wrote one, else its exit code or signal.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix=f"alignflow-{spec.stage}-ranks-") as scratch:
        results_dir = Path(scratch) / "results"
        results_dir.mkdir()
        # The ranks inherit this process's environment: what they need from the launcher goes there for the
        # launch. OMP_NUM_THREADS: k ranks on a node split its cores (one OpenMP team per share) instead of k
        # teams each sized to every core, which oversubscribes them; a value the user set wins.
        for_ranks = {
            RANK_RESULTS_VAR: str(results_dir),
            LAUNCHER_PID_VAR: str(os.getpid()),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")
            or str(max(1, (os.cpu_count() or 1) // resources.nproc_per_node)),
        }
        saved = {name: os.environ.get(name) for name in for_ranks}
        os.environ.update(for_ranks)
        # Every node must name the same run: derive it from the output, which the stage's config determines.
        run_id = hashlib.sha256(spec.output_uri.encode()).hexdigest()[:16]
        config = LaunchConfig(
            min_nodes=resources.nnodes,
            max_nodes=resources.nnodes,
            nproc_per_node=resources.nproc_per_node,
            run_id=run_id,
            rdzv_backend="c10d",
            # Port 0 on one node: the launcher's store binds a free port itself (no port guessed and raced
            # for).
            rdzv_endpoint=resources.rdzv_endpoint or "127.0.0.1:0",
            # a failed rank fails the stage; the flow's retry re-runs it (and resumes where it can)
            max_restarts=0,
            # a dead rank stops the others within ~1 s instead of hanging on a collective
            monitor_interval=0.5,
            logs_specs=DefaultLogsSpecs(log_dir=str(Path(scratch) / "logs")),
        )
        failures = {}
        try:
            elastic_launch(config, sys.executable)("-m", module, *argv)
        except ChildFailedError as exc:
            failures = exc.failures
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        reports = {
            int(p.stem.removeprefix("rank")): json.loads(p.read_text())
            for p in results_dir.glob("rank*.json")
        }
    if not failures:
        if 0 in reports:
            return reports[0]["code"], None
        if resources.nnodes > 1 and reports:  # rank 0 runs on another node, and reports for the stage there
            mine = ", ".join(str(r) for r in sorted(reports))
            print(f"{spec.stage}: this node's ranks ({mine}) finished; rank 0's node publishes the output",
                  file=sys.stderr, flush=True)
            return 0, None
        return 1, f"the {resources.world_size} ranks finished but rank 0 wrote no result"
    failed_rank = failed_rank_of(failures, reports)
    report = reports.get(failed_rank)
    if failed_rank == 0 and report is not None:
        return report["code"], None  # rank 0 printed its own failure line
    where = f"rank {failed_rank} of {resources.world_size}"
    if report is not None and report["code"] != 0:
        return report["code"], f"{where}: {json.loads(report['line']).get('message', '')}"
    failure = failures[failed_rank]
    how = (
        f"killed by {signal.Signals(-failure.exitcode).name}"
        if failure.exitcode < 0
        else f"exited with code {failure.exitcode}"
    )
    return 1, f"{where} (pid {failure.pid}) {how}"
