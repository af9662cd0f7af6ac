"""What a user would deploy instead of llm_inflight on the same box: llama.cpp's server and vLLM's
CPU build, installed, served and measured beside it (`tritonllm-bench-peers`). Benchmarks only:
installing them needs the network once; nothing in the tests or the served path imports this."""
