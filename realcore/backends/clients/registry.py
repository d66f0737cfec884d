"""The generation engines a run can name (`allocation_mode=ENGINE.dN...+...`): the built-in server
(`local`), SGLang and vLLM register on import of their client modules (imported here); a user module
listed in `imports:` registers its own with `realcore.api.registry.register_engine`. This module
gives an engine's client, its capabilities, its server command and whether it can start here."""

from __future__ import annotations

from realcore.api.generation import Capabilities, EngineEntry, ServerSpec
from realcore.api.registry import lookup, registered
from realcore.backends import server_launch
from realcore.backends.clients import sglang_api, vllm  # noqa: F401  (the built-in engines register on import)


def engine(name: str) -> EngineEntry:
    """The registered engine `name`; ValueError naming the known ones."""
    try:
        return lookup("engine", name)
    except KeyError:
        raise ValueError(f"unknown generation engine {name!r}; registered: {', '.join(registered('engine'))}") from None


def capabilities(name: str) -> Capabilities:
    return engine(name).capabilities


def engines_with(has) -> list[str]:
    """The registered engines whose capabilities satisfy `has(caps)` (for messages)."""
    return [n for n in registered("engine") if has(lookup("engine", n).capabilities)]


def client_for(name: str, url: str, *, token: str | None, timeout_s: float, lora: bool = False):
    """The HTTP client for a server of engine `name` (a realcore.api.generation.GenerationClient).
    `lora` (a LoRA run): an engine whose requests name the adapter (SGLang) names it; the built-in
    server merges it into its weights."""
    return engine(name).client(url, token=token, timeout_s=timeout_s, lora=lora)


def engine_available(name: str, python: str | None = None) -> str | None:
    """None if `name`'s server can be started by interpreter `python` (rollout.server_python;
    None: this one), else a one-line reason."""
    try:
        entry = engine(name)
    except ValueError as e:
        return str(e)
    return entry.available(python) if entry.available is not None else None


def server_command(
    name: str,
    *,
    model_path: str,
    host: str,
    port: int,
    tp: int,
    seed: int,
    max_batch_size: int,
    extra_args: list[str] | tuple[str, ...] = (),
    cuda: bool | None = None,
    api_key: str | None = None,
    private_dir: str | None = None,
    python: str | None = None,
    pp: int = 1,
    lora=None,
    mem_fraction: float | None = None,
    dtype: str = "auto",
    write_files: bool = True,
) -> tuple[list[str], dict[str, str]]:
    """Return `(argv, env)` that start one server of engine `name` (its registered command);
    `env` holds only the variables to set on top of the caller's environment (PYTHONPATH, if set,
    already includes the caller's).

    `cuda=None` asks torch whether CUDA is available; the CPU flags are added when it is not.
    `extra_args` are appended last, so they may override (the engines' parsers keep the last
    value), e.g. `["--dtype", "float32"]`.

    `api_key`: the bearer token the server will require, kept off the command line (vLLM gets it
    in `env`; SGLang in a mode-0600 file in `private_dir` named by `--config`, so `extra_args` must
    not hold another --config). `python`: the interpreter that runs the server
    (rollout.server_python; None: sys.executable), its bin directory first on PATH. `lora`
    (actor.lora): engines whose capabilities say lora. On GPUs `mem_fraction` (None: the engine's
    default) is the share of each GPU the server takes, `dtype` (generation.dtype) its weights'.
    `write_files=False` (a dry run): files are named on the command line but not written.
    """
    entry = engine(name)
    if entry.command is None:
        raise ValueError(f"{name} servers are started by realcore's own worker")
    for key, value in (("tp", tp), ("pp", pp), ("max_batch_size", max_batch_size), ("port", port)):
        if value < 1:
            raise ValueError(f"server_command: {key} must be >= 1, got {value}")
    if lora is not None and not entry.capabilities.lora:
        raise ValueError(f"actor.lora: {name} servers do not serve LoRA adapters; LoRA servers: "
                         f"{', '.join(engines_with(lambda c: c.lora))}")
    if cuda is None:
        import torch  # only here: a caller that knows where the server runs never loads torch for it

        cuda = torch.cuda.is_available()
    spec = ServerSpec(model_path=model_path, host=host, port=port, tp=tp, pp=pp, seed=seed,
                      max_batch_size=max_batch_size, cuda=cuda, api_key=api_key, private_dir=private_dir,
                      python=python, lora=lora, mem_fraction=mem_fraction, dtype=dtype, write_files=write_files)
    argv, env = entry.command(spec)
    env = {**env, **server_launch.server_env(spec)}
    return list(argv) + [str(a) for a in extra_args], env
