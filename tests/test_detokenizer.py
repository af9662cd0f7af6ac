"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

import tritonllm.model_files
from tritonllm.engine.detokenizer import IncrementalDetokenizer, OutputText

TEXTS = [
    "Hello, world!",
    " leading space",
    "   three leading spaces and trailing ",
    "line one\nline two\n\n  indented\n",
    "\ttab\tseparated\r\nwindows line",
    "café naïve résumé Ångström façade",
    "日本語のテキストと中文字符，还有标点。",
    "emoji 😀👍🏽🎉 family 👨‍👩‍👧 flag 🇫🇷 end",
    "mixed: Ünïcödé — “quotes” … ✓ ∑ π ≈ 3.14",
    "Привет, мир! Γειά σου κόσμε! مرحبا",
    "😀",
    "a😀b😀😀c",
    "code: def f(x):\n    return x ** 2  # ok",
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tritonllm.model_files.prepare_tiny())


def stream(tok, ids, skip_special_tokens=True):
    d = IncrementalDetokenizer(tok, skip_special_tokens)
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in p for p in pieces), pieces


def test_multibyte_texts_do_split_characters(tok):
    """Guard for the tests above: some tokens really hold partial UTF-8 characters."""
    ids = tok.encode("emoji 😀👍🏽🎉", add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = stream(tok, ids)
    assert "" in pieces[:-1], "nothing was held back for an incomplete character"


def test_each_piece_is_released_as_soon_as_complete(tok):
    text = "plain ascii words only here"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, ids)
    assert pieces[-1] == ""
    assert all(p for p in pieces[:-1]), "an ASCII token was held back"
    assert pieces[:-1] == [tok.decode(ids[: i + 1])[len(tok.decode(ids[:i])):] for i in range(len(ids))]


def test_special_tokens(tok):
    ids = ([tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode("user\nHi 😀", add_special_tokens=False)
           + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode(" there", add_special_tokens=False))
    assert "".join(stream(tok, ids, True)) == tok.decode(ids, skip_special_tokens=True)
    assert "".join(stream(tok, ids, False)) == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_end|>" in "".join(stream(tok, ids, False))


def test_random_token_ids(tok):
    """Any id sequence, incomplete bytes and special tokens included, streams to the full decode."""
    rng = random.Random(1)
    byteish = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    for _ in range(150):
        ids = [rng.choice(byteish) if rng.random() < 0.4 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip), ids


def test_flush_releases_an_incomplete_character(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    partial = ids[:-1]  # the emoji is cut
    assert tok.decode(partial).endswith("\ufffd")
    pieces = stream(tok, partial)
    assert "\ufffd" not in "".join(pieces[:-1])
    assert "".join(pieces) == tok.decode(partial)


# ---- OutputText: stop strings ----

def run_output_text(tok, text, stop):
    """Feed `text`'s ids; return (final text, streamed pieces, index of the stopping token, ids)."""
    ids = tok.encode(text, add_special_tokens=False)
    out = OutputText(tok, stop)
    pieces, stopped_at = [], None
    for i, t in enumerate(ids):
        if out.add(t):
            stopped_at = i
            break
        pieces.append(out.release(final=False))
        # What is already handed out is always a prefix of the text so far.
        assert out.text.startswith("".join(pieces))
    out.finish()
    pieces.append(out.release(final=True))
    return out.text, pieces, stopped_at, ids


def expected_cut(text, stop):
    hits = [text.find(s) for s in stop if s in text]
    return text[: min(hits)] if hits else text


@pytest.mark.parametrize("text, stop", [
    ("The quick brown fox jumps over the lazy dog", ["fox"]),
    ("The quick brown fox jumps over the lazy dog", ["ps ov"]),  # spans two tokens
    ("The quick brown fox jumps over the lazy dog", ["lazy dog"]),
    ("The quick brown fox jumps over the lazy dog", ["The"]),
    ("The quick brown fox jumps over the lazy dog", ["cat"]),
    ("answer: 42\n\nQuestion: next", ["\n\n"]),
    ("answer: 42\n\nQuestion: next", ["Question", "\n"]),
    ("你好，世界！再见", ["世界"]),
    ("smile 😀 then 👍 done", ["👍"]),
    ("smile 😀 then 👍 done", ["😀 th"]),
    ("a long stop string at the very end", ["the very end"]),
])
def test_stop_strings(tok, text, stop):
    final, pieces, stopped_at, ids = run_output_text(tok, text, stop)
    assert final == expected_cut(text, stop)
    assert "".join(pieces) == final, "streamed pieces do not concatenate to the final text"
    for s in stop:
        assert s not in "".join(pieces)
    assert (stopped_at is not None) == any(s in text for s in stop)


def test_stop_string_split_across_tokens_is_caught(tok):
    text = "The quick brown fox jumps over the lazy dog"
    stop = "ps ov"
    ids = tok.encode(text, add_special_tokens=False)
    assert not any(stop in tok.decode([i]) for i in ids), "the stop string must span tokens for this test"
    final, pieces, stopped_at, _ = run_output_text(tok, text, [stop])
    assert final == "The quick brown fox jum"
    # It is caught at the token that completes it, not later.
    end = text.find(stop) + len(stop)
    assert len(tok.decode(ids[:stopped_at])) < end <= len(tok.decode(ids[: stopped_at + 1]))


def test_released_pieces_never_leak_a_stop_prefix(tok):
    """While streaming, no released character may belong to a stop string that later ends the text."""
    rng = random.Random(5)
    for text in TEXTS:
        if len(text) < 6:
            continue
        for _ in range(6):
            a = rng.randrange(len(text) - 2)
            stop = text[a: a + rng.randint(1, min(8, len(text) - a))]
            if not stop.strip("\ufffd"):
                continue
            final, pieces, _, _ = run_output_text(tok, text, [stop])
            assert final == text[: text.find(stop)], (text, stop)
            assert "".join(pieces) == final


def test_no_stop_releases_everything_at_once(tok):
    out = OutputText(tok, [])
    text = ""
    for t in tok.encode("Hello there, friend", add_special_tokens=False):
        assert out.add(t) is False
        piece = out.release(final=False)
        text += piece
        assert text == out.text  # nothing held back without stop strings
    out.finish()
    assert out.release(final=True) == ""


def test_holdback_is_released_at_the_end(tok):
    out = OutputText(tok, ["STOPSTOP"])
    streamed = ""
    for t in tok.encode("no stop here at all", add_special_tokens=False):
        assert not out.add(t)
        streamed += out.release(final=False)
    assert len(streamed) == len(out.text) - 7
    out.finish()
    streamed += out.release(final=True)
    assert streamed == "no stop here at all"


def test_earliest_stop_string_wins(tok):
    final, _, _, _ = run_output_text(tok, "one two three four", ["four", "two", "three"])
    assert final == "one "
