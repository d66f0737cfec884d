"""The built-in generation server, by layer (a lower one never imports a higher one):
commands (what goes to the engine thread) <- engine_loop (the thread that owns the model) <-
weight_intake (disk, in-memory and collective weight updates, LoRA) <- http (SGLang's and OpenAI's
API, `run_server`)."""
