"""The text ``kvoff replay`` prints for a replay's totals (``ReplayResult.summary()``)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_replay", "format_tiers"]


def format_replay(s: dict[str, Any]) -> str:
    """The totals of a replay (``ReplayResult.summary()``) as the lines ``kvoff replay``
    prints: tokens and hits, blocks and bytes moved, verification, waits, and with tiers or
    ``--compute`` their lines; Belady's MIN (``device`` ``"offline"``) without transfers."""
    gib = 2**30
    on = s["store_threshold"] >= 2
    threshold = f", store_threshold {s['store_threshold']}" if on else ""
    filtered = f", {s['stores_filtered']:,} below store_threshold" if on else ""
    if s["device"] == "offline":  # Belady's MIN: simulated, no bytes moved
        text = (
            f"kvoff replay: {s['requests']} requests of trace {s['trace']!r}, Belady's MIN "
            f"(offline optimum, simulated: no bytes moved), block_size {s['block_size']}, "
            f"offloaded_block_size {s['offloaded_block_size']}\n"
            f"  pool: {s['cpu_blocks']} CPU blocks, GPU prefix cache "
            f"{s['gpu_prefix_blocks']} blocks\n"
            f"  input tokens     {s['input_tokens']:>14,}\n"
            f"  GPU hit tokens   {s['gpu_hit_tokens']:>14,}\n"
            f"  kvoff hit tokens {s['cpu_hit_tokens']:>14,}\n"
            f"  hit rate         {s['hit_rate']:>14.4%}   (full-block maximum "
            f"{s['max_hit_rate']:.4%})\n"
            f"  stored           {s['blocks_stored']:>14,} blocks; {s['stores_skipped']} "
            "skipped (no room)\n"
            f"  evictions        {s['evictions']:>14,}"
        )
        return text
    text = (
        f"kvoff replay: {s['requests']} requests of trace {s['trace']!r}, model {s['model']}, "
        f"block_size {s['block_size']}, offloaded_block_size {s['offloaded_block_size']}"
        + (f", after {s['warmup_requests']:,} warm-up requests" if s["warmup_requests"] else "")
        + "\n"
        f"  pool: {s['cpu_blocks']} CPU blocks ({s['cpu_pool_bytes'] / gib:.2f} GiB, "
        f"{s['policy']}{threshold}), GPU prefix cache {s['gpu_prefix_blocks']} blocks\n"
        f"  input tokens     {s['input_tokens']:>14,}\n"
        f"  GPU hit tokens   {s['gpu_hit_tokens']:>14,}\n"
        f"  kvoff hit tokens {s['cpu_hit_tokens']:>14,}\n"
        f"  hit rate         {s['hit_rate']:>14.4%}   (full-block maximum "
        f"{s['max_hit_rate']:.4%})\n"
        f"  stored           {s['blocks_stored']:>14,} blocks, {s['bytes_stored'] / gib:.2f} GiB "
        f"at {s['store_gbps']:.2f} GB/s; {s['stores_skipped']} skipped (no room)"
        f"{filtered}\n"
        f"  loaded           {s['blocks_loaded']:>14,} GPU blocks, {s['bytes_loaded'] / gib:.2f} "
        f"GiB at {s['load_gbps']:.2f} GB/s\n"
        f"  verified         {s['blocks_verified']:>14,} blocks, corrupted "
        f"{s['corrupted_blocks']}, failed transfers {s['failed_transfers']}\n"
        f"  evictions        {s['evictions']:>14,}\n"
        f"  waited           {s['fence_wait_s']:>14.3f} s on fences ({s['fence_waits']:,} times), "
        f"{s['retry_wait_s']:.3f} s on lookup retries ({s['lookup_retries']:,}), "
        f"{s['load_wait_s']:.3f} s on loads\n"
        f"  device           {s['device']:>14} ({s['gpu_layout']}; jobs by mechanism: "
        f"{s['mechanisms']})\n"
        f"  wall             {s['wall_s']:>14.1f} s"
    )
    if s["tiers"]:
        text += "\n" + format_tiers(s)
    if s["time_kvoff_s"] is not None:
        ideal = s["ideal_speedup"]
        text += "\n" + (
            f"  compute          {s['computed_tokens']:>14,} tokens computed, "
            f"{s['compute_flops_per_token'] / 1e9:.2f} GFLOP per token\n"
            f"  time with kvoff  {s['time_kvoff_s']:>14.3f} s (loads waited for, GEMMs)\n"
            f"  time recomputing {s['time_recompute_s']:>14.3f} s (every input token)\n"
            f"  speedup          {s['speedup']:>14.3f}x   (ideal 1/(1-hit rate) = "
            + (f"{ideal:.3f}x; {s['speedup_vs_ideal']:.1%} of it)" if ideal else "n/a)")
            + f"\n  GEMM lost        {s['gemm_lost_s']:>14.3f} s to transfers beside it "
            f"({s['gemm_s']:.3f} s vs {s['gemm_alone_s']:.3f} s alone)"
        )
    if s.get("time_with_s") is not None:
        saving = s["saving_fraction"]
        text += "\n" + (
            f"  interleaved      {s['interleaved_chunks']:>14,} chunks of "
            f"{s['interleave_requests']} requests: with kvoff, then the engine's prefix cache "
            f"alone ({s['hit_tokens_without']:,} hit tokens)\n"
            f"  time with        {s['time_with_s']:>14.3f} s   TTFT p50 "
            f"{s['ttft_p50_with_s'] * 1e3:.2f} ms, p99 {s['ttft_p99_with_s'] * 1e3:.2f} ms\n"
            f"  time without     {s['time_without_s']:>14.3f} s   TTFT p50 "
            f"{s['ttft_p50_without_s'] * 1e3:.2f} ms, p99 {s['ttft_p99_without_s'] * 1e3:.2f} ms\n"
            f"  time ideal       {s['time_ideal_s']:>14.3f} s (GEMMs for the tokens no cache hit)\n"
            f"  with / without   {s['time_with_s'] / s['time_without_s']:>14.3f}    saving "
            + ("n/a (nothing to save)" if saving is None else f"{saving:.1%} of the possible")
        )
    return text


def format_tiers(s: dict[str, Any]) -> str:
    """The replay's per-tier lines: hit tokens by source, then each tier's reads, writes,
    promotions, drops and rejected blocks."""
    t = s["tiers"]
    hits = ", ".join(f"{k} {v:,}" for k, v in s["tier_hit_tokens"].items())
    lines = [
        f"  engines          {s['engines']:>14}",
        f"  hit tokens by    {'source':>14}: {hits}",
        f"  write-through    {t['writes_queued']:>14,} blocks queued, "
        f"{t['writes_dropped_queue_full']:,} dropped (queue full); {t['probes']:,} tier probes",
    ]
    for name, x in t["tiers"].items():
        lines.append(
            f"  {name:<16} {x['promoted_blocks']:>14,} blocks promoted at "
            f"{x['promotion_gbps']:.2f} GB/s; read {x['bytes_read'] / 2**30:.2f} GiB at "
            f"{x['read_gbps']:.2f} GB/s, wrote {x['blocks_written']:,} blocks "
            f"({x['bytes_written'] / 2**30:.2f} GiB at {x['write_gbps']:.2f} GB/s); dropped "
            f"writes {x['writes_dropped']:,}; corrupted blocks rejected "
            f"{x['corrupted_blocks']:,}; timeouts {x.get('timeouts', 0):,}"
        )
    return "\n".join(lines)
