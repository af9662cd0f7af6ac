"""The command-line client (`tritonllm-client`, package tritonllm_client) against the real server.

Most commands run in-process through `main([...])` with capsys; Ctrl-C runs the installed console
script in a subprocess and sends it SIGINT.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tritonllm.engine.faults import hold_prompt
from tritonllm.model_files import tiny_dir
from tritonllm_client import chat
from tritonllm_client.cli import main
from tritonllm_client.errors import EXIT_CANCELLED, EXIT_MODEL, EXIT_REQUEST, EXIT_UNREACHABLE
from tritonllm_client.grpc_stream import GrpcSession

CLIENT = Path(sys.executable).parent / "tritonllm-client"
PROMPT = "The capital of France is"
GREEDY = ["--max-tokens", "8", "--ignore-eos", "--temperature", "0"]
STATS = re.compile(r"\[(\w+), ([\w ]+)\] TTFT (\d+) ms, (\d+) tokens in ([\d.]+) s, ([\d.]+) tokens/s")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def metric(server, name: str, model: str = "llm_inflight") -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        text = response.read().decode()
    match = re.search(rf'^{name}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def wait_for_metric(server, name: str, value: float, timeout: float = 30) -> None:
    """Until the metric reads `value` (it is published just after a step's responses go out)."""
    deadline = time.monotonic() + timeout
    while (last := metric(server, name)) != value:
        assert time.monotonic() < deadline, f"{name} is {last}, not {value}, after {timeout} s"
        time.sleep(0.05)


# --- generate ---------------------------------------------------------------------------------

def test_grpc_stream_yields_one_chunk_per_token(triton_server):
    session = GrpcSession(triton_server.grpc_url)
    try:
        info = session.model_info("llm_inflight")
        assert info.decoupled and not info.batching
        chunks = list(session.generate(info, PROMPT, {"max_tokens": 5, "ignore_eos": True}))
    finally:
        session.close()
    assert [c.num_tokens for c in chunks] == [1] * 5  # streamed: one response per token step
    assert chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks).strip()


@pytest.mark.parametrize("model, protocol, mode, label", [
    ("llm_inflight", "grpc", None, "gRPC stream"),
    ("llm_inflight", "http", "generate", "HTTP generate"),
    ("llm_inflight", "http", "generate_stream", "HTTP generate_stream"),
    ("llm_dynamic", "grpc", None, "gRPC unary"),
    ("llm_dynamic", "http", "infer", "HTTP infer"),
    ("llm_dynamic", "http", "generate_stream", "HTTP generate_stream"),
])
def test_generate_prints_text_and_stats(triton_server, capsys, model, protocol, mode, label):
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    argv = ["generate", PROMPT, "--model", model, "--protocol", protocol, "--url", url, *GREEDY]
    if mode:
        argv += ["--http-mode", mode]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    stats = STATS.search(err)
    assert stats, err
    assert stats.group(1) == model and stats.group(2) == label
    assert int(stats.group(4)) == 8  # num_output_tokens, summed over the responses
    assert float(stats.group(6)) > 0
    assert PROMPT not in out  # exclude_input_in_output
    # Greedy decoding: every model, protocol and mode gives the same text.
    reference = _greedy_reference(triton_server)
    assert out == reference + "\n"


_reference: dict[str, str] = {}


def _greedy_reference(server) -> str:
    if "text" not in _reference:
        session = GrpcSession(server.grpc_url)
        try:
            info = session.model_info("llm_inflight")
            chunks = session.generate(info, PROMPT, {"max_tokens": 8, "ignore_eos": True, "temperature": 0})
            _reference["text"] = "".join(c.text for c in chunks)
        finally:
            session.close()
    return _reference["text"]


def test_generate_reads_the_prompt_from_stdin(triton_server, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    code, out, err = run_cli(capsys, "generate", "--url", triton_server.grpc_url, *GREEDY)
    assert code == 0, err
    assert out == _greedy_reference(triton_server) + "\n"


# --- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["generate", "hi"], ["generate", "hi", "--protocol", "http"],
                                     ["compare", "hi"], ["health"], ["chat"]])
def test_server_down_is_one_line_and_nonzero(capsys, command, monkeypatch):
    port = _free_port()
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    argv = command + ["--url", f"127.0.0.1:{port}"]
    if command == ["chat"]:
        argv += ["--tokenizer", str(tiny_dir())]
    code, out, err = run_cli(capsys, *argv)
    assert code == EXIT_UNREACHABLE
    assert err.startswith("error: cannot connect to Triton at") and "not reachable" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _free_port() -> int:
    from tritonllm.server.tritonserver import find_free_ports

    return find_free_ports(1)[0]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unknown_model(triton_server, capsys, protocol):
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    code, _, err = run_cli(capsys, "generate", "hi", "--model", "llm_nope", "--protocol", protocol, "--url", url)
    assert code == EXIT_MODEL
    assert "model 'llm_nope' is unknown" in err
    assert "llm_dynamic, llm_inflight, llm_static" in err  # what there is instead


@pytest.mark.parametrize("model, protocol, mode", [
    ("llm_inflight", "grpc", "generate"),
    ("llm_dynamic", "grpc", "generate"),
    ("llm_inflight", "http", "generate_stream"),
    ("llm_dynamic", "http", "generate_stream"),
    ("llm_dynamic", "http", "infer"),
])
def test_bad_sampling_prints_the_server_message(triton_server, capsys, model, protocol, mode):
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    code, out, err = run_cli(capsys, "generate", "hi", "--model", model, "--protocol", protocol,
                             "--http-mode", mode, "--url", url, "--top-p", "1.5")
    assert code == EXIT_REQUEST
    assert err.strip() == f"error: {model}: sampling parameter 'top_p' must be in (0, 1], got 1.5"
    assert out == ""


def test_http_infer_on_the_decoupled_model_is_refused_with_a_hint(triton_server, capsys):
    code, _, err = run_cli(capsys, "generate", "hi", "--protocol", "http", "--http-mode", "infer",
                           "--url", triton_server.http_url)
    assert code == EXIT_REQUEST
    assert "llm_inflight is decoupled" in err and "generate_stream" in err


# --- compare, health --------------------------------------------------------------------------

def test_compare_prints_a_table_of_the_three_models(triton_server, capsys):
    code, out, err = run_cli(capsys, "compare", PROMPT, "--url", triton_server.grpc_url,
                             "--max-tokens", "4", "--ignore-eos", "--show-text")
    assert code == 0, err
    assert "sent sequentially over gRPC" in err
    lines = out.splitlines()
    assert lines[0].split() == ["model", "mode", "TTFT", "(s)", "e2e", "(s)", "tokens", "tokens/s", "finish"]
    rows = {}
    for line in lines[1:4]:
        name, mode, ttft, e2e, tokens, rate, finish = line.split()
        rows[name] = (mode, float(ttft), float(e2e), int(tokens), float(rate), finish)
    assert set(rows) == {"llm_static", "llm_dynamic", "llm_inflight"}
    for name, (mode, ttft, e2e, tokens, rate, finish) in rows.items():
        assert mode == ("stream" if name == "llm_inflight" else "unary")
        assert tokens == 4 and finish == "length" and rate > 0 and 0 < ttft <= e2e
    # A lone request waits out llm_static's batch-fill delay (5 s); the others do not.
    assert rows["llm_static"][2] > 4.5
    assert rows["llm_dynamic"][2] < rows["llm_static"][2]
    # Greedy by default: the three schemes produce the same text.
    texts = {m: re.search(rf"^\[{m}\] (.*)$", out, re.M).group(1) for m in rows}
    assert len(set(texts.values())) == 1, texts


def test_health_lists_the_three_models_ready(triton_server, capsys):
    session = GrpcSession(triton_server.grpc_url)  # one request, so that the statistics move
    try:
        info = session.model_info("llm_dynamic")
        list(session.generate(info, "hi", {"max_tokens": 2}))
    finally:
        session.close()
    code, out, err = run_cli(capsys, "health", "--url", triton_server.http_url)
    assert code == 0, err
    assert re.search(r"^Triton [\d.]+ at http://\S+: live yes, ready yes$", out, re.M)
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert set(rows) == {"llm_static", "llm_dynamic", "llm_inflight"}
    for line in rows.values():
        assert line.split()[2:4] == ["READY", "yes"]
    assert rows["llm_inflight"].split()[4:6] == ["0", "yes"]  # max_batch_size, decoupled
    assert rows["llm_dynamic"].split()[4:6] == ["8", "no"]
    assert "delay 5000 ms" in rows["llm_static"] and "delay 50 ms" in rows["llm_dynamic"]
    ok, failed, inferences, executions = map(int, rows["llm_dynamic"].split()[-4:])
    assert ok >= 1 and inferences >= 1 and executions >= 1


# --- chat -------------------------------------------------------------------------------------

def test_chat_streams_answers_and_keeps_the_history(triton_server, capsys, monkeypatch):
    prompts = []

    def spy(tokenizer, messages):
        prompt = build_prompt(tokenizer, messages)
        prompts.append((messages, prompt))
        return prompt

    build_prompt = chat.build_prompt
    monkeypatch.setattr(chat, "build_prompt", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello!\n\nWhat did you just say?\n/exit\nnot read\n"))
    code, out, err = run_cli(capsys, "chat", "--url", triton_server.grpc_url, "--tokenizer", str(tiny_dir()),
                             "--max-tokens", "6", "--ignore-eos", "--show-prompt")
    assert code == 0, err
    assert len(prompts) == 2  # the empty line is skipped, /exit ends before "not read"
    (first_messages, first_prompt), (second_messages, second_prompt) = prompts
    assert first_messages[-1] == {"role": "user", "content": "Hello!"}
    assert "<|im_start|>user\nHello!<|im_end|>" in first_prompt  # the model's own chat template
    assert first_prompt.endswith("<|im_start|>assistant\n")  # add_generation_prompt
    first_answer = second_messages[-2]
    assert first_answer["role"] == "assistant" and first_answer["content"].strip()
    assert second_messages[-3] == {"role": "user", "content": "Hello!"}
    assert second_messages[-1] == {"role": "user", "content": "What did you just say?"}
    assert first_answer["content"] in second_prompt
    assert out.startswith(first_answer["content"] + "\n")
    assert len(out) > len(first_answer["content"]) + 2  # a second answer followed
    assert err.count("--- prompt ---") == 2


def test_chat_exits_at_end_of_input(triton_server, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, out, err = run_cli(capsys, "chat", "--url", triton_server.grpc_url, "--tokenizer", str(tiny_dir()))
    assert code == 0 and out == ""


# --- Ctrl-C -----------------------------------------------------------------------------------

def _start_with_sigint_catchable(argv: list[str]) -> subprocess.Popen:
    """Start argv with SIGINT at its default, as from a terminal.

    A shell starts a background job (`cmd &`, no job control) with SIGINT ignored; its children
    inherit that and Python then installs no KeyboardInterrupt handler, so Ctrl-C would do nothing.
    A caught handler is reset to the default across exec, an ignored one is not: catch it here
    while the child starts.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_ctrl_c_cancels_the_request_on_the_server(triton_server, protocol):
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    wait_for_metric(triton_server, "tritonllm_num_requests_running", 0)
    tokens_before = metric(triton_server, "tritonllm_generation_tokens_total")
    hold = 10  # the request cannot finish by itself (test-only fault): it runs until Ctrl-C cancels it
    proc = _start_with_sigint_catchable([str(CLIENT), "generate", hold_prompt(hold, "Once upon a time"),
                                         "--max-tokens", "1500", "--ignore-eos", "--protocol", protocol, "--url", url])
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no token within 60 s"
        assert os.read(proc.stdout.fileno(), 64)  # the first tokens arrived
        wait_for_metric(triton_server, "tritonllm_num_requests_running", 1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == EXIT_CANCELLED
        err = proc.stderr.read().decode()
        assert "cancelled" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for_metric(triton_server, "tritonllm_num_requests_running", 0)  # the server let it go
    assert metric(triton_server, "tritonllm_generation_tokens_total") - tokens_before <= hold


# --- sampling flags ---------------------------------------------------------------------------

def test_sampling_flags_become_the_sampling_parameters_json():
    from tritonllm_client.cli import build_parser
    from tritonllm_client.contract import request_inputs, sampling_from_args

    args = build_parser().parse_args(["generate", "hi", "--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.9",
                                      "--top-k", "20", "--seed", "3", "--stop", "a", "--stop", "b c", "--ignore-eos"])
    sampling = sampling_from_args(args)
    assert sampling == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 3,
                        "stop": ["a", "b c"], "ignore_eos": True}
    inputs = request_inputs("hi", sampling, stream=True)
    assert json.loads(inputs["sampling_parameters"][1]) == sampling
    assert inputs["exclude_input_in_output"] == ("BOOL", True)
    # Flags left out are not sent: the server's defaults apply.
    assert sampling_from_args(build_parser().parse_args(["generate", "hi"])) == {}
    # Logprobs and the structured-output flags become the models' keys.
    args = build_parser().parse_args(["generate", "hi", "--logprobs", "2", "--choice", "yes", "--choice", "no"])
    assert sampling_from_args(args) == {"logprobs": 2, "structured_outputs": {"choice": ["yes", "no"]}}
    args = build_parser().parse_args(["generate", "hi", "--json-object"])
    assert sampling_from_args(args) == {"structured_outputs": {"json_object": True}}


def test_the_cli_asks_for_a_regex_and_logprobs_and_gets_them(triton_server, capsys):
    from tritonllm_client.cli import main

    assert main(["generate", "Hi", "--url", triton_server.grpc_url, "--regex", "[0-9]{4}", "--logprobs", "1",
                 "--max-tokens", "8", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert re.fullmatch(r"[0-9]{4}", captured.out.strip()), captured.out
    assert len([line for line in captured.err.splitlines() if " | " in line]) >= 4  # a line per token


def test_stop_and_seed_reach_the_server(triton_server, capsys):
    reference = _greedy_reference(triton_server)
    stop = reference[len(reference) // 2:len(reference) // 2 + 3]
    code, out, err = run_cli(capsys, "generate", PROMPT, "--url", triton_server.grpc_url, *GREEDY, "--stop", stop)
    assert code == 0, err
    assert out == reference[:reference.index(stop)] + "\n"  # vLLM: the stop string is not output
    assert "(finish: stop)" in err
    sampled = [run_cli(capsys, "generate", PROMPT, "--url", triton_server.grpc_url, "--max-tokens", "8",
                       "--ignore-eos", "--temperature", "1", "--top-k", "50", "--top-p", "0.95", "--seed", "7")
               for _ in range(2)]
    assert sampled[0][0] == 0 and sampled[0][1] == sampled[1][1]  # same seed, same text


def test_a_dead_stub_error_says_what_happened():
    from tritonllm_client.errors import RequestFailed

    message = str(RequestFailed("llm_inflight: Stub process 'llm_inflight_0_0' is not healthy."))
    assert "Python process has died" in message and "restarted" in message
    assert str(RequestFailed("llm_inflight: top_p must be in (0, 1]")) == "llm_inflight: top_p must be in (0, 1]"
