"""Parsing of a Redis Cluster URL (``remote_url``) and the checks of the shared tier's TTL and
timeout (``remote_ttl_s``, ``remote_timeout_s``), kept apart from
:mod:`kvoff.tiers.redis_cluster` so that the configuration can check them without importing
redis-py (an optional extra)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from kvoff.tiers.base import check_seconds

__all__ = ["MAX_TIMEOUT_S", "MAX_TTL_MS", "check_timeout_s", "check_ttl_s", "parse_cluster_url"]

MAX_TTL_MS = 2**62
"""Longest TTL in milliseconds (about 146 million years). Redis parses ``SET ... PX ms`` as a
signed 64-bit count and adds the current time in milliseconds (about 2**41 now): a count above
2**63 - 1 is refused ("value is not an integer or out of range"), one whose sum with the time
overflows is refused too ("invalid expire time"), each for every SET. 2**62 leaves room for the
clock for all time."""

MAX_TIMEOUT_S = 1e9
"""Longest per-node timeout in seconds (about 31 years): Python's sockets refuse timeouts past
about 9.2e9 s (OverflowError at ``settimeout``, which redis-py reports as an unreachable
cluster)."""


def check_ttl_s(ttl_s: Any, name: str = "ttl_s") -> int | None:
    """The TTL in milliseconds for ``SET ... PX`` (at least 1) of ``ttl_s`` seconds; None for
    None (no expiry). ``name`` is the setting named in the messages (``remote_ttl_s`` in the
    configuration).

    Raises:
        TypeError: ``ttl_s`` is not a number (a bool, str...) nor None.
        ValueError: ``ttl_s`` is NaN, infinite, not above 0, or longer than :data:`MAX_TTL_MS`.
    """
    if ttl_s is None:
        return None
    hint = "e.g. 3600, or None for no expiry"
    seconds = check_seconds(ttl_s, name, hint=hint)
    ms = max(1, round(seconds * 1000))
    if ms > MAX_TTL_MS:
        raise ValueError(
            f"{name}={ttl_s!r} is {ms} ms, longer than Redis accepts for SET PX (a signed 64-bit "
            f"count of ms added to the current time); pass at most {MAX_TTL_MS // 1000} seconds "
            f"({hint})"
        )
    return ms


def check_timeout_s(timeout_s: Any, name: str = "timeout_s") -> float:
    """``timeout_s`` as a float: a finite per-node timeout in seconds, > 0 and at most
    :data:`MAX_TIMEOUT_S`. ``name`` is the setting named in the messages.

    Raises:
        TypeError: ``timeout_s`` is not a number (a bool, str, None...).
        ValueError: ``timeout_s`` is NaN, infinite, not above 0 or above :data:`MAX_TIMEOUT_S`.
    """
    return check_seconds(timeout_s, name, hint="e.g. 0.25", maximum=MAX_TIMEOUT_S)


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Startup nodes and connection options from ``redis://[user:pass@]host:port[,host:port...]``
    (``rediss://`` for TLS).

    Returns:
        ``([(host, port), ...], {"username", "password", "ssl"} options)``.

    Nodes are written without spaces (``redis://h1:7000,h2:7000``): a node with whitespace
    (``redis://h1:7000, h2:7000``) is refused, not stripped, as is port 0.

    Raises:
        ValueError: not a redis:// or rediss:// URL, a node without host or port, a node with
            whitespace, or a port outside 1..65535.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(
            f"remote_url={url!r} is not a Redis Cluster URL; pass redis://host:port (several "
            f"startup nodes: redis://h1:7000,h2:7000; TLS: rediss://...)"
        )
    scheme, rest = url.split("://", 1)
    if scheme not in ("redis", "rediss"):
        raise ValueError(
            f"remote_url={url!r}: scheme must be redis:// or rediss://, got {scheme}; write "
            f"redis://host:port"
        )
    auth = ""
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
    rest = rest.split("/", 1)[0].split("?", 1)[0]
    nodes = []
    for part in rest.split(","):
        if any(c.isspace() for c in part):
            raise ValueError(
                f"remote_url={url!r}: node {part!r} contains whitespace; write the nodes without "
                f"spaces, e.g. redis://h1:7000,h2:7000"
            )
        try:
            parsed = urlsplit(f"//{part}")
            host, port = parsed.hostname, parsed.port
        except ValueError as e:
            raise ValueError(f"remote_url={url!r}: bad node {part!r} ({e})") from None
        if not host or port is None:
            raise ValueError(
                f"remote_url={url!r}: node {part!r} needs host:port (e.g. redis://10.0.0.5:7000)"
            )
        if port == 0:
            raise ValueError(
                f"remote_url={url!r}: node {part!r} has port 0; give the port the node listens on "
                f"(1..65535, e.g. redis://10.0.0.5:7000)"
            )
        nodes.append((host, port))
    options: dict[str, Any] = {"ssl": scheme == "rediss"}
    if auth:
        user, _, password = auth.partition(":")
        options["username"] = unquote(user) or None
        options["password"] = unquote(password) or None
    return nodes, options
