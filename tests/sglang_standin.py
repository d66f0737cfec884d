"""A stand-in for SGLang's server on realcore's built-in one (`realcore.serve`, which takes SGLang's
flags and `--config` file), that also logs what SGLang logs at start-up: its `server_args` at INFO,
the api_key included (upstream sgl-project/sglang#37457). So a whole run with
`allocation_mode=sglang.*` goes through realcore's real launch path (engine check, command line,
key file, log capture) and a test can check that the key never reaches a log.

`interpreter(folder)` writes an executable `folder/bin/python` to name as `rollout.server_python`:
it runs this interpreter with a package `sglang` importable whose `sglang.launch_server` runs this
module (as tests/vllm_standin.py does for vLLM).
"""

from __future__ import annotations

import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def interpreter(folder) -> str:
    """Write `folder/bin/python`, in which `python -m sglang.launch_server` runs this stand-in; its path."""
    site = os.path.join(str(folder), "site")
    os.makedirs(os.path.join(site, "sglang"), exist_ok=True)
    open(os.path.join(site, "sglang", "__init__.py"), "w").close()
    with open(os.path.join(site, "sglang", "launch_server.py"), "w") as f:
        f.write("import sglang_standin\n\nsglang_standin.main()\n")
    exe = os.path.join(str(folder), "bin", "python")
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    with open(exe, "w") as f:
        f.write(f'#!/bin/sh\nPYTHONPATH="{site}:{_HERE}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    os.chmod(exe, 0o755)
    return exe


def server_args_line(args) -> str:
    """SGLang's start-up line: `[time] server_args=ServerArgs(model_path='...', ..., api_key='...', ...)`
    (sglang/srt/entrypoints/http_server.py logs the dataclass's repr at INFO)."""
    fields = {"model_path": args.model_path, "tokenizer_path": args.model_path, "host": args.host, "port": args.port,
              "mem_fraction_static": None, "max_running_requests": args.max_running_requests, "device": args.device,
              "tp_size": args.tp_size, "random_seed": args.random_seed, "api_key": args.api_key,
              "served_model_name": args.model_path, "attention_backend": "torch_native"}
    body = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    return f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] server_args=ServerArgs({body})"


def main() -> None:
    from realcore import serve

    argv = sys.argv[1:]
    print(server_args_line(serve.parse_args(argv)), flush=True)
    sys.exit(serve.main(argv))
