"""``kvoff pool serve|status|stop``: the node pool shared by every engine on a machine
(:mod:`kvoff.node_pool`)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvoff.tools.cli.common import (
    add_format_option,
    add_json_option,
    check_format,
    non_negative_int,
    parse_bytes,
    positive_int,
    run_info,
    write_json,
)

__all__ = ["DEFAULT_SOCKET", "add_parser", "run_serve", "run_status", "run_stop"]

DEFAULT_SOCKET = os.path.join(
    os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"kvoff-pool-{os.getuid()}.sock"
)
"""Where ``kvoff pool`` listens by default: ``$XDG_RUNTIME_DIR/kvoff-pool-<uid>.sock`` (or
under ``/tmp``)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers ``kvoff pool`` and its subcommands on the ``kvoff`` subparsers."""
    pp = sub.add_parser(
        "pool",
        help="the node pool: one CPU pool in shared memory for every engine on this machine",
        description=(
            "A CPU pool in /dev/shm with one index and one eviction policy for every engine on "
            "this machine, served on a Unix socket (docs/node-pool.md). Engines attach with "
            "node_pool=<socket>; a block stored by one is a hit for all with the same layout."
        ),
    )
    ps = pp.add_subparsers(dest="pool_command", required=True)
    serve = ps.add_parser("serve", help="run the pool (in the foreground; SIGTERM stops it)")
    serve.add_argument("--socket", default=DEFAULT_SOCKET, help=f"(default: {DEFAULT_SOCKET})")
    size = serve.add_mutually_exclusive_group(required=True)
    size.add_argument("--bytes", type=parse_bytes, help="pool size, e.g. 64GiB")
    size.add_argument("--slots", type=positive_int, help="pool size in CPU blocks")
    serve.add_argument(
        "--slot-bytes",
        type=positive_int,
        required=True,
        help="bytes of one CPU block: the engines' bytes per offloaded block (kvoff plan "
        "prints it; every engine that attaches must use it)",
    )
    serve.add_argument("--policy", default="lru", help="eviction policy (default: lru)")
    serve.add_argument(
        "--region",
        default=None,
        help="the shared-memory name of the slots, /dev/shm/NAME (default: kvoff-node-pool)",
    )
    serve.add_argument(
        "--group",
        type=int,
        default=None,
        help="a group id whose processes may attach too (default: only this user)",
    )
    serve.add_argument(
        "--ranks",
        type=positive_int,
        default=1,
        help="the engines' tensor-parallel size: a region of --slots slots of --slot-bytes "
        "(one rank's bytes of a block) per rank, NAME-rank<r> (default: 1)",
    )
    serve.add_argument(
        "--lease-ms",
        type=positive_int,
        default=500,
        help="milliseconds a look-up's ready blocks stay pinned for the engine that asked, "
        "so that its load cannot fail (default: 500; docs/node-pool.md)",
    )
    serve.add_argument(
        "--spin-us",
        type=non_negative_int,
        default=500,
        help="microseconds the pool polls without sleeping after a call: lower round-trip "
        "latency for a core while engines call (default: 500; 0: never)",
    )
    serve.add_argument(
        "--reserve-blocks",
        type=non_negative_int,
        default=None,
        help="slots each engine may hold reserved, so that its stores need no round trip "
        "(default: 1/16 of the slots; 0: none; none with tiers; docs/node-pool.md)",
    )
    tiers = serve.add_argument_group(
        "tiers below the pool (every block written through; a look-up that misses the slots "
        "promotes from them; KVOFF_SHARED_SECRET, if set, is the blocks' MAC key)"
    )
    tiers.add_argument("--disk-path", default=None, help="a folder for the disk tier")
    tiers.add_argument(
        "--disk-bytes", type=parse_bytes, default=None, help="the disk tier's size, e.g. 1TiB"
    )
    tiers.add_argument("--remote-url", default=None, help="a Redis Cluster, redis://host:port")
    tiers.add_argument(
        "--remote-namespace", default="kvoff", help="key prefix in Redis (default: kvoff)"
    )
    metrics = serve.add_argument_group("Prometheus metrics (the metrics extra)")
    metrics.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve the pool's metrics (blocks; per engine: looked up, hit, stored, loaded) on "
        "http://HOST:PORT/metrics (default: none; 0: a free port, printed)",
    )
    metrics.add_argument(
        "--metrics-host", default="127.0.0.1", help="address to serve them on (default: 127.0.0.1)"
    )
    serve.set_defaults(run=run_serve)
    status = ps.add_parser("status", help="blocks, engines attached, hit rates, evictions")
    status.add_argument("--socket", default=DEFAULT_SOCKET, help=f"(default: {DEFAULT_SOCKET})")
    add_format_option(status, "the status")
    add_json_option(status)
    status.set_defaults(run=run_status)
    stop = ps.add_parser("stop", help="stop the pool cleanly (engines fall back to misses)")
    stop.add_argument("--socket", default=DEFAULT_SOCKET, help=f"(default: {DEFAULT_SOCKET})")
    stop.set_defaults(run=run_stop)


def run_serve(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff pool serve``: serves until SIGTERM or SIGINT; returns 0.

    Raises:
        ValueError: a pool smaller than one slot, a server already on the socket, or a
            metrics address that cannot be served (``--metrics-port`` taken).
        kvoff._optional.MissingExtraError: ``--metrics-port`` without prometheus-client.
    """
    from kvoff.node_pool import DEFAULT_REGION, NodePoolServer
    from kvoff.node_pool.successors import FILE_NAME as SUCCESSORS_FILE

    # --bytes is the whole pool's, every rank's region together
    slots = args.slots if args.slots is not None else args.bytes // (args.slot_bytes * args.ranks)
    if slots < 1:
        raise ValueError(
            f"--bytes {args.bytes} holds no slot of {args.slot_bytes} bytes; give more bytes"
        )
    tiers = _tiers(args)
    server = NodePoolServer(
        args.socket, slots, args.slot_bytes, policy=args.policy,
        region=args.region or DEFAULT_REGION, group=args.group, lease_s=args.lease_ms / 1000,
        spin_s=args.spin_us / 1e6, tiers=tiers, ranks=args.ranks,
        reserve_blocks=args.reserve_blocks,
        successors_path=(
            None if args.disk_path is None else Path(args.disk_path) / SUCCESSORS_FILE
        ),
    )  # fmt: skip
    httpd = None
    if args.metrics_port is not None:
        from kvoff.node_pool.metrics import serve_metrics

        try:
            httpd, _ = serve_metrics(server, args.metrics_port, args.metrics_host)
        except BaseException as e:  # leave no region or socket behind
            server.close()
            if isinstance(e, OSError):  # (the port is taken, or not this machine's address)
                raise ValueError(
                    f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: "
                    f"{e.strerror or e}; give another --metrics-port (0: a free one) or "
                    "--metrics-host"
                ) from e
            raise
    gib = slots * args.slot_bytes * args.ranks / 2**30
    print(
        f"kvoff pool: serving {slots} slots of {args.slot_bytes} bytes ({gib:.2f} GiB, "
        f"{args.policy}) in /dev/shm/{', /dev/shm/'.join(server.regions)}"
        f"{' (adopted)' if server.adopted else ''} on {server.socket_path}"
        + "".join(f"; tier {t.name}" for t in tiers)
        + (
            ""
            if httpd is None
            else f"; metrics on http://{args.metrics_host}:{httpd.server_port}/metrics"
        ),
        file=sys.stderr,
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        if httpd is not None:
            httpd.shutdown()
    kept = server.regions_kept
    if server.successors_save_error is not None:
        print(
            f"kvoff pool: the successor map was not saved ({server.successors_save_error}): "
            "the next pool promotes chains from the disk a key at a time",
            file=sys.stderr,
        )
    print(
        "kvoff pool: stopped"
        + (
            f"; /dev/shm/{', /dev/shm/'.join(kept)} kept: engines still map it. A pool started "
            f"with --region {server.region} adopts it (they hit again at once); the last engine "
            "to let it go removes it"
            if kept
            else ""
        ),
        file=sys.stderr,
    )
    return 0


def _port(text: str) -> int:
    """A TCP port, 0..65535 (argparse type).

    Raises:
        argparse.ArgumentTypeError: naming the value and the range.
    """
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535)")
    return port


def _tiers(args: argparse.Namespace) -> list:
    """The tiers ``--disk-path`` / ``--remote-url`` name, on the pool's block format.

    Raises:
        ValueError: ``--disk-path`` without ``--disk-bytes`` (or the reverse), a bad URL or
            secret (as :func:`kvoff.tiers.coordinator.make_tiers`).
    """
    if (args.disk_path is None) != (args.disk_bytes is None):
        raise ValueError("--disk-path and --disk-bytes go together: give both, or neither")
    if args.disk_path is None and args.remote_url is None:
        return []
    from kvoff.node_pool.pool_tiers import pool_tiers

    secret = os.environ.get("KVOFF_SHARED_SECRET")
    return pool_tiers(
        args.slot_bytes, args.ranks, disk_path=args.disk_path, disk_bytes=args.disk_bytes,
        remote_url=args.remote_url, remote_namespace=args.remote_namespace,
        shared_secret=None if secret is None else secret.encode(),
    )  # fmt: skip


def _status(socket_path: str) -> dict:
    from kvoff.node_pool import NodePoolClient, NodePoolError

    try:
        client = NodePoolClient(socket_path, b"kvoff pool status", name="kvoff pool status")
        return client.status()
    except NodePoolError as e:
        raise ValueError(str(e)) from None


def run_status(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff pool status``: prints the pool's status; returns 0.

    Raises:
        ValueError: no pool answers on the socket.
    """
    check_format(args)
    st = _status(args.socket)
    if args.format == "json":
        print(json.dumps(st, indent=1))
    else:
        gib = st["num_slots"] * st["slot_bytes"] / 2**30
        print(
            f"kvoff pool (pid {st['pid']}, up {st['uptime_s']:.0f} s): {st['num_slots']} slots "
            f"of {st['slot_bytes']} bytes ({gib:.2f} GiB, {st['policy']}) in "
            f"/dev/shm/{st['region']}\n"
            f"  blocks       {st['stored_blocks']:>10,} stored, {st['free_blocks']:,} free, "
            f"{st['pending_blocks']:,} being stored, {st['reserved_blocks']:,} reserved for "
            f"engines' stores (at most {st['reserve_max']:,} each)\n"
            f"  evictions    {st['evictions']:>10,}; leases lapsed {st['leases_lapsed']:,}\n"
            f"  engines      {st['engines_attached']:>10,} attached ({st['engines_seen']:,} "
            f"seen, {st['connections_refused']:,} refused); hit rate {st['hit_rate']:.2%}"
        )
        kf = st.get("key_filter_status")
        print(
            f"  key filter   {kf['set_fraction']:>10.2%} of {kf['cells']:,} cells set"
            if kf
            else "  key filter   none (tiers below the pool answer its misses)"
        )
        for e in st["engines"]:
            if e["name"] == "kvoff pool status":
                continue
            print(
                f"    {e['name'] or '-':<20} pid {e['pid']:<8} hit rate {e['hit_rate']:.2%} "
                f"({e['hit_blocks']:,} of {e['looked_up_blocks']:,} blocks), stored "
                f"{e['stored_blocks']:,}, loaded {e['loaded_blocks']:,}, leased "
                f"{e['leased_blocks']:,}"
            )
    if args.json is not None:
        write_json(args.json, {"run": run_info(argv), "status": st})
    return 0


def run_stop(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff pool stop``: SIGTERM to the pool's process, then waits (up to 10 s) for its
    socket to go; returns 0.

    Raises:
        ValueError: no pool answers on the socket, or it did not stop in 10 s.
    """
    pid = _status(args.socket)["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while os.path.exists(args.socket) and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.path.exists(args.socket):
        raise ValueError(f"the pool (pid {pid}) did not stop within 10 s")
    print(f"kvoff pool: stopped pid {pid}", file=sys.stderr)
    return 0
