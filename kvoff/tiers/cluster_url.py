"""Parsing of a Redis Cluster URL (``remote_url``), kept apart from
:mod:`kvoff.tiers.redis_cluster` so that the configuration can check the URL without importing
redis-py (an optional extra)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["parse_cluster_url"]


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Startup nodes and connection options from ``redis://[user:pass@]host:port[,host:port...]``
    (``rediss://`` for TLS).

    Returns:
        ``([(host, port), ...], {"username", "password", "ssl"} options)``.

    Raises:
        ValueError: not a redis:// or rediss:// URL, or a node without host or port.
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
        try:
            parsed = urlsplit(f"//{part}")
            host, port = parsed.hostname, parsed.port
        except ValueError as e:
            raise ValueError(f"remote_url={url!r}: bad node {part!r} ({e})") from None
        if not host or port is None:
            raise ValueError(
                f"remote_url={url!r}: node {part!r} needs host:port (e.g. redis://10.0.0.5:7000)"
            )
        nodes.append((host, port))
    options: dict[str, Any] = {"ssl": scheme == "rediss"}
    if auth:
        user, _, password = auth.partition(":")
        options["username"] = unquote(user) or None
        options["password"] = unquote(password) or None
    return nodes, options
