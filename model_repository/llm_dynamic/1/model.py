# Thin adapter: Triton's dynamic batcher hands execute() a batch; shared code runs it to the end.
from tritonllm.triton.batched_model import BatchedModel as TritonPythonModel  # noqa: F401
