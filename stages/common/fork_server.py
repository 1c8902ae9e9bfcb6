"""`python -m alignflow.stages.common.fork_server`: a kept process with the ML stack imported that forks stage
processes for the runs of one workdir.

What it is for: start-up. A stage process spends ~6 s of CPU importing torch, transformers and MLflow
(docs/performance.md#start-up); the warm stage process (warm.py) overlaps that with the CLI's own start, but
on a small machine the two compete and the RL stage's first iteration waits for the imports. This process
imports them once (warm.warm_up, the collector off) and is kept between runs (flows/kept_server.py: a lease
per run using it, it exits ALIGNFLOW_KEEP_S seconds after the last one let go). A launch (flows/launch.py)
connects to its Unix socket and sends one JSON line, {"stage", "argv", "env", "cwd"}, with the write end of
the pipe that is to be the stage's stdout and stderr; this process forks, answers {"pid": the child's}, and
the child runs the stage program's `main(argv)` in that folder with that environment, exactly as the warm
process would. When the child exits, this process writes {"exit": code} to the connection and closes it. A
child whose launcher goes away (the connection closes: the CLI was stopped or killed) is stopped with SIGTERM.

Forking is safe here for the reasons of stages/common/forking.py: nothing has computed, so no native thread
pool has started; the server checks that before every fork (and refuses the launch otherwise: the launcher
then starts a process of its own). What it is not: a server for anyone else. Its socket is in a folder only
its user can enter, and it answers only its own user's processes (SO_PEERCRED).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path

from alignflow import console
from alignflow.flows.kept_server import CHECK_EVERY_S, KeptServer, exit_on_sigterm
from alignflow.import_gc import imports_without_gc
from alignflow.stages.common import forking

REQUEST_LIMIT = 4 << 20  # bytes: a request is argv and an environment


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request line and the file descriptors sent with it; ValueError when it is not one."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 4)
    while not data.endswith(b"\n"):
        if not data or len(data) > REQUEST_LIMIT:
            for fd in fds:
                os.close(fd)
            raise ValueError("the connection closed before a whole request line")
        more = conn.recv(1 << 16)
        if not more:
            data = b""
            continue
        data += more
    try:
        request = json.loads(data)
        if not (isinstance(request, dict) and isinstance(request.get("argv"), list) and len(fds) == 1):
            raise ValueError("a request is {stage, argv, env, cwd} with one file descriptor")
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def run_child(request: dict, out_fd: int, conn: socket.socket) -> int:
    """In the forked child: become the stage process the request describes, run it, return its exit code."""
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in request["env"].items()})
    # The launcher's end of the connection closes when it exits: then this stage has nobody to report to.
    threading.Thread(target=_stop_when_closed, args=(conn,), name="launcher", daemon=True).start()
    forking.mark_clean()  # this child has computed nothing either: it may fork the PPO critic
    from alignflow.contract import stage_program

    name = stage_program(request["stage"])
    sys.argv = [name, *request["argv"]]
    return int(importlib.import_module(name).main(list(request["argv"])) or 0)


def _stop_when_closed(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while conn.recv(1 << 10):
            pass
    os.kill(os.getpid(), signal.SIGTERM)


def _send(conn: socket.socket, reply: dict) -> None:
    with contextlib.suppress(OSError):  # the launcher went away: its child is stopped, nothing to tell
        conn.sendall(json.dumps(reply).encode() + b"\n")


def serve(listener: socket.socket, kept: KeptServer, keep_s: float) -> None:
    """Accept launches until unused for keep_s seconds (no live lease and no child running)."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    children: dict[int, socket.socket] = {}  # pid -> its launcher's connection
    last_used = time.monotonic()
    while True:
        for key, _events in selector.select(timeout=CHECK_EVERY_S):
            if key.data is None:
                _accept(listener, selector, children)
            else:  # a child's pidfd: it exited
                pid, pidfd = key.data
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                conn = children.pop(pid)
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
        if children or kept.live_leases():
            last_used = time.monotonic()
        elif time.monotonic() - last_used >= keep_s:
            if kept.retire():
                return
            last_used = time.monotonic()


def _accept(listener: socket.socket, selector, children: dict[int, socket.socket]) -> None:
    conn, _ = listener.accept()
    try:
        if not same_user(conn):
            conn.close()
            return
        conn.settimeout(10)
        request, (out_fd,) = read_request(conn)
        conn.settimeout(None)
    except (OSError, ValueError) as exc:
        print(f"fork server: refused a launch: {exc}", file=sys.stderr, flush=True)
        conn.close()
        return
    if not forking.can_fork():
        os.close(out_fd)
        _send(conn, {"refused": "a native thread started in the fork server"})
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the loop
        code = 1
        try:
            listener.close()
            for other in children.values():
                other.close()
            code = run_child(request, out_fd, conn)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported as the stage process's own traceback would be
            import traceback

            traceback.print_exc()
        from alignflow.process_exit import end_process

        end_process(code)
    os.close(out_fd)
    _send(conn, {"pid": pid})
    children[pid] = conn
    pidfd = os.pidfd_open(pid)
    selector.register(pidfd, selectors.EVENT_READ, (pid, pidfd))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m alignflow.stages.common.fork_server")
    parser.add_argument("--folder", type=Path, required=True, help="the kept servers' folder")
    parser.add_argument("--key", required=True, help="this server's key there")
    parser.add_argument("--keep-s", type=float, required=True, help="exit once unused this long")
    args = parser.parse_args(argv)
    kept = KeptServer(args.folder, args.key)
    console.quiet()  # before the imports: some libraries read their switches then
    from alignflow.stages.common.warm import warm_up

    with imports_without_gc():
        warm_up()
    forking.mark_clean()
    socket_path = kept.folder / f"{kept.key}.sock"
    socket_path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(16)
    kept.publish(socket=str(socket_path), workdir=os.getcwd())
    exit_on_sigterm()  # through the `finally` below
    try:
        serve(listener, kept, args.keep_s)
    finally:
        kept.withdraw()
        listener.close()
        socket_path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    exit_code_ = main()
    from alignflow.process_exit import end_process

    end_process(exit_code_)
