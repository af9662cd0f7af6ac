"""`health`: is the server live and ready, is each model ready, how is it configured, what has it served.

Over HTTP (the KServe v2 health, repository index, config and statistics endpoints).
"""

from __future__ import annotations

import sys

from tritonllm_client.errors import EXIT_MODEL
from tritonllm_client.http import HttpSession
from tritonllm_client.table import format_table


def batching_summary(config: dict) -> str:
    """The dynamic_batching block in a few words; '-' when the model has none."""
    batching = config.get("dynamic_batching")
    if batching is None:
        return "-"
    parts = []
    if batching.get("preferred_batch_size"):
        parts.append(f"preferred {batching['preferred_batch_size']}")
    delay_us = int(batching.get("max_queue_delay_microseconds", 0) or 0)
    parts.append(f"delay {delay_us / 1000:g} ms")
    return ", ".join(parts)


def model_row(session: HttpSession, entry: dict) -> list:
    name, state = entry.get("name", "?"), entry.get("state", "")
    ready = session.get(f"/v2/models/{name}/ready").status_code == 200
    row = [name, entry.get("version", ""), state or "-", "yes" if ready else "no"]
    if state != "READY":
        return row + ["-"] * 7
    config = session.get_json(f"/v2/models/{name}/config")
    decoupled = (config.get("model_transaction_policy") or {}).get("decoupled", False)
    stats = session.get_json(f"/v2/models/{name}/stats").get("model_stats", [])
    counts = {"success": 0, "fail": 0, "inference_count": 0, "execution_count": 0}
    for version in stats:
        inference = version.get("inference_stats", {})
        counts["success"] += int(inference.get("success", {}).get("count", 0))
        counts["fail"] += int(inference.get("fail", {}).get("count", 0))
        counts["inference_count"] += int(version.get("inference_count", 0))
        counts["execution_count"] += int(version.get("execution_count", 0))
    return row + [config.get("max_batch_size", 0), "yes" if decoupled else "no", batching_summary(config),
                  counts["success"], counts["fail"], counts["inference_count"], counts["execution_count"]]


def run(args) -> int:
    session = HttpSession(args.url) if args.url else HttpSession()
    try:
        live = session.get("/v2/health/live").status_code == 200
        ready = session.get("/v2/health/ready").status_code == 200
        version = session.get_json("/v2").get("version", "?")
        index = sorted(session.repository_index(), key=lambda e: (e.get("name", ""), e.get("version", "")))
        rows = [model_row(session, entry) for entry in index]
    finally:
        session.close()
    yes = {True: "yes", False: "no"}
    print(f"Triton {version} at {session.url}: live {yes[live]}, ready {yes[ready]}")
    print(format_table(["model", "version", "state", "ready", "max_batch_size", "decoupled", "dynamic_batching",
                        "ok", "failed", "inferences", "executions"], rows, right={4, 7, 8, 9, 10}))
    print("ok/failed: requests; inferences: batch rows run; executions: model executions "
          "(inferences / executions = mean batch size)", file=sys.stderr)
    not_ready = [row[0] for row in rows if row[3] != "yes"]
    if not (live and ready) or not_ready:
        what = f"models not ready: {', '.join(not_ready)}" if not_ready else "server not ready"
        print(f"error: {what}", file=sys.stderr)
        return EXIT_MODEL
    return 0
