"""Locust load tests and the side-by-side report (installed as `tritonllm_loadtest`)."""
