"""`chat`: an interactive conversation with the instruct model, streamed from `llm_inflight`.

Why the chat template is applied here, on the client: the server keeps the vLLM backend's
contract, raw text in and raw text out, so that every client of that contract (genai-perf,
Triton's generate endpoint, curl) works unchanged, and the server keeps no state between
requests. The conversation belongs to the client: it keeps the messages, renders all of them with
the model's own chat template (read from the tokenizer files, the same files the server loads) and
sends the whole rendered prompt each turn. Another template or a system prompt is a client-side
choice; the server never has to know.
"""

from __future__ import annotations

import sys
from contextlib import closing
from pathlib import Path

from tritonllm_client.contract import ModelInfo, sampling_from_args
from tritonllm_client.errors import ClientError, RequestFailed
from tritonllm_client.grpc_stream import GrpcSession
from tritonllm_client.timing import Timing

HELP = "type a message; /reset starts over, /exit or Ctrl-D leaves, Ctrl-C cancels and quits"


def load_tokenizer(path: str | Path | None = None):
    """The tokenizer (with its chat template) from a local directory; default: the bundled model's."""
    from transformers import AutoTokenizer

    if path is None:
        from tritonllm.model_files import bundled_dir, prepare_bundled

        prepare_bundled()
        path = bundled_dir()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ClientError(f"cannot load a tokenizer from {path}: {str(exc).splitlines()[0]}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ClientError(f"the tokenizer in {path} has no chat template")
    return tokenizer


def build_prompt(tokenizer, messages: list[dict]) -> str:
    """The whole conversation as the raw text the server takes, ending where the assistant speaks."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class Conversation:
    """The messages so far; `ask` sends them all plus the new one and keeps the answer."""

    def __init__(self, session, info: ModelInfo, tokenizer, sampling: dict, system: str | None = None):
        self.session, self.info, self.tokenizer, self.sampling = session, info, tokenizer, sampling
        self.system = system
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_for(self, text: str) -> str:
        return build_prompt(self.tokenizer, self.messages + [{"role": "user", "content": text}])

    def ask(self, text: str, show_prompt: bool = False) -> tuple[str, Timing]:
        """Stream the answer to stdout; the exchange joins the history only if it succeeded."""
        prompt = self.prompt_for(text)
        if show_prompt:
            print(f"--- prompt ---\n{prompt}\n--- end of prompt ---", file=sys.stderr)
        timing = Timing()
        parts = []
        chunks = self.session.generate(self.info, prompt, self.sampling)
        with closing(chunks):
            for chunk in chunks:
                timing.add(chunk)
                parts.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        timing.finish()
        sys.stdout.write("\n")
        sys.stdout.flush()
        answer = "".join(parts)
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        return answer, timing


def read_message(interactive: bool) -> str | None:
    """The next line the user typed, or None at end of input."""
    if interactive:
        try:
            return input("you> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def run(args) -> int:
    tokenizer = load_tokenizer(args.tokenizer)
    session = GrpcSession(args.url) if args.url else GrpcSession()
    try:
        info = session.model_info(args.model)
        conversation = Conversation(session, info, tokenizer, sampling_from_args(args), args.system)
        interactive = sys.stdin.isatty()
        if interactive:
            print(f"chat with {info.name} at {session.url}: {HELP}", file=sys.stderr)
        while True:
            text = read_message(interactive)
            if text is None or text.strip() == "/exit":
                break
            if not text.strip():
                continue
            if text.strip() == "/reset":
                conversation.reset()
                print("(conversation cleared)", file=sys.stderr)
                continue
            if interactive:
                sys.stdout.write("assistant> ")
            try:
                _, timing = conversation.ask(text, show_prompt=args.show_prompt)
            except RequestFailed as exc:  # e.g. the conversation outgrew max_model_len: say so, go on
                sys.stdout.write("\n")
                print(f"error: {exc}", file=sys.stderr)
                continue
            if args.stats:
                print(f"[{info.name}] {timing.summary()}", file=sys.stderr)
        return 0
    finally:
        session.close()
