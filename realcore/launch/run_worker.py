"""Entry point of every worker process: `python -m realcore.launch.run_worker --type TYPE ...`.

The launcher (or a Slurm/Ray step) starts it with the run's resolved config file and secret file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from realcore.api.alloc import parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.backends.clients.registry import capabilities
from realcore.backends.server_launch import server_token
from realcore.launch.controller import run_script
from realcore.launch.engine_server import serve_engine
from realcore.launch.plugins import load_plugins
from realcore.launch.process import PREEMPTED_EXIT, node_address, run_and_exit, setup_worker_process, start_heartbeat
from realcore.rollout.gserver_manager import GServerManager
from realcore.plot import plot_run
from realcore.trainer.master import Master, Preempted
from realcore.transport import addresses, wire
from realcore.transport.name_resolve import make_name_resolver, use_secret
from realcore.transport.wire import load_secret


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--type", choices=["master", "model_worker", "gen_server", "gserver_manager", "rollout_worker"], required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--index-from", metavar="ENV", help="read the index from this variable (SLURM_PROCID in a job step)")
    p.add_argument("--world", type=int, required=True, help="number of model workers")
    p.add_argument("--config", required=True, help="resolved experiment config (JSON)")
    p.add_argument("--secret-file", required=True)
    p.add_argument("--n-servers", type=int, default=0, help="generation servers (async mode)")
    p.add_argument("--attempt", type=int, default=0, help="how many times the launcher restarted the whole run")
    p.add_argument("--ignore-sigterm", action="store_true",
                   help="a task runner stops this process, not SIGTERM (Slurm sends SIGTERM to every process of a step)")
    args = p.parse_args(argv)

    if args.index_from:
        args.index = int(os.environ[args.index_from])
    with open(args.config) as f:
        cfg = ExperimentConfig.model_validate_json(f.read())
    # Bind and publish this node's address (several nodes under Slurm; loopback by default).
    cfg.system.host = node_address(cfg.system.host, cfg.system.interface)
    name = args.type if args.type in ("master", "gserver_manager") else f"{args.type}/{args.index}"
    setup_worker_process(f"rc-{name}", cfg.system.threads_per_process, ignore_sigterm=args.ignore_sigterm,
                         torch_threads=args.type not in ("master", "gserver_manager"))
    start_heartbeat(os.path.join(cfg.output_dir, ".heartbeat", name.replace("/", "-")), cfg.system.heartbeat_interval_s)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s", stream=sys.stderr)
    if args.type == "master":  # the master's output goes to the console; keep a copy with the logs
        handler = logging.FileHandler(os.path.join(cfg.output_dir, "logs", "master.log"))
        handler.setFormatter(logging.getLogger().handlers[0].formatter)
        logging.getLogger().addHandler(handler)
    if "SLURMD_NODENAME" in os.environ:
        logging.info("on node %s (job %s), address %s", os.environ["SLURMD_NODENAME"], os.environ.get("SLURM_JOB_ID"), cfg.system.host)

    load_plugins(cfg.imports)
    secret = load_secret(args.secret_file)
    use_secret(secret)  # every resolver of this process signs and checks its entries with it
    # Every generation server requires a bearer token, on loopback too (any local user can reach a
    # loopback port): rollout.server_token, or one derived from the run's secret, which every process
    # of the run (the launcher included, for SGLang/vLLM) and nobody else can read.
    cfg.rollout.server_token = server_token(secret, cfg.rollout.server_token)
    if args.type == "master" and cfg.script is not None:  # the loop of a user's file (realcore.Controller)
        rc = run_script(cfg, secret, args.world)
        if rc == 0:
            write_curves(cfg.output_dir)
        return rc
    if args.type == "master":
        master = Master(cfg, secret, args.world)
        try:
            master.run()
        except Preempted as e:
            logging.warning("%s: a recover checkpoint holds the run; start it again to continue", e)
            return PREEMPTED_EXIT
        finally:
            master.shutdown()
        write_curves(cfg.output_dir)
        return 0

    return run(args, cfg, secret)


def run(args, cfg: ExperimentConfig, secret: bytes) -> int:
    if args.type == "model_worker":
        from realcore.trainer.model_worker import ModelWorker  # torch: the master and the manager start without it

        worker = ModelWorker(cfg, args.index, args.world, secret)
        try:
            worker.run()
        finally:
            worker.close()
    elif args.type == "gen_server" and not capabilities(parse_allocation_mode(cfg.allocation_mode).backend).own_worker:
        return serve_engine(cfg, args.index)  # SGLang/vLLM under Slurm or Ray
    elif args.type == "gen_server":
        from realcore.backends.genserver.http import run_server  # torch and aiohttp, only in a server process

        resolver = make_name_resolver(cfg.system.name_resolve)
        run_server(cfg.model.path, host=cfg.system.host, port=0, seed=cfg.seed + 1000 * args.index,
                   max_batch_size=cfg.generation.max_batch_size, device=cfg.generation.device, dtype=cfg.generation.dtype, token=cfg.rollout.server_token, secret=secret,
                   max_body_bytes=cfg.system.max_http_body_bytes, limits=wire.Limits.of(cfg.system), stop_on_sigterm=not args.ignore_sigterm,
                   header_timeout_s=cfg.system.http_header_timeout_s, body_timeout_s=cfg.system.http_body_timeout_s,
                   connect_timeout_s=cfg.system.weight_group_connect_timeout_s,
                   on_ready=lambda addrs: addresses.publish_gen_server(resolver, cfg, args.index, addresses.GenServerAddress(**addrs)))
    elif args.type == "gserver_manager":
        manager = GServerManager(cfg, secret, args.n_servers, args.attempt)
        try:
            manager.run()
        finally:
            manager.close()
    elif args.type == "rollout_worker":
        from realcore.rollout.rollout_worker import RolloutWorker  # torch: the master and the manager start without it

        asyncio.run(RolloutWorker(cfg, args.index, secret).main())
    return 0


def write_curves(output_dir: str) -> None:
    """A picture of the finished run (realcore.plot); never worth failing a finished run over.
    main() draws it after shutdown(): the workers end while it draws (~1 s)."""
    try:
        plot_run(output_dir)
    except Exception as e:
        logging.warning("curves.png not written: %s: %s", type(e).__name__, e)


if __name__ == "__main__":
    run_and_exit(main)
