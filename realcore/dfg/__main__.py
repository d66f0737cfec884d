"""`python -m realcore.dfg show experiment=ppo-math [out=FILE.png] [other overrides]`"""

from __future__ import annotations

import sys

from realcore.dfg.draw import draw
from realcore.dfg.graph import GraphError, build_graph
from realcore.dfg.prune import drop_unread_mfcs
from realcore.launch.config_loader import ConfigError, import_user_modules, load_config
from realcore.api.registry import source_keys


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "show":
        print("usage: python -m realcore.dfg show experiment=NAME [out=FILE.png] [overrides...]", file=sys.stderr)
        return 2
    out = None
    overrides = []
    for a in argv[1:]:
        if a.startswith("out="):
            out = a[4:]
        else:
            overrides.append(a)
    try:
        cfg = load_config(overrides)
        import_user_modules(cfg)
        for line in drop_unread_mfcs(cfg):
            print(line)
        dfg = build_graph(cfg, source_keys(cfg))
    except (ConfigError, GraphError, KeyError) as e:
        print(f"realcore: config error: {e}", file=sys.stderr)
        return 2
    print(dfg.describe())
    if out:
        draw(dfg, out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
