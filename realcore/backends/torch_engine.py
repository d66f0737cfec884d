"""TorchEngine: a HF causal LM on one data-parallel rank, with packed micro-batches and AdamW.

Sequences are packed without padding: a micro-batch is one row (1, T) with position ids restarting
at 0 per sequence, and attention sees the row's sequence boundaries (cu_seqlens, varlen_attention.py),
never a dense (T, T) mask. Gradients are summed across the data-parallel group by hand (one
flat bucket per dtype, after the whole backward: no overlap with it, kept simple while DP
replicas are small; backend=fsdp overlaps its reduce-scatters), so the loss is the token-level mean
over the global batch whatever the micro-batch split or DP size.

Device and precision: the engine computes on this process's current device (device.py: the
GPU the process selected before its process group, else the CPU). `role.dtype` "auto" is bfloat16
on a GPU, float32 on a CPU. A trainable role keeps float32 parameters (AdamW's master copy) and
bfloat16 autocasts its forward. On a GPU an inference-only role (a reference) in bfloat16 holds its
parameters in bfloat16 instead: half the memory and no per-forward weight casts, the numbers a bf16
server (or FSDP's bf16 gather) computes; its log-probs are still taken in float32. (On a CPU, where
bf16 is an opt-in speed mode with its own measured numbers, every role keeps float32 parameters and
autocasts, as before.) An explicit float32 role on a GPU computes in true float32: TF32 matmuls stay
off (torch's default), so its log-probs match float32 generation servers exactly, not to TF32's
10-bit mantissa.

Heads (role.head): a policy's loss gets log-probs and entropy; a value or score role is the same
body with a fresh one-output linear head (models.load_head_model): its loss gets values shifted to
the state before each token, or the head at each sequence's last token; save_hf writes them as HF
*ForTokenClassification / *ForSequenceClassification. Only a policy generates or takes LoRA.

FSDPEngine (fsdp_engine.py) shards the same engine through the hooks `_parallelize`, `_autocast`,
`_idle_passes` and `_reduce_grads`.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from realcore.api.config import RoleConfig
from realcore.api.engine import Engine, GenerationResult, HeadOutput, LossFn, LossWeightFn
from realcore.backends import lora, onednn_linear
from realcore.backends.batching import (cu_seqlens, lr_factor, pack, reduce_weighted, shift_head, split_by_budget,
                                        stat_on, token_logprobs, train_batch)
from realcore.backends.device import compute_device, group_device, to_device
from realcore.backends.generation import GenerationEngine
from realcore.backends.models import export_head_config, load_head_model
from realcore.backends.precision import compute_dtype
from realcore.backends.varlen_attention import packed_kwargs, standard_attention, use_packed_attention
from realcore.transport.durable import replace_dir

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _allreduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum gradients over the group, one flat bucket per dtype (few large collectives)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))


class TorchEngine(Engine):
    """One data-parallel rank of a model role, backed by a HF `AutoModelForCausalLM` (role.head
    policy) or the same body with a one-output linear head (value, score: models.load_head_model)."""

    def __init__(self, model_path: str, role: RoleConfig, *, total_steps: int, seed: int = 0, group=None):
        self.role, self.seed, self.version = role, seed, 0
        self.device = compute_device()
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.distributed else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        # Small collectives (counts, stats) on the device of the group's backend (NCCL: the GPU).
        self.comm_device = group_device(self.group) if self.distributed else self.device
        self.dtype = compute_dtype(role.dtype, self.device)  # "auto" resolved; ValueError where bf16 cannot run
        # A trainable role's parameters stay float32 (the optimizer's master copy), `dtype` is then the
        # autocast dtype; an inference-only one on a GPU holds them in `dtype` (module docstring).
        self.param_dtype = self.dtype if not role.trainable and self.device.type == "cuda" else torch.float32
        if role.lora is not None and role.head != "policy":
            raise ValueError(f"lora: a {role.head} head trains every weight (LoRA is for policy heads); drop lora")
        self.model = load_head_model(model_path, role.head, dtype=self.param_dtype, seed=seed)
        use_packed_attention(self.model)  # packed rows by cu_seqlens; generation switches back to sdpa
        if role.lora is not None:  # PEFT wrapper: base weights frozen, only the adapters train
            self.model = lora.apply_lora(self.model, role.lora, seed=seed)
        self.tokenizer = _load_tokenizer(model_path)
        self._gen_engine = None
        self.optimizer = self.scheduler = None
        if not role.trainable:
            self.model.eval()
            self.model.requires_grad_(False)
        self._parallelize()
        if role.trainable:
            self._init_training(role, total_steps)

    def _parallelize(self) -> None:
        """Hook: place the model on the device and wrap it for training (FSDPEngine shards it). Here:
        replicated, with HF gradient checkpointing (every decoder layer recomputed in backward) when asked."""
        self.model.to(self.device)
        onednn_linear.use_onednn(self.model)  # float32 on a CPU: oneDNN's GEMMs, not MKL's (module docstring)
        if self.role.gradient_checkpointing:
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:  # transformers < 5.2x names it gradient_checkpointing_enable
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def _init_training(self, role: RoleConfig, total_steps: int) -> None:
        opt = role.optimizer
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, opt, total_steps))

    # ---- forward ----

    def _autocast(self):
        # dtype=bfloat16: matmuls in bf16 on float32 parameters; log-probs are still taken in float32.
        if self.dtype == torch.bfloat16 and self.param_dtype == torch.float32:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward_packed(self, seqs: list[torch.Tensor], temperature: float, with_entropy: bool) -> HeadOutput:
        """Forward one packed micro-batch through the role's head: per-token logprobs (and entropy
        when asked) of a policy, values (T,) of a value head, scores (n_seqs,) of a score head."""
        lens = [int(s.numel()) for s in seqs]
        ids = to_device(torch.cat(seqs).to(torch.int64), self.device)  # (T,)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])  # (T,)
        cu = to_device(cu_seqlens(lens), self.device)
        with self._autocast():  # varlen attention: the row's sequence boundaries, no (T, T) mask
            logits = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                                **packed_kwargs(cu, lens)).logits[0]  # (T, V); value/score heads: (T, 1)
        if self.role.head == "policy":
            lp, ent = token_logprobs(logits, ids, pos == 0, temperature, with_entropy)
            return HeadOutput(cu, logprobs=lp, entropy=ent)
        h = logits[:, 0].float()  # the head after reading x[:t + 1]
        if self.role.head == "value":
            return HeadOutput(cu, values=shift_head(h, pos == 0))
        return HeadOutput(cu, scores=h[cu[1:].long() - 1])

    @contextlib.contextmanager
    def _eval_mode(self):
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    def logprobs(self, input_ids: list[torch.Tensor], temperature: float = 1.0, *,
                 max_tokens_per_mb: int | None = None) -> list[torch.Tensor]:
        return self._infer("policy", input_ids, temperature, max_tokens_per_mb)

    def values(self, input_ids: list[torch.Tensor], *, max_tokens_per_mb: int | None = None) -> list[torch.Tensor]:
        return self._infer("value", input_ids, 1.0, max_tokens_per_mb)

    def scores(self, input_ids: list[torch.Tensor], *, max_tokens_per_mb: int | None = None) -> list[torch.Tensor]:
        return self._infer("score", input_ids, 1.0, max_tokens_per_mb)

    def _infer(self, head: str, input_ids: list[torch.Tensor], temperature: float,
               max_tokens_per_mb: int | None) -> list[torch.Tensor]:
        """logprobs, values or scores (float32, on the host) of every sequence, by micro-batches."""
        if self.role.head != head:
            call = {"policy": "logprobs", "value": "values", "score": "scores"}[head]
            raise ValueError(f"{call}: needs a role with head: {head} (this role's head is {self.role.head})")
        out: list[torch.Tensor] = []  # per micro-batch, on the device: one copy to the host at the end
        lens = [int(x.numel()) for x in input_ids]
        mbs = split_by_budget(lens, max_tokens_per_mb or self.role.max_tokens_per_mb) if lens else []
        idle = self._idle_passes(len(mbs))
        with torch.no_grad(), self._eval_mode():
            for mb in mbs:
                o = self._forward_packed([input_ids[i] for i in mb], temperature, with_entropy=False)
                out.append({"policy": o.logprobs, "value": o.values, "score": o.scores}[head].float())
            for _ in range(idle):
                self._idle_pass(backward=False)
        if not out:
            return []
        if head == "score":  # split_by_budget keeps the sequences' order
            return list(torch.cat(out).cpu().unbind())
        return list(torch.cat(out).cpu().split([lens[i] for mb in mbs for i in mb]))

    def _idle_passes(self, n_passes: int) -> int:
        """Hook: passes this rank adds to its `n_passes` so that every rank of the group runs as many
        (FSDPEngine: every pass gathers parameters collectively). Replicated: none."""
        return 0

    def _idle_pass(self, backward: bool) -> None:
        """A forward (and backward) on two dummy tokens that changes no parameter: zero gradients."""
        o = self._forward_packed([torch.zeros(2, dtype=torch.int64)], 1.0, with_entropy=False)
        if backward:
            out = next(t for t in (o.logprobs, o.values, o.scores) if t is not None)
            (out.sum() * 0.0).backward()

    # ---- training ----

    def train_batch(self, data: dict[str, list[torch.Tensor]], loss_fn: LossFn, loss_weight_fn: LossWeightFn, *,
                    n_minibatches: int = 1, temperature: float = 1.0, max_tokens_per_mb: int | None = None,
                    group_sizes: list[int] | None = None) -> dict[str, float]:
        return train_batch(self, data, loss_fn, loss_weight_fn, n_minibatches=n_minibatches, temperature=temperature,
                           max_tokens_per_mb=max_tokens_per_mb, group_sizes=group_sizes)

    def _train_minibatch(self, data, loss_fn, loss_weight_fn, temperature, max_tokens_per_mb: int | None,
                         group_sizes: list[int] | None = None) -> dict[str, float]:
        """Accumulate token-weighted gradients over micro-batches and ranks, then one optimizer step."""
        lens = [int(x.numel()) for x in data["input_ids"]]
        mbs = []
        for idx in split_by_budget(lens, max_tokens_per_mb or self.role.max_tokens_per_mb, group_sizes) if lens else []:
            packed = pack(data, idx)  # with cu_seqlens, the sequence boundaries for the loss
            w = float(loss_weight_fn(packed))  # on the host's copy: no device sync per micro-batch
            mbs.append((idx, {k: to_device(v, self.device) for k, v in packed.items()}, w))
        global_w = self._allreduce_scalar(sum(w for _, _, w in mbs))
        mbs = [mb for mb in mbs if mb[2] != 0]  # contributes nothing, and its mean may be 0/0
        idle = self._idle_passes(len(mbs))
        sums: dict[str, torch.Tensor] = {}  # on the device, read once per minibatch (reduce_weighted)
        weights: dict[str, float] = {}
        for idx, packed, w in mbs:
            out = self._forward_packed([data["input_ids"][i] for i in idx], temperature,
                                       with_entropy=self.role.head == "policy")
            loss, stats = loss_fn(out, packed)
            (loss * (w / global_w)).backward()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + stat_on(v, self.device) * w
                weights[k] = weights.get(k, 0.0) + w
        for _ in range(idle):
            self._idle_pass(backward=True)
        stats = reduce_weighted(sums, weights, self.group, self.world_size, self.comm_device)
        stats["lr"] = self.optimizer.param_groups[0]["lr"]
        stats["grad_norm"] = self._step()
        return stats

    def _allreduce_scalar(self, x: float) -> float:
        if self.world_size == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t)

    def _step(self) -> float:
        """Sum grads over ranks, clip, step optimizer and schedule; returns the pre-clip grad norm."""
        for p in self.params:
            if p.grad is None:  # untouched this step (or empty minibatch): still joins the all-reduce
                p.grad = torch.zeros_like(p)
        self._reduce_grads()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.role.optimizer.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # sharded gradients (DTensors): the norm over all shards
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return float(grad_norm)

    def _reduce_grads(self) -> None:
        """Hook: sum gradients over the data-parallel group (FSDPEngine: done by FSDP in backward)."""
        if self.world_size > 1:
            _allreduce_grads(self.params, self.group)

    # ---- generation and checkpoints ----

    def generate(self, prompts: list[list[int]], gconfig) -> list[GenerationResult]:
        if self.role.head != "policy":
            raise ValueError(f"generate: a {self.role.head} head does not sample (only head: policy roles generate)")
        if self._gen_engine is None:
            self._gen_engine = GenerationEngine(self.model, self.tokenizer, seed=self.seed)
        with torch.no_grad(), self._eval_mode(), standard_attention(self.model):
            return self._gen_engine.generate(prompts, gconfig)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights under HF names, what servers load (with LoRA: base + adapter merged)."""
        return lora.merged_state(self.model) if self.role.lora is not None else self.model.state_dict()

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """LoRA: the adapter's tensors under PEFT's saved names, what an in-memory update pushes
        (FSDPEngine: collective, on rank 0 only)."""
        return lora.adapter_state(self.model)

    def _exports_merged(self, merged: bool) -> bool:
        return merged and self.role.lora is not None and self.role.lora.export_merged

    def save_hf(self, path: str, *, merged: bool = True) -> None:
        """Write a HF checkpoint atomically (tmp dir + rename). Only rank 0 of the group writes:
        weights are identical on every data-parallel rank. With LoRA: the adapter folder (PEFT's
        adapter_model.safetensors + adapter_config.json), plus `merged/` when lora.export_merged
        and `merged` (weights for servers skip it)."""
        if self.rank != 0:
            return
        merged_state = lora.merged_state(self.model) if self._exports_merged(merged) else None
        self._write_hf(os.path.abspath(path), merged=merged_state)

    def _write_hf(self, path: str, state_dict: dict[str, torch.Tensor] | None = None, *,
                  adapter: dict[str, torch.Tensor] | None = None, merged: dict[str, torch.Tensor] | None = None) -> None:
        """Write the model (or `state_dict`, in its names) as an HF directory, atomically. With LoRA
        the adapter folder (of `adapter`, PEFT's names, when given), plus `merged/` from `merged`."""
        tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        with standard_attention(self.model):  # the exported config names transformers' own attention
            if self.role.lora is not None:
                lora.save_adapter(self.model, tmp, adapter)
            else:  # transformers 5 always writes safetensors
                if self.role.head == "value":  # HF's *ForTokenClassification has a bias: ours is an exact 0
                    state = state_dict if state_dict is not None else self.model.state_dict()
                    state_dict = {**state, "score.bias": torch.zeros(1, dtype=state["score.weight"].dtype)}
                self.model.save_pretrained(tmp, state_dict=state_dict)
                if self.role.head != "policy":  # value: *ForTokenClassification, score: *ForSequenceClassification
                    export_head_config(tmp, self.role.head, getattr(self.tokenizer, "pad_token_id", None))
        if merged is not None:
            lora.save_merged(self.model, os.path.join(tmp, "merged"), merged)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(os.path.join(tmp, "merged"))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(tmp)
        replace_dir(tmp, path, old)  # fsynced, swapped in: a crash leaves the old or the new one


    def save_state(self, path: str) -> None:
        """One file per rank (DP replicas hold identical weights and optimizer state, but each
        keeps its own random state and generation counter). With LoRA only the adapters: the
        frozen base is the model directory's."""
        state = {
            "model": lora.recover_state(self.model) if self.role.lora is not None else self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "version": self.version,
            **rng_state(self.device),
            # Generation seeds each request from (seed, request counter): the counter is random state.
            "gen_next_rid": self._gen_engine.next_rid if self._gen_engine is not None else 0,
        }
        torch.save(state, os.path.join(path, "engine.pt"))

    def load_state(self, path: str) -> None:
        # On the host: the RNG states must be CPU tensors; load_state_dict copies the rest to the device.
        state = torch.load(os.path.join(path, "engine.pt"), map_location="cpu", weights_only=True)
        if self.role.lora is not None:
            lora.load_recover_state(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        set_rng_state(state, self.device)
        if state["gen_next_rid"]:
            self._gen_engine = GenerationEngine(self.model, self.tokenizer, seed=self.seed)
            self._gen_engine.next_rid = state["gen_next_rid"]


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The random state a resume restores: the CPU generator's, and the GPU's on a GPU."""
    state = {"rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what rng_state saved (CPU tensors, whatever map_location said). A GPU state saved by a
    CPU run is absent and one saved by a GPU run resumed on a CPU is ignored."""
    torch.set_rng_state(state["rng"].cpu())
    if device.type == "cuda" and state.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(state["cuda_rng"].cpu(), device)


def _load_tokenizer(model_path: str):
    """The directory's tokenizer, or None when it has no tokenizer files (e.g. a tiny test model)."""
    if os.path.isdir(model_path) and not any(os.path.exists(os.path.join(model_path, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(model_path)
