"""This machine's IPv4 addresses as other machines reach them (no Ray here: the rollout's agent endpoint and
the launch scripts' node helpers both use it)."""

from __future__ import annotations

import ipaddress
import socket


def usable(ip: str) -> bool:
    """An IPv4 address another machine could connect to: not loopback, link-local, unspecified or multicast."""
    a = ipaddress.ip_address(ip)
    return a.version == 4 and not (a.is_loopback or a.is_link_local or a.is_unspecified or a.is_multicast)


def route_source() -> str | None:
    """The source address of this machine's default route (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return None
