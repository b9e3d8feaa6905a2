"""The TCP listeners of a process tree, for the tests that check a local server binds loopback only
(``tests/serve/test_local_server.py``, ``tests/serve/test_serve_deploy.py``). Uses psutil (a test extra)."""

from __future__ import annotations

import ipaddress

import psutil


def listening(root_pid: int) -> dict[tuple[str, int], str]:
    """(address, port) -> process name of every TCP listener owned by ``root_pid`` or its descendants."""
    try:
        root = psutil.Process(root_pid)
        tree = {root.pid: root.name(), **{p.pid: p.name() for p in root.children(recursive=True)}}
    except psutil.NoSuchProcess:
        return {}
    return {(c.laddr.ip, c.laddr.port): tree[c.pid] for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in tree}


def is_loopback(ip: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback (gRPC servers listen on ``[::ffff:127.0.0.1]``)."""
    addr = ipaddress.ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


def outside_loopback(sockets: dict[tuple[str, int], str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split the non-loopback listeners of :func:`listening` into (unexpected, Serve's inter-deployment gRPC).

    The second holds what Ray hard-codes: each Serve replica's inter-deployment gRPC server on ``[::]:0``
    (``ray/serve/_private/replica.py``), the one listener no Ray option moves (docs/OPERATIONS.md).
    """
    outside = {f"{ip}:{port}": name for (ip, port), name in sockets.items() if not is_loopback(ip)}
    grpc = {a: n for a, n in outside.items() if n.startswith("ray::ServeReplica:") and a.startswith(":::")}
    return {a: n for a, n in outside.items() if a not in grpc}, grpc
