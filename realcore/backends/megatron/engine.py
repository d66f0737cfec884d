"""MegatronEngine: one rank of a Megatron-core mesh (TP x PP x DP, EP for MoE) holding a model role.

Every rank of the mesh runs the same calls; ranks of one data-parallel replica receive the same
sequences. Micro-batches are the torch engine's (token budget, packed into one row that attends
by its sequence boundaries, THD), padded to one common length so pipeline stages exchange fixed
shapes. Losses use Megatron's per-token mode (`calculate_per_token_loss`): each micro-batch
returns (mean loss x its loss tokens, loss tokens), gradients are summed over micro-batches and
DP ranks and divided by the global number of loss tokens in `finalize_model_grads` -- the same
global token mean as the torch engine, for any split.

Log-probs come from logits gathered over TP (full vocabulary on the last stage), then are
broadcast from the last PP stage so every rank returns them. A value or score role (`role.head`)
has a one-output linear layer in place of the LM head on the last stage (heads.py); its values
and scores travel the same way, and the loss gets the role's head in a `HeadOutput`.

Devices: the engine computes on this process's current device (its GPU, selected before the mesh's
process group, or the CPU). Every collective realcore adds (stat names and sums, the PP broadcast of
log-probs, the EP micro-batch count, an empty shard's token count, the HF gather of checkpoint.py)
moves tensors on the device of its group's backend (NCCL: the GPU; gloo: the CPU). `role.dtype`
"auto" is bf16 on a GPU, float32 on a CPU. Loss statistics stay on the device until one copy per
minibatch.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from safetensors.torch import save_file
from transformers import AutoConfig

from realcore.api.alloc import ParallelDims
from realcore.api.config import RoleConfig
from realcore.api.engine import Engine, GenerationResult, HeadOutput, LossFn, LossWeightFn
from realcore.backends.batching import (cu_seqlens, lr_factor, reduce_weighted, split_by_budget, stat_on,
                                        token_logprobs, train_batch)
from realcore.backends.device import compute_device, group_device, to_device
from realcore.backends.logprobs import logprobs_and_entropy
from realcore.backends.megatron import recover_state
from realcore.backends.megatron.checkpoint import LazyHFState, gather_hf, load_shard
from realcore.backends.megatron.compat import apply_compat
from realcore.backends.megatron.context_parallel import GatherRow, unpad, zigzag_layout
from realcore.backends.megatron.convert import block_spec, layer_spec, mcore_config_from_hf, rope_base, to_te_names
from realcore.backends.megatron.cpu_compat import apply_cpu_compat, cuda_to_cpu_mode
from realcore.backends.megatron.heads import head_hf_config, head_meta, install_head, token_values
from realcore.backends.megatron.parallel import check_megatron_config, init_parallel_state, sequence_parallel
from realcore.backends.megatron.varlen_attention import packed_seq_params
from realcore.backends.precision import compute_dtype
from realcore.backends.torch_engine import _load_tokenizer
from realcore.transport.durable import replace_dir


class MegatronEngine(Engine):
    """A model role on a Megatron-core mesh; the default process group spans the mesh."""

    def __init__(self, model_path: str, role: RoleConfig, dims: ParallelDims, *, total_steps: int, seed: int = 0,
                 role_name: str = "actor"):
        apply_compat()  # on every device
        apply_cpu_compat()  # no-op with CUDA
        self.role, self.dims, self.version, self.total_steps = role, dims, 0, total_steps
        self.head, self.seed = role.head, seed
        self.mcfg = role.megatron
        self.hf_config = AutoConfig.from_pretrained(model_path)
        check_megatron_config(role_name, self.mcfg, dims, self.hf_config)
        if dist.get_world_size() != dims.world_size:
            raise ValueError(f"megatron: {dist.get_world_size()} processes for a mesh of {dims.world_size}")
        init_parallel_state(dims, self.mcfg, seed)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.replica = ps.get_data_parallel_rank(with_context_parallel=True)
        self.vpp = self.mcfg.virtual_pipeline_stages or 1
        self.n_stages = dims.pp * self.vpp
        self.sp = sequence_parallel(self.mcfg, dims)
        self.device = compute_device()
        self.comm_device = group_device()  # of the mesh's default group: Megatron's groups share its backend
        self.dtype = compute_dtype(role.dtype, self.device)  # "auto" resolved for the device
        self.config = self._transformer_config()
        self.model_path = model_path
        self.tokenizer = _load_tokenizer(model_path)
        hf_state = LazyHFState(model_path)
        self._meta = hf_state.meta()
        if self.head != "policy":  # the layout gather_hf writes back: score.* in place of lm_head
            self._meta = head_meta(self._meta, self.head, self.hf_config)
        self.chunks = [self._build_chunk(v, hf_state) for v in range(self.vpp)]
        self.optimizer = None
        if role.trainable:
            self._init_training()
        else:
            for c in self.chunks:
                c.eval()
                c.requires_grad_(False)

    # ---- construction ----

    def _transformer_config(self):
        d, m = self.dims, self.mcfg
        recompute = {}
        if self.role.gradient_checkpointing and self.role.trainable:
            # Megatron's own full recompute, one layer per unit: like HF gradient checkpointing, only each
            # layer's input is kept and the layer runs again in backward (tensor_parallel.checkpoint,
            # which restores the RNG tracker's states, so dropout masks would repeat exactly).
            recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        return mcore_config_from_hf(
            self.hf_config,
            tensor_model_parallel_size=d.tp, pipeline_model_parallel_size=d.pp, context_parallel_size=d.cp,
            expert_model_parallel_size=d.ep, virtual_pipeline_model_parallel_size=m.virtual_pipeline_stages,
            sequence_parallel=self.sp, batch_p2p_comm=m.batch_p2p_comm, overlap_p2p_comm=m.overlap_p2p_comm,
            # bf16: Megatron's mixed precision (bf16 weights and activations, fp32 main grads and master weights).
            bf16=self.dtype == torch.bfloat16, pipeline_dtype=self.dtype, params_dtype=self.dtype,
            calculate_per_token_loss=True,
            moe_token_dispatcher_type=m.moe_token_dispatcher, **recompute,
        )

    def _build_chunk(self, v: int, hf_state: LazyHFState):
        vp = v if self.vpp > 1 else None
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        spec = layer_spec(self.hf_config, transformer_engine=self.dims.cp > 1)
        if self.dims.cp == 1:  # the local spec's final norm is of the layers' class (convert.block_spec)
            spec = block_spec(spec, self.config, vp)
        model = GPTModel(
            config=self.config, transformer_layer_spec=spec,
            vocab_size=self.hf_config.vocab_size, max_sequence_length=self.hf_config.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=post_process,
            share_embeddings_and_output_weights=(self.head == "policy"
                                                 and bool(getattr(self.hf_config, "tie_word_embeddings", False))),
            position_embedding_type="rope", rotary_base=rope_base(self.hf_config), vp_stage=vp,
        )
        if post_process and self.head != "policy":
            install_head(model, self.head, self.hf_config, sequence_parallel=self.sp, seed=self.seed)
        shard = load_shard(hf_state, self.hf_config, tp=self.dims.tp, n_stages=self.n_stages, tp_rank=self.tp_rank,
                           stage=self._stage(v), ep=self.dims.ep, ep_rank=_ep_rank(), head=self.head)
        if self.dims.cp > 1:
            shard = to_te_names(shard)
        missing, unexpected = model.load_state_dict(shard, strict=False)
        # A checkpoint without the head's score.* (a causal LM) leaves the fresh head in place.
        missing = [k for k in missing if not k.endswith("_extra_state")
                   and not (self.head != "policy" and k.startswith("output_layer."))]
        if missing or unexpected:
            raise RuntimeError(f"megatron: checkpoint does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
        # Every parameter in the compute dtype, norms included, as Megatron's Float16Module does
        # (megatron-core builds its norms in fp32 whatever params_dtype says).
        return model.to(self.device, self.dtype)

    def _stage(self, v: int) -> int:
        return v * self.dims.pp + self.pp_rank

    def _init_training(self) -> None:
        opt = self.role.optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=self.mcfg.distributed_optimizer,
        )
        with cuda_to_cpu_mode():
            self.chunks = [
                DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=c, disable_bucketing=v > 0)
                for v, c in enumerate(self.chunks)
            ]
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=opt.lr, weight_decay=opt.weight_decay, adam_beta1=opt.beta1,
                    adam_beta2=opt.beta2, adam_eps=opt.eps, clip_grad=opt.max_grad_norm,
                    use_distributed_optimizer=self.mcfg.distributed_optimizer, params_dtype=self.dtype,
                    bf16=self.dtype == torch.bfloat16,  # fp32 master weights and Adam state beside the bf16 ones
                ),
                self.chunks,
            )
        self.config.finalize_model_grads_func = finalize_model_grads
        for c in self.chunks:
            c.train()

    # ---- forward ----

    def _pad_multiple(self) -> int:
        # SP splits the row over TP ranks; CP cuts every sequence into 2 * cp chunks.
        return (self.dims.tp if self.sp else 1) * (2 * self.dims.cp if self.dims.cp > 1 else 1)

    def _micro_batches(self, seqs: list[torch.Tensor], budget: int,
                       group_sizes: list[int] | None = None) -> tuple[list[list[int]], int]:
        """Token-budget micro-batches and the common padded length of their packed rows."""
        lens = [int(s.numel()) for s in seqs]
        mbs = split_by_budget(lens, budget, group_sizes) if lens else []
        m = self._pad_multiple()
        c = 2 * self.dims.cp if self.dims.cp > 1 else 1  # with CP each sequence is padded on its own
        longest = max((sum(-(-lens[i] // c) * c for i in mb) for mb in mbs), default=m)
        return mbs, -(-longest // m) * m

    def _pad_micro_batches(self, batches: list[dict]) -> list[dict]:
        """Add empty micro-batches where Megatron needs a count: with expert parallelism every
        replica of an EP group runs as many as the others (the token dispatch is a collective);
        the interleaved schedule needs a multiple of the PP size."""
        n = len(batches)
        if self.dims.ep > 1:
            t = torch.tensor([n], dtype=torch.int64, device=self.comm_device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True))
            n = int(t)
        if self.vpp > 1 and n:
            n = -(-n // self.dims.pp) * self.dims.pp
        dummy = {"ids": torch.zeros(0, dtype=torch.int64), "lens": [], "dummy": True}
        return batches + [dummy] * (n - len(batches))

    def _run(self, batches: list[dict], seq_len: int, loss_func_for, forward_only: bool) -> list[dict]:
        """Megatron's schedule over packed micro-batches; returns the last stage's loss dicts."""
        device = self.device

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if self.dims.cp > 1:
                return self._forward_cp(model, mb, seq_len, loss_func_for)
            ids = mb["ids"]
            pad = seq_len - ids.numel()
            lens = mb["lens"] + ([pad] if pad else [])  # padding is one more "sequence"
            tokens = to_device(torch.cat([ids, ids.new_zeros(pad)]), device)[None]  # (1, seq_len)
            # Attention by boundaries (THD, varlen_attention.py), RoPE restarting at each sequence: no mask.
            output = model(tokens, None, None, packed_seq_params=packed_seq_params(lens, lens, device),
                           runtime_gather_output=True)

            def head_fn(output, temperature, with_entropy):
                return self._head_output(output[0], tokens[0], lens, mb["lens"], temperature, with_entropy)

            return output, loss_func_for(mb, head_fn)

        # Interleaved schedules run every micro-batch through each model chunk: one iterator each.
        iterators = [iter(batches) for _ in range(self.vpp)]
        with cuda_to_cpu_mode():
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if self.vpp > 1 else iterators[0],
                model=self.chunks if self.vpp > 1 else self.chunks[0],
                num_microbatches=len(batches), seq_length=seq_len, micro_batch_size=1, forward_only=forward_only,
            )

    def _forward_cp(self, model, mb: dict, seq_len: int, loss_func_for):
        """Forward one micro-batch split over the CP ranks (see context_parallel.py; GPU only)."""
        cp, device = self.dims.cp, self.device
        real = list(mb["lens"])
        c = 2 * cp
        used = sum(-(-n // c) * c for n in real)
        lens = real + ([seq_len - used] if seq_len > used else [])  # a padding sequence fills the row
        padded, idx = zigzag_layout(lens, cp, ps.get_context_parallel_rank())
        parts, off = [], 0
        for n, p in zip(lens, padded):
            seq = mb["ids"][off:off + n] if off < mb["ids"].numel() else torch.zeros(n, dtype=torch.int64)
            parts += [seq, torch.zeros(p - n, dtype=torch.int64)]
            off += n
        row = torch.cat(parts).to(device)
        idx = idx.to(device)
        output = model(row[idx][None], None, None, packed_seq_params=packed_seq_params(lens, padded, device),
                       runtime_gather_output=True)
        starts = torch.tensor([0] + padded[:-1], device=device).cumsum(0)
        group = ps.get_context_parallel_group()

        def shifted(next_values):  # value for x[t] sits at t - 1; 0 at each sequence start
            out = torch.cat([next_values.new_zeros(1), next_values[:-1]])
            out[starts] = 0.0
            return unpad(out, real, padded[: len(real)])

        def head_fn(output, temperature, with_entropy):
            cu = cu_seqlens(real, device)
            if self.head != "policy":  # the head at every position of the row, in row order
                per_row = GatherRow.apply(output[0, :, 0].float(), idx, row.numel(), group)
                if self.head == "value":
                    return HeadOutput(cu, values=shifted(per_row))
                last = starts[: len(real)] + torch.tensor(real, device=device) - 1  # each sequence's last token
                return HeadOutput(cu, scores=per_row[last])
            labels = torch.roll(row, -1)[idx]  # this rank's positions
            lp, ent = logprobs_and_entropy(output[0], labels, temperature, with_entropy)
            lp = GatherRow.apply(lp, idx, row.numel(), group)
            if with_entropy:
                ent = shifted(GatherRow.apply(ent, idx, row.numel(), group))
            return HeadOutput(cu, logprobs=shifted(lp), entropy=ent)

        return output, loss_func_for(mb, head_fn)

    def _head_output(self, output, tokens, lens, real: list[int], temperature: float, with_entropy: bool) -> HeadOutput:
        """The role's head on the real tokens of one packed row (`output`: (row, vocab | 1); `lens`:
        the row's sequences, padding last; `real`: the real sequences' lengths)."""
        n_real = sum(real)
        cu = cu_seqlens(real, tokens.device)
        starts = torch.zeros(tokens.numel(), dtype=torch.bool, device=tokens.device)
        starts[torch.tensor([0] + lens[:-1], device=tokens.device).cumsum(0)] = True
        if self.head == "value":
            return HeadOutput(cu, values=token_values(output[:, 0].float(), starts)[:n_real])
        if self.head == "score":  # at each sequence's last token
            return HeadOutput(cu, scores=output[cu[1:].long() - 1, 0].float())
        lp, ent = token_logprobs(output, tokens, starts, temperature, with_entropy)
        return HeadOutput(cu, logprobs=lp[:n_real], entropy=(ent[:n_real] if ent is not None else None))

    def _eval(self):
        for c in self.chunks:
            c.eval()

    def _train(self):
        if self.optimizer is not None:
            for c in self.chunks:
                c.train()

    def logprobs(self, input_ids: list[torch.Tensor], temperature: float = 1.0, *,
                 max_tokens_per_mb: int | None = None) -> list[torch.Tensor]:
        self._check_head("policy", "logprobs")
        return self._infer(input_ids, lambda out: out.logprobs, temperature, max_tokens_per_mb, per_token=True)

    def values(self, input_ids: list[torch.Tensor], *, max_tokens_per_mb: int | None = None) -> list[torch.Tensor]:
        """Per-token values V(x[:t]) of each sequence (float32, same length; position 0 is 0)."""
        self._check_head("value", "values")
        return self._infer(input_ids, lambda out: out.values, 1.0, max_tokens_per_mb, per_token=True)

    def scores(self, input_ids: list[torch.Tensor], *, max_tokens_per_mb: int | None = None) -> list[torch.Tensor]:
        """One 0-d float32 score per sequence: the head at its last token."""
        self._check_head("score", "scores")
        return list(self._infer(input_ids, lambda out: out.scores, 1.0, max_tokens_per_mb, per_token=False))

    def _check_head(self, head: str, call: str) -> None:
        if self.head != head:
            raise ValueError(f"{call}(): this model role has head={self.head!r}; {call} needs head={head!r}")

    def _infer(self, input_ids, pick, temperature: float, max_tokens_per_mb: int | None, *, per_token: bool):
        """pick(HeadOutput) of every micro-batch, on every rank: per token (split by sequence) or per sequence."""
        lens = [int(x.numel()) for x in input_ids]
        mbs, seq_len = self._micro_batches(input_ids, max_tokens_per_mb or self.role.max_tokens_per_mb)
        batches = [{"ids": torch.cat([input_ids[i] for i in mb]).long(), "lens": [lens[i] for i in mb]} for mb in mbs]
        batches = self._pad_micro_batches(batches)

        def loss_func_for(mb, head_fn):
            def loss_func(output):
                got = pick(head_fn(output, temperature, False))  # left on the device: one copy at the end
                no_tokens = torch.zeros((), dtype=torch.int, device=output.device)
                return output.sum() * 0.0, no_tokens, {"got": got.detach().float()}
            return loss_func

        self._eval()
        try:
            with torch.no_grad():
                out = self._run(batches, seq_len, loss_func_for, forward_only=True) if batches else []
        finally:
            self._train()
        if ps.is_pipeline_last_stage() and out:
            flat = torch.cat([d["got"] for d in out]).to(self.comm_device)
        else:
            flat = torch.zeros(sum(lens) if per_token else len(lens), device=self.comm_device)
        if self.dims.pp > 1:  # the last stage has them; every rank returns them
            dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
        return list(flat.cpu().split(lens)) if per_token else flat.cpu().unbind()

    # ---- training ----

    def train_batch(self, data: dict[str, list[torch.Tensor]], loss_fn: LossFn, loss_weight_fn: LossWeightFn, *,
                    n_minibatches: int = 1, temperature: float = 1.0, max_tokens_per_mb: int | None = None,
                    group_sizes: list[int] | None = None) -> dict[str, float]:
        return train_batch(self, data, loss_fn, loss_weight_fn, n_minibatches=n_minibatches, temperature=temperature,
                           max_tokens_per_mb=max_tokens_per_mb, group_sizes=group_sizes)

    def forward_backward(self, data, loss_fn: LossFn, loss_weight_fn: LossWeightFn, temperature: float = 1.0,
                         max_tokens_per_mb: int | None = None, group_sizes: list[int] | None = None) -> dict[str, float]:
        """Gradients of the global token-mean loss in the DDP grad buffers (no optimizer step).
        `max_tokens_per_mb`: this call's micro-batch token budget (None: the role's); `group_sizes`:
        keep each group's sequences in one micro-batch."""
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        mbs, seq_len = self._micro_batches(data["input_ids"], max_tokens_per_mb or self.role.max_tokens_per_mb,
                                           group_sizes)
        batches = []
        for idx in mbs:
            packed = {k: torch.cat([v[i] for i in idx]) for k, v in data.items()}
            lens = [int(data["input_ids"][i].numel()) for i in idx]
            packed["cu_seqlens"] = cu_seqlens(lens)  # the loss function's sequence boundaries
            w = float(loss_weight_fn(packed))  # on the host's copy: no device sync per micro-batch
            batches.append({"ids": packed["input_ids"].long(), "lens": lens, "w": w,
                            "data": {k: to_device(t, self.device) for k, t in packed.items()}})
        batches = self._pad_micro_batches(batches)

        first_cp = ps.get_context_parallel_rank() == 0
        device = self.device

        def no_tokens():  # on the device: Megatron all-reduces the count over DP (NCCL on GPUs)
            return torch.zeros((), dtype=torch.int, device=device)

        def loss_func_for(mb, head_fn):
            def loss_func(output):
                if mb.get("dummy"):
                    return output.sum() * 0.0, no_tokens(), {}
                head_out = head_fn(output, temperature, True)
                w = mb["w"]
                if w == 0:  # contributes nothing; its mean may be 0/0 (the schedule still needs a graph)
                    return output.sum() * 0.0, no_tokens(), {}
                loss, stats = loss_fn(head_out, mb["data"])
                # (w * stat) on the device, w beside it on the host: read once per minibatch.
                reported = {k: (stat_on(v, device) * w, w) for k, v in stats.items()}
                # CP ranks compute the same loss, each back-propagating through its own positions:
                # count the tokens once (finalize_model_grads sums them over DP x CP).
                n_tokens = round(w) if first_cp else 0
                return loss * w, torch.full((), n_tokens, dtype=torch.int, device=device), reported
            return loss_func

        if batches:
            out = self._run(batches, seq_len, loss_func_for, forward_only=False)
        else:  # an empty DP shard still joins the gradient reduction
            out = []
            with cuda_to_cpu_mode():
                finalize_model_grads(self.chunks, num_tokens=no_tokens())
        sums: dict[str, torch.Tensor] = {}
        weights: dict[str, float] = {}
        if ps.is_pipeline_last_stage() and self.tp_rank == 0 and first_cp:  # one report per DP replica
            for d in out:
                for k, (s, w) in d.items():
                    sums[k] = sums.get(k, 0.0) + s
                    weights[k] = weights.get(k, 0.0) + w
        return reduce_weighted(sums, weights, None, dist.get_world_size(), self.comm_device)

    def _train_minibatch(self, data, loss_fn, loss_weight_fn, temperature, max_tokens_per_mb,
                         group_sizes=None) -> dict[str, float]:
        stats = self.forward_backward(data, loss_fn, loss_weight_fn, temperature, max_tokens_per_mb, group_sizes)
        lr = self.role.optimizer.lr * lr_factor(self.version, self.role.optimizer, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with cuda_to_cpu_mode():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron: optimizer step skipped (non-finite gradients)")
        self.version += 1
        stats["lr"] = lr
        stats["grad_norm"] = float(grad_norm)
        return stats

    # ---- weights out ----

    def _local_shards(self, grads: bool = False) -> dict[int, dict[str, torch.Tensor]]:
        out = {}
        for v, c in enumerate(self.chunks):
            module = c.module if hasattr(c, "module") else c
            if grads:
                state = {n: p.main_grad for n, p in module.named_parameters()}
            else:
                state = {k: t for k, t in module.state_dict().items() if not k.endswith("_extra_state")}
            out[self._stage(v)] = to_te_names(state, inverse=True) if self.dims.cp > 1 else state
        return out

    def hf_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor] | None:
        """Collective: the full HF state dict (or HF-named gradients) on global rank 0, None elsewhere."""
        return gather_hf(self._local_shards(grads), self._meta, self.hf_config, tp=self.dims.tp, pp=self.dims.pp,
                         n_stages=self.n_stages, coords=(self.tp_rank, self.pp_rank, self.replica, _ep_rank()),
                         ep=self.dims.ep, head=self.head)

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        raise NotImplementedError("backend=megatron has no LoRA (RoleConfig rejects lora there)")

    def save_hf(self, path: str, *, merged: bool = True) -> None:
        """Collective; global rank 0 writes an HF directory atomically (tmp dir + rename).
        `merged` is LoRA's (Engine.save_hf): megatron has none."""
        state = self.hf_state_dict()
        if state is None:
            return
        if getattr(self.hf_config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        path = os.path.abspath(path)
        tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        hf_config = self.hf_config
        if self.head != "policy":  # *ForTokenClassification (value) / *ForSequenceClassification (score)
            hf_config = head_hf_config(hf_config, self.head, getattr(self.tokenizer, "pad_token_id", None))
        hf_config.save_pretrained(tmp)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(tmp)
        for name in ("generation_config.json",):
            src = os.path.join(self.model_path, name)
            if os.path.exists(src):
                shutil.copy(src, tmp)
        replace_dir(tmp, path, old)  # fsynced, swapped in: a crash leaves the old or the new one

    # ---- recover state (see recover_state.py for the format) ----

    def _mesh_record(self) -> dict:
        """What a recover checkpoint must match to load here."""
        d = self.dims
        return {"dp": d.dp, "pp": d.pp, "tp": d.tp, "cp": d.cp, "ep": d.ep, "vpp": self.vpp,
                "distributed_optimizer": self.mcfg.distributed_optimizer}

    def save_state(self, path: str) -> None:
        """Everything this trainable role needs to continue exactly, written under `path`. Collective: every rank
        of the role's mesh calls it."""
        if self.optimizer is None:
            raise ValueError("save_state: this model role is not trainable (role.trainable is False)")
        recover_state.save(path, self.chunks, self.optimizer, version=self.version, mesh=self._mesh_record())

    def load_state(self, path: str) -> None:
        """Restore what save_state wrote (called on freshly built engines of the same HF model and mesh, before
        any training step). Collective."""
        if self.optimizer is None:
            raise ValueError("load_state: this model role is not trainable (role.trainable is False)")
        self.version = recover_state.load(path, self.chunks, self.optimizer, mesh=self._mesh_record())

    def generate(self, prompts: list[list[int]], gconfig) -> list[GenerationResult]:
        raise NotImplementedError("megatron roles generate through generation servers (allocation_mode local.dN+...)")


def _ep_rank() -> int:
    return ps.get_expert_model_parallel_rank()
