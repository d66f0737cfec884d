"""Clients of generation servers (the built-in one and SGLang through SGLang's API, vLLM through its own), one per engine."""
