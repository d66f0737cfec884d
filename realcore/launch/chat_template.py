"""model.use_chat_template, decided once by the launcher (config.json carries it to every process).

None (the default) is auto: on when the tokenizer has a chat template and the model says it is an
instruct or chat model: a word `instruct...`, `chat` or `it` (Gemma's -it) in model.name, in the
model folder's name, or, for a folder of the Hugging Face cache (.../models--ORG--NAME/snapshots/HASH),
in NAME. A base model whose tokenizer ships a template anyway (Qwen2.5 base, the tiny test model)
stays on plain prompts; set true or false to override.
"""

from __future__ import annotations

import os
import re

from realcore.api.config import ExperimentConfig

CHAT_WORDS = re.compile(r"^(instruct\w*|chat|it)$")


def model_names(name: str, path: str | None) -> list[str]:
    """The names that say what the model is: model.name and the model folder's (or its HF-cache repo's)."""
    out = [name]
    if path:
        folder = os.path.normpath(os.path.expanduser(path))
        out.append(os.path.basename(folder))
        if os.path.basename(os.path.dirname(folder)) == "snapshots":
            out.append(os.path.basename(os.path.dirname(os.path.dirname(folder))))
    return out


def says_instruct(names: list[str]) -> bool:
    return any(CHAT_WORDS.match(w) for n in names for w in re.split(r"[^a-z0-9]+", n.lower()))


def auto_chat_template(tokenizer, name: str, path: str | None) -> tuple[bool, str]:
    """(use the chat template?, why) by the rule above."""
    if not getattr(tokenizer, "chat_template", None):
        return False, "the tokenizer has no chat template"
    if not says_instruct(model_names(name, path)):
        return False, "a base model: no instruct/chat/it in its name"
    return True, "the tokenizer has a chat template and the model's name says instruct/chat"


def resolve_chat_template(cfg: ExperimentConfig, tokenizer) -> str:
    """Set cfg.model.use_chat_template (auto -> true/false) and return the line the run prints.
    Experiments that hand it to their workflow (`chat: ${model.use_chat_template}`, composed before
    any tokenizer was read) get the same value."""
    m = cfg.model
    if m.use_chat_template is None:
        m.use_chat_template, why = auto_chat_template(tokenizer, m.name, m.path)
        why = f"auto: {why}"
    else:
        why = "set in the config"
    if "chat" in cfg.rollout.workflow_kwargs and cfg.rollout.workflow_kwargs["chat"] is None:
        cfg.rollout.workflow_kwargs["chat"] = m.use_chat_template
    return f"model.use_chat_template: {str(m.use_chat_template).lower()} ({why})"
