"""This machine may only talk to 127.0.0.0/8. Every address test code connects to goes through here."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


class NotLoopbackError(ValueError):
    pass


def require_loopback(target: str) -> str:
    """Return `target` (a host, an IP or a URL) if it resolves only to 127.0.0.0/8 (or ::1); raise otherwise.

    Service ClusterIPs (10.96.x.x) and anything else fail here, so a test can never send traffic off the machine."""
    host = urlsplit(target).hostname if "://" in target else target.rsplit(":", 1)[0] if target.count(":") == 1 else target
    host = (host or "").strip("[]")
    try:
        addrs = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            addrs = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(host, None)}
        except socket.gaierror as e:
            raise NotLoopbackError(f"{target!r}: cannot resolve {host!r}: {e}") from e
    bad = [a for a in addrs if not (a in LOOPBACK or a == ipaddress.ip_address("::1"))]
    if bad or not addrs:
        raise NotLoopbackError(f"{target!r} resolves to {sorted(map(str, bad))}: only 127.0.0.0/8 may be contacted here")
    return target


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((require_loopback(host), 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((require_loopback(host), port), timeout=timeout):
            return True
    except OSError:
        return False
