"""``AllowedHosts``: the trainer addresses the weight-transfer endpoints may make the server
join (``ServerConfig.weight_transfer_allowed_hosts``). Standard library only, so
``config.py`` can check the option without the ``serve`` extra."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

LOOPBACK_HOSTS = "127.0.0.1,::1,localhost"
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}"
                       r"[a-z0-9_])?)*", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class AllowedHosts:
    """Which ``master_address`` an init may name: any (``*``), a host name (matched as
    written, case aside) or an IP address inside one of the networks.

    A host name is never resolved here to match a network: torch resolves it again when it
    connects, and the two answers may differ, so networks match literal addresses only.
    """

    any_host: bool
    names: frozenset[str]
    networks: tuple[IPNetwork, ...]

    @classmethod
    def parse(cls, spec: str) -> AllowedHosts:
        """The hosts of a comma-separated ``spec``: ``*``, host names, IP addresses and CIDR
        networks (``10.0.0.0/8``, ``fd00::/8``).

        Raises:
            ValueError: for an empty spec or entry, or an entry that is none of these.
        """
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"{spec!r} names no host: give comma-separated hosts, IP "
                             f"addresses or CIDR networks (default {LOOPBACK_HOSTS!r}), or "
                             "'*' for any.")
        entries = [entry.strip() for entry in spec.split(",")]
        if "" in entries:
            raise ValueError(f"{spec!r} has an empty entry: remove the extra comma.")
        hosts = [entry for entry in entries if entry != "*"]
        networks = [_network(host) for host in hosts]
        return cls("*" in entries,
                   frozenset(_host_name(h) for h, n in zip(hosts, networks) if n is None),
                   tuple(n for n in networks if n is not None))

    def allows(self, address: str) -> bool:
        """Whether the server may join a group whose store is at ``address``."""
        if self.any_host:
            return True
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return address.lower() in self.names
        return any(ip in network for network in self.networks)


def _network(entry: str) -> IPNetwork | None:
    """``entry`` as an IP network (an address is a network of one), or None for a name."""
    try:
        return ipaddress.ip_network(entry)
    except ValueError as exc:
        if "/" in entry or ":" in entry:
            raise ValueError(f"{entry!r} is not an IP network ({exc}): give the network's "
                             "own address, e.g. 10.0.0.0/8.") from exc
        return None


def _host_name(entry: str) -> str:
    """``entry`` as a host name, lower case."""
    if not HOST_NAME.fullmatch(entry) or entry.rsplit(".", 1)[-1].isdigit():
        raise ValueError(f"{entry!r} is neither an IP address nor a host name.")
    return entry.lower()
