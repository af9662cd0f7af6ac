"""Benchmark commands (tritonllm-bench-*): the top layer, beside the load test. Nothing below imports them."""
