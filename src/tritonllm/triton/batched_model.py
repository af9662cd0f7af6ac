"""`llm_dynamic` and `llm_static`: request-level batching by Triton's dynamic batcher.

Triton hands `execute()` up to max_batch_size requests; they run together, with the same model
runner and sampler as the in-flight engine, until the longest one ends. Rows that finish early
stop sampling but stay in the forward as padding, as in `model.generate` (the batch has a fixed
shape), and nothing joins until the whole batch is done: that is the scheme being compared.
Only `dynamic_batching` in config.pbtxt differs between the two models.
"""

from __future__ import annotations

import json
from dataclasses import replace

from tritonllm.engine.faults import engine_class
from tritonllm.engine.model_loader import load_model
from tritonllm.errors import Fault, RequestError
from tritonllm.triton import pb, stack_dumps
from tritonllm.triton.logprobs_output import TokenTexts
from tritonllm.triton.metrics import EngineCounters


class BatchedModel:
    def initialize(self, args):
        stack_dumps.enable()
        pb.check_config(args)
        params = pb.model_parameters(args)
        self.model_name = args["model_name"]
        max_batch_size = json.loads(args["model_config"])["max_batch_size"]
        model, tokenizer = load_model(params.get("model"), params.get("device"), params.get("dtype"))
        config = replace(pb.engine_config(params, max_num_seqs=max_batch_size), batch_policy="request")
        self.engine = engine_class()(model, tokenizer, config, params.get("quantization"))
        self.token_texts = TokenTexts(self.engine.tokenizer)  # for the logprobs output
        self.counters = EngineCounters(self.model_name, self.engine)  # the same counters as llm_inflight

    def execute(self, requests):
        self.counters.open.set(len(requests))
        try:
            return self._execute(requests)
        finally:
            self.counters.open.set(0)

    def _execute(self, requests):
        responses = [None] * len(requests)
        batch = []  # (index, parsed request, request id)
        for i, request in enumerate(requests):
            try:
                req = pb.read_request(request)
                if req.stream:
                    raise RequestError(f"{self.model_name} cannot stream (it answers when its batch ends); "
                                       "send stream=false, or use llm_inflight", "stream", Fault.UNSUPPORTED)
                batch.append((i, req, self.engine.add_request(req.prompt, req.params)))
            except ValueError as exc:
                responses[i] = pb.refusal_response(exc)
        outputs = {}
        for out in self._run_batch():
            outputs.setdefault(out.request_id, []).append(out)
        for i, req, request_id in batch:
            responses[i] = pb.whole_response(req, outputs[request_id], self.token_texts, batched=True)
        self.counters.update()
        return responses

    def _run_batch(self):
        """Step the engine until every request of this batch has finished."""
        while self.engine.has_unfinished():
            yield from self.engine.step()

    def finalize(self):
        pass
