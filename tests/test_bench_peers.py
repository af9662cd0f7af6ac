"""tritonllm-bench-peers' choice of llm_inflight's client and settings (the peers themselves run
outside the suite)."""

from tritonllm.bench.peers.bench import client_args, inflight_engine_config, inflight_repository


def test_inflight_streams_over_sse_like_the_peers_unless_told_otherwise():
    assert client_args("sse", []) == ["--protocol", "http"]
    assert client_args("grpc", ["--max-requests", "9"]) == ["--protocol", "grpc", "--max-requests", "9"]
    assert client_args("sse", ["--protocol", "grpc"]) == ["--protocol", "grpc"]  # what follows `--` wins


def test_the_served_and_in_process_engines_get_the_slots_and_batch_invariance_asked_for(tmp_path):
    """The served model reads config.pbtxt; the in-process run builds its engine from the same file."""
    for invariant in (True, False):
        repository = inflight_repository(32, tmp_path / str(invariant), batch_invariant=invariant)
        config = inflight_engine_config(repository)
        assert config.max_num_seqs == 32
        assert config.batch_invariant is invariant
        assert config.num_kv_blocks == 256  # the rest as shipped
