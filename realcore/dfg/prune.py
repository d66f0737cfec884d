"""Drop the MFCs whose outputs nobody reads under this config, and the roles left with nothing to run.

An MFC class may say which of its listed inputs a config leaves unread (a classmethod
`unread_inputs(cfg, mfc) -> set of input names`, e.g. ppo_update does not read ref_logprobs when
ppo.kl_coef and args.kl_in_reward are 0). An MFC that neither trains nor generates, whose every
output is listed by other MFCs only as such an unread input, is dropped, and so is a role that no
MFC runs on any more: with ppo.kl_coef=0, ppo-math runs no ref_inf and builds no reference model
(verl's rule: no KL, no reference), and `ref=null` is valid. An output nobody lists keeps its MFC:
only what the config itself turned off goes.

The launcher prunes once, before config.json is written, so every process sees the same graph.
"""

from __future__ import annotations

from realcore.api.alloc import parse_allocation_mode
from realcore.api.config import ExperimentConfig, MFCConfig
from realcore.api.registry import lookup, mfc_spec, registered, source_keys
from realcore.dfg.graph import GraphError


def _outputs(m: MFCConfig) -> list[str]:
    return [m.output_remap.get(k, k) for k in m.outputs]


def _unread(cfg: ExperimentConfig, m: MFCConfig) -> set[str]:
    """The buffer keys `m` lists as inputs but does not read under `cfg`."""
    if m.type not in registered("mfc"):
        return set()  # build_graph reports the unknown type
    hook = getattr(lookup("mfc", m.type), "unread_inputs", None)
    names = set(hook(cfg, m)) if hook is not None else set()
    return {k for k in m.inputs if m.input_remap.get(k, k) in names}


def _droppable(m: MFCConfig) -> bool:
    if m.type not in registered("mfc") or not m.outputs:
        return False
    spec = mfc_spec(m.type)
    return not (spec.trains or spec.generates)


def drop_unprovided_optional_inputs(cfg: ExperimentConfig) -> None:
    """An MFC's optional inputs (MFCSpec.optional_inputs) that neither the data source nor any MFC
    provides leave its input list, in place: the graph then asks nobody for them."""
    provided = set(source_keys(cfg)) | {k for m in cfg.mfcs for k in _outputs(m)}
    for m in cfg.mfcs:
        if m.type not in registered("mfc"):
            continue  # build_graph reports the unknown type
        optional = set(mfc_spec(m.type).optional_inputs)
        m.inputs = [k for k in m.inputs if k in provided or m.input_remap.get(k, k) not in optional]


def drop_unread_mfcs(cfg: ExperimentConfig) -> list[str]:
    """Prune `cfg` in place (its mfcs, consumers' inputs, `ref` and `roles`); returns one line per
    MFC or role dropped, for the run's first lines. GraphError when a kept MFC needs a role that is
    not declared (e.g. ref=null while the KL term reads the reference's log-probs)."""
    drop_unprovided_optional_inputs(cfg)
    unread = {m.name: _unread(cfg, m) for m in cfg.mfcs}
    kept, dropped = list(cfg.mfcs), []
    while True:
        listed = {k for m in kept for k in m.inputs}
        read = {k for m in kept for k in m.inputs if k not in unread[m.name]}
        gone = [m for m in kept if _droppable(m) and all(k in listed and k not in read for k in _outputs(m))]
        if not gone:
            break
        dropped += gone
        kept = [m for m in kept if m not in gone]
    lines = []
    for d in dropped:
        keys = _outputs(d)
        for m in kept:
            if any(k in m.inputs for k in keys):
                m.inputs = [k for k in m.inputs if k not in keys]
                m.input_remap = {k: v for k, v in m.input_remap.items() if k not in keys}
        why = " (ppo_update and critic_train read it only when ppo.kl_coef or kl_in_reward > 0)" if "ref_logprobs" in keys else ""
        lines.append(f"{d.name} is not run: no MFC reads its {', '.join(keys)} under this config{why}")
    roles = cfg.roles()
    for m in kept:
        if m.model is not None and m.model not in roles:
            needs = [c.name for c in kept if set(_outputs(m)) & (set(c.inputs) - unread[c.name])]
            declared = (f"ref: null (with ppo.kl_coef={cfg.ppo.kl_coef:g})" if m.model == "ref"
                        else f"roles.{m.model} is not declared")
            raise GraphError(f"{declared}, but MFC {m.name} runs on it and {', '.join(needs) or 'an MFC'} reads its "
                             f"{', '.join(_outputs(m))}; set ppo.kl_coef=0 (and any kl_in_reward to 0) to train "
                             f"without it, or declare the role")
    used = {m.model for m in kept}
    unused = [r for r in {m.model for m in dropped} if r is not None and r in roles and r not in used]
    try:
        placed = parse_allocation_mode(cfg.allocation_mode).role_meshes
    except ValueError:
        placed = {}  # the launcher's checks report an unparsable mode
    for role in unused:
        if role in placed:
            raise GraphError(f"allocation_mode: places role {role!r}, but no MFC runs on it ("
                             f"{', '.join(d.name for d in dropped if d.model == role)} dropped: nothing reads its "
                             "outputs); take it out of allocation_mode")
    cfg.mfcs = kept
    for role in sorted(unused):
        if role == "ref":
            cfg.ref = None
        else:
            cfg.roles_ = {k: v for k, v in cfg.roles_.items() if k != role}
        lines.append(f"model role {role} is not built: no MFC runs on it")
    return lines
