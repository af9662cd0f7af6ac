"""Names of the models' metrics that others read: vLLM's twins of ours (dashboards, KEDA scalers,
the Gateway API Inference Extension), importable without Triton (tests, deployment checks)."""

# Our name -> vLLM's, for the values both define alike. vLLM's labels: model_name (ours: model) and
# finished_reason (ours: finish_reason).
VLLM_NAMES = {
    "tritonllm_prompt_tokens_total": "vllm:prompt_tokens_total",
    "tritonllm_generation_tokens_total": "vllm:generation_tokens_total",
    "tritonllm_num_requests_running": "vllm:num_requests_running",
    "tritonllm_num_requests_waiting": "vllm:num_requests_waiting",
    "tritonllm_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "tritonllm_num_preemptions_total": "vllm:num_preemptions_total",
    "tritonllm_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "tritonllm_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "tritonllm_request_finished_total": "vllm:request_success_total",
    "tritonllm_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "tritonllm_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "tritonllm_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}
VLLM_LABELS = {"model": "model_name", "finish_reason": "finished_reason"}
