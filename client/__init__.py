"""Command-line clients for the three models (installed as `tritonllm_client`)."""
