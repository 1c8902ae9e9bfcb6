"""stages/common/fork_server.py: what it takes as a request (launches: tests/flows/test_stage_forks.py)."""

from __future__ import annotations

import json
import os
import socket

import pytest

from alignflow.stages.common.fork_server import read_request, same_user


def _send(line: bytes, fds: list[int]) -> socket.socket:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    socket.send_fds(theirs, [line], fds)
    theirs.close()
    return ours


def test_a_request_line_arrives_with_its_pipe_even_in_pieces():
    read_fd, write_fd = os.pipe()
    request = {"stage": "data", "argv": ["--spec", "s.json"], "env": {"A": "x" * 200_000}, "cwd": "/"}
    line = json.dumps(request).encode() + b"\n"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    socket.send_fds(theirs, [line[:100]], [write_fd])
    theirs.sendall(line[100:])
    got, fds = read_request(ours)
    assert got == request and len(fds) == 1 and same_user(ours)
    os.write(fds[0], b"ok")  # the same pipe
    assert os.read(read_fd, 2) == b"ok"
    for fd in (*fds, read_fd, write_fd):
        os.close(fd)


@pytest.mark.parametrize(
    ("line", "with_pipe", "message"),
    [
        (b'{"stage": "data", "argv": []}\n', False, "one file descriptor"),
        (b'{"stage": "data"}\n', True, "one file descriptor"),
        (b"not json\n", True, "Expecting value"),
        (b'{"stage": "data", "argv": [', True, "before a whole request line"),
    ],
)
def test_what_is_not_a_request_is_refused(line, with_pipe, message):
    read_fd, write_fd = os.pipe()
    conn = _send(line, [write_fd] if with_pipe else [])
    with pytest.raises(ValueError, match=message):
        read_request(conn)
    os.close(read_fd)
    os.close(write_fd)
