"""TorchEngine: a HF causal LM on one data-parallel rank, with packed micro-batches and AdamW.

Sequences are packed without padding: a micro-batch is one row (1, T) with position ids restarting
at 0 per sequence and an explicit block-diagonal causal mask (transformers' sdpa path does not infer
packing from position ids alone). Gradients are summed across the data-parallel group by hand (one
flat bucket per dtype), so the loss is the token-level mean over the global batch whatever the
micro-batch split or DP size.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F

from realcore.api.config import OptimizerConfig, RoleConfig
from realcore.api.engine import Engine, GenerationResult, LossFn, LossWeightFn

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def lr_factor(step: int, opt: OptimizerConfig, total_steps: int) -> float:
    """Multiplier of `opt.lr` for optimizer step `step` (0-based): linear warm-up over
    `warmup_steps`, then cosine decay to `min_lr_ratio` at `total_steps` (or constant)."""
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    if opt.lr_scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - opt.warmup_steps) / max(1, total_steps - opt.warmup_steps))
    return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def split_by_budget(lens: list[int], budget: int) -> list[list[int]]:
    """Greedy, in-order split of sequence indices into micro-batches of at most `budget` tokens
    (a sequence longer than the budget gets a micro-batch of its own)."""
    mbs: list[list[int]] = []
    cur: list[int] = []
    cur_tokens = 0
    for i, n in enumerate(lens):
        if cur and cur_tokens + n > budget:
            mbs.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += n
    if cur:
        mbs.append(cur)
    return mbs


def split_minibatches(n_seqs: int, n_minibatches: int) -> list[range]:
    """`n_minibatches` contiguous chunks whose sizes differ by at most one (some may be empty)."""
    q, r = divmod(n_seqs, n_minibatches)
    bounds = [0]
    for i in range(n_minibatches):
        bounds.append(bounds[-1] + q + (i < r))
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def block_causal_mask(lens: list[int], device) -> torch.Tensor:
    """(1, 1, T, T) bool, True = may attend: causal within each packed sequence, nothing across."""
    seq_id = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    same = seq_id[:, None] == seq_id[None, :]  # (T, T)
    causal = torch.ones_like(same).tril()
    return (same & causal)[None, None]


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, starts: torch.Tensor, temperature: float,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(x[t] | x[:t]) and entropy of the temperature-scaled distribution, aligned
    with `ids` (realcore.api.data); 0 where `starts` marks the first token of a sequence.
    logits: (T, V), ids: (T,), starts: (T,) bool."""
    logp = F.log_softmax(logits[:-1].float() / temperature, dim=-1)  # (T-1, V) predicts ids[1:]
    lp = torch.cat([logp.new_zeros(1), logp.gather(-1, ids[1:, None]).squeeze(-1)])  # (T,)
    # Position `start` would be predicted by the previous sequence's last token: not a real token.
    lp = torch.where(starts, torch.zeros_like(lp), lp)
    if not with_entropy:
        return lp, None
    ent = torch.cat([logp.new_zeros(1), -(logp.exp() * logp).sum(-1)])
    return lp, torch.where(starts, torch.zeros_like(ent), ent)


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


def _union_keys(keys: list[str], group, device) -> list[str]:
    """Sorted union of stat names over the group (a rank with an empty minibatch has none).
    Names travel as padded UTF-8 byte tensors: no pickle."""
    raw = "\n".join(sorted(keys)).encode("utf-8")
    n = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    buf = torch.zeros(int(n) + 1, dtype=torch.uint8, device=device)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, buf, group=group)
    names = {k for t in out for k in bytes(t.tolist()).rstrip(b"\0").decode("utf-8").split("\n") if k}
    return sorted(names)


class TorchEngine(Engine):
    """One data-parallel rank of a model role, backed by a HF `AutoModelForCausalLM`."""

    def __init__(self, model_path: str, role: RoleConfig, *, total_steps: int, seed: int = 0, group=None):
        from transformers import AutoModelForCausalLM

        self.role, self.seed, self.version = role, seed, 0
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.distributed else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa", dtype=torch.float32)
        self.model.to(self.device)
        self.tokenizer = _load_tokenizer(model_path)
        self._gen_engine = None
        self.optimizer = self.scheduler = None
        if role.trainable:
            self._init_training(role, total_steps)
        else:
            self.model.eval()
            self.model.requires_grad_(False)

    def _init_training(self, role: RoleConfig, total_steps: int) -> None:
        opt = role.optimizer
        if role.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, opt, total_steps))

    # ---- forward ----

    def _autocast(self):
        # bf16 only on GPUs; CPU stays float32 (bf16 matmuls are slow and inexact there).
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward_packed(self, seqs: list[torch.Tensor], temperature: float, with_entropy: bool):
        """Forward one packed micro-batch -> per-token (logprobs, entropy|None), each (T,)."""
        lens = [int(s.numel()) for s in seqs]
        ids = torch.cat(seqs).to(self.device, torch.int64)  # (T,)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])  # (T,)
        with self._autocast():
            logits = self.model(
                input_ids=ids[None], position_ids=pos[None], attention_mask=block_causal_mask(lens, self.device),
                use_cache=False,
            ).logits[0]  # (T, V)
        return token_logprobs(logits, ids, pos == 0, temperature, with_entropy)

    @contextlib.contextmanager
    def _eval_mode(self):
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    def logprobs(self, input_ids: list[torch.Tensor], temperature: float = 1.0) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        lens = [int(x.numel()) for x in input_ids]
        with torch.no_grad(), self._eval_mode():
            for mb in split_by_budget(lens, self.role.max_tokens_per_mb):
                lp, _ = self._forward_packed([input_ids[i] for i in mb], temperature, with_entropy=False)
                out.extend(lp.float().cpu().split([lens[i] for i in mb]))
        return out

    # ---- training ----

    def train_batch(self, data: dict[str, list[torch.Tensor]], loss_fn: LossFn, loss_weight_fn: LossWeightFn, *,
                    n_minibatches: int = 1, temperature: float = 1.0) -> dict[str, float]:
        if self.optimizer is None:
            raise ValueError("train_batch: this model role is not trainable (role.trainable is False)")
        if "input_ids" not in data:
            raise ValueError(f"train_batch: data must hold 'input_ids', got keys {sorted(data)}")
        lens = [int(x.numel()) for x in data["input_ids"]]
        for k, seqs in data.items():
            if [int(t.numel()) for t in seqs] != lens:
                raise ValueError(f"train_batch: key {k!r} is not per-token (lengths differ from input_ids)")
        results = []
        for chunk in split_minibatches(len(lens), n_minibatches):
            mb_data = {k: [v[i] for i in chunk] for k, v in data.items()}
            results.append(self._train_minibatch(mb_data, loss_fn, loss_weight_fn, temperature))
        keys = {k for r in results for k in r}
        return {k: sum(r[k] for r in results if k in r) / sum(k in r for r in results) for k in sorted(keys)}

    def _train_minibatch(self, data, loss_fn, loss_weight_fn, temperature) -> dict[str, float]:
        """Accumulate token-weighted gradients over micro-batches and ranks, then one optimizer step."""
        lens = [int(x.numel()) for x in data["input_ids"]]
        mbs = []
        for idx in split_by_budget(lens, self.role.max_tokens_per_mb) if lens else []:
            packed = {k: torch.cat([v[i] for i in idx]).to(self.device) for k, v in data.items()}
            mbs.append((idx, packed, float(loss_weight_fn(packed))))
        global_w = self._allreduce_scalar(sum(w for _, _, w in mbs))
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        for idx, packed, w in mbs:
            if w == 0:  # contributes nothing, and its mean may be 0/0
                continue
            lp, ent = self._forward_packed([data["input_ids"][i] for i in idx], temperature, with_entropy=True)
            loss, stats = loss_fn(lp, ent, packed)
            (loss * (w / global_w)).backward()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
                weights[k] = weights.get(k, 0.0) + w
        stats = self._reduce_stats(sums, weights)
        stats["lr"] = self.optimizer.param_groups[0]["lr"]
        stats["grad_norm"] = self._step()
        return stats

    def _allreduce_scalar(self, x: float) -> float:
        if self.world_size == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t)

    def _reduce_stats(self, sums: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
        """Weighted means over micro-batches and ranks: sum(w * stat) / sum(w) per stat name."""
        keys = sorted(sums) if self.world_size == 1 else _union_keys(list(sums), self.group, self.device)
        vec = torch.tensor([sums.get(k, 0.0) for k in keys] + [weights.get(k, 0.0) for k in keys],
                           dtype=torch.float64, device=self.device)  # (2 * n_keys,)
        if self.world_size > 1:
            dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group)
        s, w = vec[: len(keys)].tolist(), vec[len(keys):].tolist()
        return {k: (sk / wk if wk > 0 else 0.0) for k, sk, wk in zip(keys, s, w)}

    def _step(self) -> float:
        """Sum grads over ranks, clip, step optimizer and schedule; returns the pre-clip grad norm."""
        for p in self.params:
            if p.grad is None:  # untouched this step (or empty minibatch): still joins the all-reduce
                p.grad = torch.zeros_like(p)
        if self.world_size > 1:
            _allreduce_grads(self.params, self.group)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.role.optimizer.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return float(grad_norm)

    # ---- generation and checkpoints ----

    def generate(self, prompts: list[list[int]], gconfig) -> list[GenerationResult]:
        # Lazy import: the generation engine is only needed by roles that sample.
        from realcore.backends.generation import GenerationEngine

        if self._gen_engine is None:
            self._gen_engine = GenerationEngine(self.model, self.tokenizer, seed=self.seed)
        with torch.no_grad(), self._eval_mode():
            return self._gen_engine.generate(prompts, gconfig)

    def save_hf(self, path: str) -> None:
        """Write a HF checkpoint atomically (tmp dir + rename). Only rank 0 of the group writes:
        weights are identical on every data-parallel rank."""
        if self.rank != 0:
            return
        path = os.path.abspath(path)
        tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)  # transformers 5 always writes safetensors
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(tmp)
        # rename(2) cannot replace a non-empty directory: move the old one aside first.
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)


def _load_tokenizer(model_path: str):
    """The directory's tokenizer, or None when it has no tokenizer files (e.g. a tiny test model)."""
    if os.path.isdir(model_path) and not any(os.path.exists(os.path.join(model_path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
