"""`python -m realcore.serve --model-path DIR`: the built-in generation engine as a stand-alone
server, started with SGLang's own flag names, so that it and `python -m sglang.launch_server`
swap for each other on one command line (same flags, same HTTP API: docs/engines.md).

Flags:
- served as in SGLang: `--model-path` (or `--model`), `--host` (default 127.0.0.1), `--port`
  (default 30000), `--api-key`, `--random-seed` (default 0), `--max-running-requests` (default 64),
  `--config FILE`, `--log-level`.
- `--config FILE`: SGLang's YAML config, one key per flag (`api-key: ...`, `port: 30001`);
  the command line wins over the file, as in SGLang. realcore's launcher hands SGLang its key this
  way, so the same launch line works for both servers.
- accepted and ignored, with a warning (they tune SGLang's kernels, memory or warm-up; the built-in
  engine has none of these): `--skip-server-warmup`, `--attention-backend`, `--max-total-tokens`,
  `--mem-fraction-static`, `--disable-cuda-graph`, `--trust-remote-code`.
- `--device` (SGLang's): `auto` (the default) serves on the process's GPU when it sees one (cuda:0 of
  its CUDA_VISIBLE_DEVICES), else on the CPU; `cuda` on a GPU or a one-line error (exit 2) where the
  process sees none; `cpu` on the CPU even on a GPU machine (generation.device).
- `--dtype`: `auto` (SGLang's default, and realcore's generation.dtype) is bfloat16 on a GPU and
  float32 on a CPU. On a GPU, `bfloat16` holds the whole model in bf16 and `float32`/`float` in
  float32 (log-probs are taken in float32 from the logits either way). On a CPU, `bfloat16` runs the
  engine's bf16 mode (the decoder's linears in bf16, each step's top logits recomputed in float32:
  docs/generation-engine.md; needs a CPU with bf16 instructions, else a one-line error);
  `half`/`float16` are refused (no fp16 mode).
- LoRA (SGLang's): `--enable-lora`, `--max-lora-rank N` and `--lora-target-modules M ...` (bounds
  of the adapters /load_lora_adapter accepts), `--lora-paths NAME=PATH` (loaded at start; at most
  one: the built-in server holds one adapter, merged into its weights), `--max-loras-per-batch`
  (accepted; one adapter is one per batch).
- accepted only with the value that holds here: `--tp-size`/`--tensor-parallel-size` 1,
  `--dp-size` 1. Any other flag is an error (exit 2), never ignored silently.

The API key: every endpoint needs `Authorization: Bearer <key>` when a key is set. Prefer
`--config FILE` (mode 0600) or the REALCORE_API_KEY environment variable to `--api-key`: a command
line is readable by every user of the machine (`ps`). Without a key the server answers everyone, as
SGLang does; realcore allows that on a loopback address only, with a warning (any local user can
reach a loopback port), and refuses it elsewhere.

SIGTERM stops it (exit 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import yaml

log = logging.getLogger("realcore.serve")

API_KEY_ENV = "REALCORE_API_KEY"
# SGLang flags with no meaning for the built-in engine: name -> takes a value.
IGNORED = {
    "skip-server-warmup": False,
    "disable-cuda-graph": False,
    "trust-remote-code": False,
    "attention-backend": True,
    "max-total-tokens": True,
    "mem-fraction-static": True,
    "lora-backend": True,  # SGLang's LoRA kernels; the built-in server merges the adapter into its weights
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m realcore.serve", allow_abbrev=False,
                description="realcore's built-in generation engine behind SGLang's HTTP API.")
    p.add_argument("--model-path", "--model", dest="model_path", required=True, help="an HF model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help=f"prefer --config FILE or ${API_KEY_ENV}: a command line is public")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--config", default=None, help="SGLang's YAML config: one key per flag (e.g. api-key)")
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1, help="must be 1")
    p.add_argument("--dp-size", type=int, default=1, help="must be 1 (start one server per replica)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: the process's GPU when it sees one, else the CPU")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank accepted")
    p.add_argument("--lora-target-modules", nargs="+", default=None, help="the modules an adapter may target")
    p.add_argument("--lora-paths", nargs="+", default=None, help="NAME=PATH (or PATH) of the adapter loaded at start")
    p.add_argument("--max-loras-per-batch", type=int, default=None, help="accepted (the built-in server holds one)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "half", "float16"],
                   help="auto: bfloat16 on a GPU, float32 on a CPU; on a CPU bfloat16 is the engine's bf16 mode")
    for name, takes_value in IGNORED.items():
        if takes_value:
            p.add_argument(f"--{name}", default=None, help="ignored (SGLang only)")
        else:
            p.add_argument(f"--{name}", action="store_true", help="ignored (SGLang only)")
    return p


def config_argv(path: str) -> list[str]:
    """SGLang's --config file as command-line arguments: `key: value` -> `--key value` (a true
    boolean -> `--key`, a false one -> nothing, a list -> `--key v1 v2`, a mapping -> JSON);
    underscores in keys are read as dashes."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            raise ValueError(f"--config {path}: a config file cannot name another config file")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):  # as SGLang: a JSON-valued flag
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, with --config's keys placed first (so the command line wins), checked."""
    p = parser()
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    config = pre.parse_known_args(argv)[0].config
    try:
        merged = (config_argv(config) if config else []) + argv
    except ValueError as e:
        p.error(str(e))
    args = p.parse_args(merged)
    if args.tp_size != 1 or args.dp_size != 1:
        p.error(f"--tp-size {args.tp_size} --dp-size {args.dp_size}: the built-in engine serves one model copy "
                "in one process (both must be 1; start one server per replica)")
    if args.device == "cuda":
        from realcore.backends.device import process_device  # why: torch, only for --device cuda

        try:
            process_device("cuda")
        except ValueError as e:  # no GPU in this process: before any model is read
            p.error(f"--device cuda: {str(e).removeprefix('device cuda: ')}")
    if args.max_running_requests < 1:
        p.error(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    if not 0 <= args.port < 65536:
        p.error(f"--port must be in [0, 65535], got {args.port}")
    if args.dtype in ("half", "float16"):
        p.error(f"--dtype {args.dtype}: the built-in engine serves float32 or bfloat16 (no float16 mode)")
    args.dtype = {"float": "float32"}.get(args.dtype, args.dtype)  # auto: resolved for the device by run_server
    if args.lora_paths and len(args.lora_paths) > 1:
        p.error(f"--lora-paths: the built-in engine holds one adapter, got {len(args.lora_paths)}")
    return args


def lora_serving(args: argparse.Namespace):
    """SGLang's LoRA flags -> weight_intake.LoraServing, or None when LoRA is off (as SGLang,
    --lora-paths turns it on)."""
    from realcore.backends.genserver.weight_intake import LoraServing  # why: torch, only once the flags are good

    if not (args.enable_lora or args.lora_paths):
        return None
    initial = None
    if args.lora_paths:
        name, sep, path = args.lora_paths[0].partition("=")
        initial = (name, path) if sep else (name, name)
    return LoraServing(args.max_lora_rank, args.lora_target_modules, initial)


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key (command line or --config), else $REALCORE_API_KEY, else None."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s realcore.serve %(levelname)s %(message)s")
    from realcore.backends.genserver.http import is_loopback, run_server  # why: torch, only once the flags are good

    for name in IGNORED:
        if getattr(args, name.replace("-", "_")) not in (None, False):
            log.warning("--%s is an SGLang flag with no meaning for the built-in engine: ignored", name)
    if args.api_key and any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        log.warning("--api-key on the command line is visible to every user (ps); prefer --config FILE or $%s",
                    API_KEY_ENV)
    key = api_key(args)
    if key is None:
        if not is_loopback(args.host):
            print(f"realcore.serve: --host {args.host} is not a loopback address: an API key is required "
                  f"(--config FILE with `api-key: ...`, ${API_KEY_ENV}, or --api-key)", file=sys.stderr)
            return 2
        log.warning("no API key: every endpoint (weight loading included) answers any user of this machine; "
                    "set one with --config FILE or $%s", API_KEY_ENV)

    def ready(addrs: dict) -> None:
        # SGLang's own readiness line, so scripts that wait for it work with either server.
        log.info("The server is fired up and ready to roll! (%s)", addrs["http"])

    try:
        run_server(args.model_path, host=args.host, port=args.port, seed=args.random_seed,
                   max_batch_size=args.max_running_requests, token=key, on_ready=ready, no_token_on_loopback=True,
                   lora_serving=lora_serving(args), device=args.device, dtype=args.dtype)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:  # a bad model path, a port in use: one line, no traceback
        print(f"realcore.serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
