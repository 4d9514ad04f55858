"""Loopback ports for child processes (engines, backend servers) to listen on."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def listening_socket(host: str = LOOPBACK, backlog: int = 2048) -> socket.socket:
    """A socket listening on a port the kernel chose, for a child to inherit: unlike a port
    number from `free_port`, nobody can take it between the choice and the child's bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As servers bind (uvicorn does): else its connections left in TIME_WAIT when the child
        # exits keep the port from being bound again, even by a server that sets it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def free_port(host: str = LOOPBACK) -> int:
    """A port free now (for a child that can only be given a number, e.g. llama-server): it
    may be taken before the child binds it, so such a child's start must cope."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
