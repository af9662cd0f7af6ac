"""The batch-size view's pieces (loadtest/batch_sizes.py) and the shared-prefix workload."""

from __future__ import annotations

import json

from tritonllm_loadtest import batch_sizes
from tritonllm.server.repository import read_config
from tritonllm_loadtest.workload import Workload

from tritonllm.server.repository import configured_repository


def test_each_capacity_gets_a_repository_with_that_many_rows_for_every_scheme(tmp_path):
    repo = configured_repository(tmp_path, batch_sizes.capacity_settings(32, ["inflight", "dynamic", "static"]))
    assert read_config("llm_inflight", repo)[1]["max_num_seqs"] == "32"
    for model in ("llm_dynamic", "llm_static"):
        text = (repo / model / "config.pbtxt").read_text()
        assert "max_batch_size: 32" in text and "max_batch_size: 8" not in text
    assert "preferred_batch_size: [ 32 ]" in (repo / "llm_static" / "config.pbtxt").read_text()
    # a parameter the file lacks is added
    configured_repository(tmp_path / "other", {"llm_inflight": {"enable_prefix_caching": "false"}})
    assert read_config("llm_inflight", tmp_path / "other")[1]["enable_prefix_caching"] == "false"


def test_a_points_flags_replace_the_users_and_drop_the_view_flag():
    class Triton:
        http_url, grpc_url, host, metrics_port = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1", 3

    argv = ["--batch-sizes", "8,16", "--concurrency", "4", "--batch-sizes=8", "--quick"]
    out = batch_sizes.point_argv(argv, 16, Triton, "out-16", {"normalized_s": 0.5, "e2e_p90_s": 30.0}, 48)
    assert "--batch-sizes" not in " ".join(out)
    last = len(out) - 1 - out[::-1].index("--concurrency")  # argparse keeps the last
    assert out[last + 1] == "16"
    assert out[out.index("--max-requests") + 1] == "96"  # 6 x 16 > 48
    assert out[-4:] == ["--slo-normalized", "0.5", "--slo-e2e-p90", "30.0"]
    assert "--quick" in out and out.index("--quick") < out.index("--server")


def test_the_report_shows_each_scheme_against_its_own_first_capacity(tmp_path):
    def summary(inflight_tps, dynamic_tps, inflight_cap, dynamic_cap):
        return {"runs": [{"scheme": "inflight", "tokens_per_s": inflight_tps, "arrival_rate": None},
                         {"scheme": "dynamic", "tokens_per_s": dynamic_tps, "arrival_rate": None},
                         {"scheme": "inflight", "tokens_per_s": 1.0, "arrival_rate": 0.5}],
                "capacity": {"inflight": {"rate": inflight_cap, "bound": "=", "lowest_rate": 0.1},
                             "dynamic": {"rate": dynamic_cap, "bound": "=", "lowest_rate": 0.1}}}
    points = [{"batch_size": 8, **batch_sizes.point_summary(summary(200.0, 150.0, 1.0, 0.8))},
              {"batch_size": 32, **batch_sizes.point_summary(summary(400.0, 160.0, 3.0, 0.9))}]
    batch_sizes.write_report(tmp_path, points, {"normalized_s": 0.5, "e2e_p90_s": 30.0, "how": "given"})
    md = (tmp_path / "batch_sizes.md").read_text()
    assert "| 32 | 400.0 (2.00x) | 160.0 (1.07x) | 3 (3.00x) | 0.9 (1.12x) |" in md
    assert json.loads((tmp_path / "batch_sizes.json").read_text())["points"][1]["batch_size"] == 32
    assert (tmp_path / "batch_sizes.png").stat().st_size > 0


def test_a_shared_prefix_opens_every_prompt():
    workload = Workload(prompt_words="uniform:20:30", shared_prefix_words=300, seed=3)
    prompts = [workload.request(i).prompt for i in range(20)]
    prefix = prompts[0].split("\n\n")[0]
    assert len(prefix.split()) == 300
    assert all(p.startswith(prefix + "\n\n") for p in prompts)
    assert all(20 <= len(p[len(prefix):].split()) <= 30 for p in prompts)
    assert len(set(prompts)) > 10  # the rest differs
    assert not Workload(prompt_words="uniform:20:30").request(0).prompt.startswith(prefix)
