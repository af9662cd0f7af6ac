"""tritonllm-bench-peers' choice of llm_inflight's client (the peers themselves run outside the suite)."""

from tritonllm.peers.bench import client_args


def test_inflight_streams_over_sse_like_the_peers_unless_told_otherwise():
    assert client_args("sse", []) == ["--protocol", "http"]
    assert client_args("grpc", ["--max-requests", "9"]) == ["--protocol", "grpc", "--max-requests", "9"]
    assert client_args("sse", ["--protocol", "grpc"]) == ["--protocol", "grpc"]  # what follows `--` wins
