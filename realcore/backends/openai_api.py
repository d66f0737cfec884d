"""OpenAI's chat and completions API over the built-in engine (docs/openai.md): the pure parts.

Requests become token ids here (the chat template, or the text's tokens), and the engine's replies
(SGLang-shaped, from realcore.backends.genserver.http's /generate path) become OpenAI's JSON, cut at
the first stop string. The handlers that run the choices live in gen_server, so that a choice is
one /generate request: pause, abort and weight updates treat both APIs alike.

Training clients need exact ids: every choice carries its `token_ids` (what was sampled, up to
and including the token that completed a stop string) and `weight_version`; a chat response
carries its `prompt_token_ids` (the templated prompt), a completion choice its prompt's ids.
"""

from __future__ import annotations

import codecs
import functools
import time
from dataclasses import dataclass

from tokenizers import decoders

from realcore.api.data import chat_template_ids
from realcore.backends.http_schemas import one_line

ROUTES = ("/v1/chat/completions", "/v1/completions")


# --- prompts ----------------------------------------------------------------------------------------


def chat_prompt(tokenizer, messages: list[dict[str, str]], vocab_size: int) -> list[int]:
    """The token ids of `messages` through the tokenizer's chat template, with the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: send the prompt to /v1/completions instead")
    try:
        ids = chat_template_ids(tokenizer, messages)
    except Exception as e:  # the template's raise_exception (say, roles must alternate): the messages' fault
        raise ValueError(f"messages: the chat template refused them: {one_line(e)}") from None
    return _checked(ids, vocab_size, "messages: the templated prompt")


def text_prompt(tokenizer, text: str, vocab_size: int) -> list[int]:
    """The token ids of a text prompt (with a BOS where the model family expects one)."""
    return _checked(list(tokenizer.encode(text, add_special_tokens=True)), vocab_size, "prompt: the text")


def _checked(ids: list[int], vocab_size: int, what: str) -> list[int]:
    if not ids:
        raise ValueError(f"{what} has no tokens")
    if max(ids) >= vocab_size:  # a tokenizer larger than the model's embeddings
        raise ValueError(f"{what} holds token id {max(ids)}, outside the model's vocabulary [0, {vocab_size})")
    return ids


# --- choices ----------------------------------------------------------------------------------------


@dataclass
class Choice:
    """One finished sequence, cut after the token that completed its first stop string."""

    output_ids: list[int]
    logprobs: list[float]
    text: str  # special tokens skipped, the stop string and what follows it removed
    finish_reason: str  # "stop" | "length" | "abort" (SGLang's and vLLM's, see docs/openai.md)
    matched_stop: str | int | None  # the stop string, or the stop token id (EOS)
    weight_version: str


def choice(tokenizer, reply: dict, stops: list[str]) -> Choice:
    """A /generate reply (realcore.backends.genserver.engine_loop.generate_reply, with log-probs) as a Choice."""
    meta, ids = reply["meta_info"], reply["output_ids"]
    logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
    cut = cut_at_stop(tokenizer, ids, stops)
    if cut is not None:  # also for an aborted request: what it generated holds a complete answer
        keep, text, stop = cut
        return Choice(ids[:keep], logprobs[:keep], text, "stop", stop, meta["weight_version"])
    reason = meta["finish_reason"]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return Choice(ids, logprobs, text, reason["type"], reason.get("matched"), meta["weight_version"])


def cut_at_stop(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, str, str] | None:
    """(k, text, stop): the first k tokens are the shortest prefix whose text holds a stop string;
    `text` is that prefix's text up to the stop string. None if the text holds none.

    Why a binary search over prefixes: a stop string may span tokens, and decoding a prefix costs
    as much as decoding the whole; a prefix's text holds a stop string if a shorter one does."""
    if not stops or not ids:
        return None

    def first(k: int) -> tuple[str, int, str] | None:
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        found = [(text.find(s), s) for s in stops if s in text]
        return (text, *min(found)) if found else None

    if first(len(ids)) is None:
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if first(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    text, at, stop = first(lo)
    return lo, text[:at], stop


# --- token strings ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (bytes_to_unicode in openai/gpt-2's encoder.py), inverted:
    printable bytes stand for themselves, the others for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """The bytes of each token. Exact for byte-level BPE (GPT-2, Qwen, Llama 3, SmolLM): a token
    may hold part of a UTF-8 character. Other tokenizers: the token decoded alone (approximate:
    SentencePiece's leading spaces are lost)."""
    table = _byte_decoder()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
    out = []
    for i, tok in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        if byte_level and all(c in table for c in tok):
            out.append(bytes(table[c] for c in tok))
        else:  # an added token outside the byte alphabet, or another kind of tokenizer
            out.append(tokenizer.decode([i]).encode())
    return out


def _strings(pieces: list[bytes]) -> list[str]:
    return [p.decode("utf-8", errors="replace") for p in pieces]


# --- responses ----------------------------------------------------------------------------------------


def _usage(prompt_lengths: list[int], choices: list[Choice]) -> dict:
    prompt, completion = sum(prompt_lengths), sum(len(c.output_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _extras(c: Choice) -> dict:
    return {"matched_stop": c.matched_stop, "token_ids": c.output_ids, "weight_version": c.weight_version}


def chat_response(rid: str, model: str, prompt_ids: list[int], choices: list[Choice], tokenizer, *,
                  logprobs: bool) -> dict:
    """OpenAI's ChatCompletion, plus `prompt_token_ids`, `metadata` and per choice `token_ids`,
    `weight_version`, `matched_stop` (SGLang's and vLLM's names)."""
    out = []
    for i, c in enumerate(choices):
        lp = None
        if logprobs:
            pieces = token_bytes(tokenizer, c.output_ids)
            lp = {"content": [{"token": t, "logprob": x, "bytes": list(b), "top_logprobs": []}
                              for t, x, b in zip(_strings(pieces), c.logprobs, pieces)], "refusal": None}
        message = {"role": "assistant", "content": c.text, "refusal": None}
        out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": c.finish_reason, **_extras(c)})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": out,
            "usage": _usage([len(prompt_ids)], choices), "prompt_token_ids": prompt_ids,
            "metadata": {"weight_version": choices[0].weight_version}}


def completion_response(rid: str, model: str, prompts: list[list[int]], choices: list[Choice], tokenizer, *,
                        logprobs: bool) -> dict:
    """OpenAI's Completion (choice i answers prompt i // n), plus per choice `prompt_token_ids`."""
    n = len(choices) // len(prompts)
    out = []
    for i, c in enumerate(choices):
        lp = None
        if logprobs:
            pieces = token_bytes(tokenizer, c.output_ids)
            tokens = _strings(pieces)
            offsets, at, utf8 = [], 0, codecs.getincrementaldecoder("utf-8")(errors="replace")
            for piece in pieces:  # offsets into the tokens' text joined; a token may end inside a character
                offsets.append(at)
                at += len(utf8.decode(piece))
            lp = {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": [{} for _ in tokens],
                  "text_offset": offsets}
        out.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                    "prompt_token_ids": prompts[i // n], **_extras(c)})
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": out,
            "usage": _usage([len(p) for p in prompts], choices),
            "metadata": {"weight_version": choices[0].weight_version}}
