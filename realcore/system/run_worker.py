"""Entry point of every worker process: `python -m realcore.system.run_worker --type TYPE ...`.

The launcher (or a Slurm/Ray step) starts it with the run's resolved config file and secret file.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from realcore.api.config import ExperimentConfig
from realcore.system.process import setup_worker_process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--type", choices=["master", "model_worker"], required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--world", type=int, required=True, help="number of model workers")
    p.add_argument("--config", required=True, help="resolved experiment config (JSON)")
    p.add_argument("--secret-file", required=True)
    args = p.parse_args(argv)

    with open(args.config) as f:
        cfg = ExperimentConfig.model_validate_json(f.read())
    name = "master" if args.type == "master" else f"model_worker/{args.index}"
    setup_worker_process(f"rc-{name.replace('model_worker/', 'mw')}", cfg.system.threads_per_process)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s", stream=sys.stderr)
    if args.type == "master":  # the master's output goes to the console; keep a copy with the logs
        handler = logging.FileHandler(os.path.join(cfg.output_dir, "logs", "master.log"))
        handler.setFormatter(logging.getLogger().handlers[0].formatter)
        logging.getLogger().addHandler(handler)

    from realcore.system.plugins import load_plugins
    from realcore.system.wire import load_secret

    load_plugins(cfg.imports)
    secret = load_secret(args.secret_file)
    if args.type == "master":
        from realcore.system.master import Master

        master = Master(cfg, secret, args.world)
        try:
            master.run()
        finally:
            master.shutdown()
        return 0

    from realcore.system.model_worker import ModelWorker

    worker = ModelWorker(cfg, args.index, args.world, secret)
    try:
        worker.run()
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
