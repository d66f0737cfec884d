"""Which client speaks to a server of a given engine."""

from __future__ import annotations

from realcore.backends.clients.sglang_api import GenClient
from realcore.backends.clients.vllm import VLLMClient
from realcore.backends.lora import LORA_NAME


def client_for(engine: str, url: str, *, token: str | None, timeout_s: float, lora: bool = False):
    """The HTTP client for a server of `engine`: SGLang's API for the built-in server and SGLang,
    the adapter for vLLM. All have the same async interface (see gen_client.GenClient). `lora`
    (a LoRA run): SGLang's requests name the adapter (the built-in server merges it into its weights)."""
    if engine == "vllm":
        return VLLMClient(url, token=token, timeout_s=timeout_s)
    return GenClient(url, token=token, timeout_s=timeout_s, lora_name=LORA_NAME if lora and engine == "sglang" else None)
