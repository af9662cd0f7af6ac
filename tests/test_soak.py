"""`tritonllm-soak` end to end, briefly: it starts a server, saturates it with cancellations, and
reports a drained server, no errors, and RSS samples."""

from __future__ import annotations

import json

from tritonllm_loadtest.soak import main


def test_a_short_soak_serves_cancels_and_drains(tmp_path):
    out = tmp_path / "soak"
    rc = main(["--model", "tiny", "--duration", "8", "--workers", "6", "--cancel", "0.5", "--interval", "2",
               "--out", str(out), "--quiet"])
    result = json.loads((out / "soak.json").read_text())
    assert rc == 0, result["error_samples"]
    assert result["completed"] > 0 and result["cancelled"] > 0 and result["errors"] == 0
    assert result["tokens_served"] > 0
    assert not any(result["left_after_drain"].values()), result["left_after_drain"]
    assert result["rss_mb"]["max"] > 100  # tritonserver + the stub, measured
    assert len(result["samples"]) >= 3  # every 2 s over 8 s, however slow the scrapes
    assert (out / "soak.png").stat().st_size > 0
