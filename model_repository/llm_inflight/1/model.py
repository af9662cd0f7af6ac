# Thin adapter: the in-flight engine schedules per token step and streams (decoupled model).
from tritonllm.triton.inflight_model import InflightModel as TritonPythonModel  # noqa: F401
