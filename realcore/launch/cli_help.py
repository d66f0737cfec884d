"""The launcher's usage text, `--help [PREFIX]`, and docs/configuration.md, all from one source:
the config models' descriptions and defaults (realcore.api.config.config_entries).

`python -m realcore.launch.cli_help > docs/configuration.md` regenerates the reference page; a test
fails when the page is not current.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel

from realcore.api.config import REQUIRED, ConfigKey, config_entries

REGENERATE = "python -m realcore.launch.cli_help > docs/configuration.md"

USAGE = """\
usage: python -m realcore.launch [--dry-run | --print-config] [experiment=NAME] [key=value ...]
       python -m realcore.launch --help [PREFIX]
  experiment=NAME: an experiment of experiments/experiment/ (default: ppo-math); key=value overrides one key
  --dry-run: check the config, the model and the dataset (a model that needs building or converting is
    cached in model.cache_dir), print what would run, and exit without starting anything or writing into
    output_dir (no folder, no lock). local: each process and its GPUs, and each SGLang/vLLM server's command
    line; ray: the placement groups' bundles; slurm: the batch script and the files the run would write
  --print-config: compose and validate the configuration as a launch does (the experiment, the overrides,
    the `imports:` modules), print it as YAML, and exit without starting or writing anything
  a config error is one line on stderr and exit code 2
  --help [PREFIX]: the keys below (those starting with PREFIX), each with its default: the config model's
    own; the experiment's YAML may set another (--print-config shows the values a run gets)"""


def format_default(value: Any) -> str:
    """A default as one would write it on the command line: null, true, 32, [a, b], {}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        # Plain when hydra would read it back as this string; quoted (JSON escapes) otherwise.
        return value if re.fullmatch(r"[\w./~:+-]+", value) else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_default(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_default(v)}" for k, v in value.items()) + "}"
    return repr(value)


def default_text(entry: ConfigKey) -> str:
    """` (default: X)`; nothing for a required key or a section that has a default (its keys show theirs)."""
    if entry.default is REQUIRED or isinstance(entry.default, BaseModel):
        return ""
    if entry.section is not None and entry.default == []:  # mfcs: a list of sections
        return " (default: [])"
    return f" (default: {format_default(entry.default)})"


def help_text(prefix: str = "") -> str:
    """What `--help [PREFIX]` prints."""
    lines = [USAGE, "config keys (python -m realcore.launch --help PREFIX shows those under PREFIX):"]
    for e in config_entries():
        if e.key.startswith(prefix):
            lines += [f"  {e.key}{default_text(e)}", f"      {e.description}"]
    return "\n".join(lines)


def markdown() -> str:
    """docs/configuration.md: every key by section, with its default and description."""
    entries = config_entries()
    sections: dict[str, list[ConfigKey]] = {"": []}  # "": the top-level keys that are not sections
    heads = {e.key: e for e in entries if e.section is not None}
    for e in entries:
        if e.section is not None:
            sections[e.key] = []
        else:
            sections[e.key.rpartition(".")[0]].append(e)
    out = ["# Configuration reference", "",
           f"<!-- Generated from realcore/api/config.py by `{REGENERATE}`; do not edit by hand. -->", "",
           "Every key of an experiment's configuration, as `python -m realcore.launch --help` prints it. "
           "Set a key on the command line (`trainer.total_steps=20`) or in an experiment's YAML. The defaults "
           "are the config models' own: an experiment (`experiment=NAME`, default `ppo-math`) may set others; "
           "`python -m realcore.launch --print-config experiment=NAME` prints the values a run gets.", "",
           "Keys under `mfcs` are those of each item of the list, keys under `roles` those of each named role.", ""]
    for key, items in sections.items():
        if key:
            head = heads[key]
            out += [f"{'#' * min(6, key.count('.') + 2)} `{key}`", "",
                    f"`{key}`{default_text(head)}: {head.description}", ""]
            doc = " ".join((head.section.__doc__ or "").split())
            if doc:
                out += [doc, ""]
        else:
            out += ["## Run", ""]
        out += [f"- `{e.key}`{default_text(e)}: {e.description}" for e in items]
        if items:
            out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
