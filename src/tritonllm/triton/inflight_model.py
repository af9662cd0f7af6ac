"""`llm_inflight`: a decoupled Python-backend model driving the in-flight batching engine.

`execute()` only parses and enqueues: each request joins the running batch at the next token
step. The engine thread owns all model state and hands each step's outputs to a queue; a sender
thread turns them into Triton responses, polls cancellation and updates metrics, so the engine
never waits on the network. Every request gets exactly one FINAL flag: on success, error,
cancellation and unload. On SIGTERM (triton/termination.py) it stops taking requests, refuses the
waiting ones, gives the running ones `shutdown_grace_seconds` to finish, then ends the rest, so
the server can exit within its exit timeout with every stream closed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from tritonllm.engine.faults import engine_class
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.model_loader import load_model
from tritonllm.engine.sequence import RequestOutput
from tritonllm.triton import pb, stack_dumps
from tritonllm.triton.logprobs_output import TokenTexts
from tritonllm.triton.metrics import InflightMetrics
from tritonllm.triton.request import GenerateRequest
from tritonllm.triton.termination import on_termination

log = logging.getLogger(__name__)
CANCEL_POLL_S = 0.05  # cancelled requests leave within a step (a CPU step takes ~0.1 s)
UNLOADING = "llm_inflight is shutting down; the request was not finished (retry on another server)"


@dataclass
class OpenRequest:
    request_id: str
    req: GenerateRequest
    sender: object
    request: object  # kept so that cancellation can be polled
    outputs: list[RequestOutput] = field(default_factory=list)  # accumulated when not streaming
    closed: bool = False


class InflightModel:
    def initialize(self, args):
        stack_dumps.enable()
        pb.check_config(args)
        params = pb.model_parameters(args)

        def build() -> LLMEngine:
            model, tokenizer = load_model(params.get("model"), params.get("device"), params.get("dtype"))
            return engine_class()(model, tokenizer, pb.engine_config(params), params.get("quantization"))

        self.engine = LLMEngine.start_in_thread(build)  # torch never runs on this (the stub's) thread
        self.token_texts = TokenTexts(self.engine.tokenizer)  # for the logprobs output
        self.max_queue_size = int(params.get("max_queue_size", "256"))
        self.shutdown_grace_s = float(params.get("shutdown_grace_seconds", "10"))
        self.shutting_down = False
        self.metrics = InflightMetrics(args["model_name"], self.engine)
        self.open: dict[str, OpenRequest] = {}
        self.outbox: queue.Queue[RequestOutput | None] = queue.Queue()  # None: stop the sender
        self.sender_thread = threading.Thread(target=self._send_loop, name="llm-sender", daemon=True)
        self.sender_thread.start()
        on_termination(self._shut_down)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            request_id = f"{id(request)}-{time.monotonic_ns()}"
            try:
                refusal = self._admit(request, sender, request_id)
            except ValueError as exc:  # RequestError, or a request that can never run
                refusal = pb.refusal_response(exc)
            except Exception as exc:  # whatever it is, this request still gets its one final response
                log.exception("llm_inflight: accepting a request failed")
                refusal = pb.internal_error_response(f"llm_inflight could not accept the request: {exc}")
            if refusal is not None:
                self.open.pop(request_id, None)
                sender.send(refusal, flags=pb.final_flag())
        return None

    def _admit(self, request, sender, request_id: str):
        """Parse and queue one request; return the response that refuses it, or None."""
        req = pb.read_request(request)
        if self.shutting_down:
            return pb.unavailable_response(UNLOADING)
        if self.engine.num_waiting >= self.max_queue_size:
            return pb.unavailable_response(
                f"llm_inflight queue is full ({self.max_queue_size} waiting requests); retry later")
        self.open[request_id] = OpenRequest(request_id, req, sender, request)
        self.engine.add_request(req.prompt, req.params, self.outbox.put, request_id)
        return None

    def _shut_down(self) -> None:
        """SIGTERM: refuse what waits, let what runs finish within the grace period, end the rest."""
        log.warning("llm_inflight: SIGTERM; ending %d open requests within %.0f s", len(self.open), self.shutdown_grace_s)
        self.shutting_down = True
        self.engine.abort_all(waiting_only=True)
        deadline = time.monotonic() + self.shutdown_grace_s
        while self.open and time.monotonic() < deadline:
            time.sleep(CANCEL_POLL_S)
        self.engine.abort_all()

    def _send_loop(self) -> None:
        next_poll = 0.0
        while True:
            try:
                out = self.outbox.get(timeout=CANCEL_POLL_S)
                if out is None:  # finalize() is done with the engine
                    return
                self._send(out)
            except queue.Empty:
                pass
            except Exception:  # this thread must survive anything, or every open stream would hang
                log.exception("llm_inflight: sending a response failed")
            try:
                if self.outbox.empty():  # a step's outputs are all sent
                    self.metrics.update_gauges(len(self.open))
                    if time.monotonic() >= next_poll:  # each poll is a call per request into the server
                        self._poll_cancelled()
                        next_poll = time.monotonic() + CANCEL_POLL_S
            except Exception:
                log.exception("llm_inflight: polling cancellation or updating metrics failed")

    def _send(self, out: RequestOutput) -> None:
        state = self.open.get(out.request_id)
        if state is None or state.closed:
            return
        if out.finished:
            self.metrics.observe_finished(out)
        if out.finish_reason == "abort" and self._cancelled(state):
            self._close(state, None)
            return
        if out.error:  # the model failed on this request (engine/llm_engine.py)
            self._close(state, pb.internal_error_response(out.error))
            return
        if out.finish_reason == "abort":  # shutting down
            self._close(state, pb.unavailable_response(UNLOADING))
            return
        if state.req.stream:
            if out.text or out.token_ids or out.finished:
                response = pb.output_response(state.req, out.text, out, len(out.token_ids), self.token_texts)
                if out.finished:
                    self._close(state, response)
                else:
                    state.sender.send(response)
            return
        state.outputs.append(out)
        if out.finished:
            self._close(state, pb.whole_response(state.req, state.outputs, self.token_texts))

    def _close(self, state: OpenRequest, response) -> None:
        """Send the one FINAL flag of a request (with a last response, or without)."""
        state.closed = True
        self.open.pop(state.request_id, None)
        sender, state.sender, state.request = state.sender, None, None  # Triton frees a request with its last reference
        if response is None:
            sender.send(flags=pb.final_flag())
        else:
            sender.send(response, flags=pb.final_flag())

    @staticmethod
    def _cancelled(state: OpenRequest) -> bool:
        try:
            return bool(state.request.is_cancelled())
        except Exception:  # the request is gone
            return True

    def _poll_cancelled(self) -> None:
        for request_id, state in list(self.open.items()):
            if not state.closed and self._cancelled(state):
                self.engine.abort(request_id)

    def finalize(self):
        self.engine.shutdown()  # every open request gets a last output with reason `abort`
        self.outbox.put(None)
        self.sender_thread.join(timeout=10)
        for state in list(self.open.values()):
            if not state.closed:
                self._close(state, pb.unavailable_response(UNLOADING))
