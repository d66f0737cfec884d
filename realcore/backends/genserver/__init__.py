"""The built-in generation server: the engine loop, weight intake, and the HTTP server (SGLang's API)."""
