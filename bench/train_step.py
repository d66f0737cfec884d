"""Training-step benchmark: a plain PyTorch loop vs the torch engine (replicated or FSDP2-sharded)
vs the Megatron-core engine, same model and batch.

    python bench/train_step.py [--model smollm2-135m|tiny | --path DIR] [--seqs N] [--len L] [--steps K]
                               [--backends plain,torch,fsdp,megatron] [--quick]

One training step = one PPO step on N sequences of L tokens (the first quarter of each a prompt,
outside the loss; random behaviour log-probs and per-sequence advantages), micro-batches of at
most `--mb-tokens`, one optimizer step; one thread per process, gloo on 127.0.0.1. The engines
run `train_batch` with realcore's PPO loss (`ppo_update`'s loss function: clipped surrogate plus
the entropy it reports). The plain loop is what a user would write by hand on the same packed
micro-batches and the same attention kernel (sequences concatenated, varlen attention by their
boundaries): forward, log-softmax and gather, the clipped surrogate, backward, AdamW; no entropy,
no gradient clipping, no scheduler, no statistics. "vs plain" = the row's tokens/s over the plain
loop's in the same dtype (single-process rows only). On a CPU the torch engine's float32 linears
multiply through oneDNN (realcore/backends/onednn_linear.py), the plain loop's through torch's
default BLAS; the "plain-onednn" row is the plain loop with the engine's linears, so that the
engine's own overhead shows against it. Each layout runs in fresh processes: one
warm-up step, then the median of K timed steps. Prints a markdown table: seconds per step, trained
tokens per second (the whole mesh), the peak resident memory of the largest process, and (torch,
fsdp) the bytes of parameters plus optimizer state that one rank holds (its shards under FSDP).

Layouts: torch d1 and d2 (data parallel), fsdp d2 (parameters, gradients and AdamW state sharded
over the 2 ranks), megatron d1, d2, t2 (TP=2 + sequence parallel) and p2 (PP=2, 1F1B), in fp32;
then torch d1, fsdp d2 and megatron d1 in bf16 where the CPU has bf16 instructions (`--layouts`
picks rows, e.g. `megatron:d1:float32,megatron:d1:bfloat16`). This machine has 2 cores,
so at most 2 processes; on GPUs the same engines run the same code with NCCL. `--quick` (tiny
model, 2 steps) is the smoke test's few-second run.
"""

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: two threads per process are pathological here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

LAYOUTS = [("plain", "d1", "float32"), ("plain-onednn", "d1", "float32"), ("torch", "d1", "float32"), ("megatron", "d1", "float32"), ("torch", "d2", "float32"),
           ("fsdp", "d2", "float32"), ("megatron", "d2", "float32"), ("megatron", "d1t2", "float32"),
           ("megatron", "d1p2", "float32"), ("plain", "d1", "bfloat16"), ("torch", "d1", "bfloat16"), ("fsdp", "d2", "bfloat16"),
           ("megatron", "d1", "bfloat16")]


EPS_CLIP = 0.2


def _ppo_loss_fn():
    """The loss function of realcore's `ppo_update` MFC (default PPO settings, no KL)."""
    from types import SimpleNamespace

    from realcore.api.config import GenerationConfig, PPOConfig
    from realcore.mfc.train import PPOUpdate

    cfg = SimpleNamespace(ppo=PPOConfig(eps_clip=EPS_CLIP, kl_coef=0.0), generation=GenerationConfig(temperature=1.0))
    return PPOUpdate(cfg, SimpleNamespace(max_tokens_per_mb=None, args={})).loss_fn


def _n_tokens(data):
    return float(data["loss_mask"].sum())


def _batch(n: int, length: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (length,), generator=gen) for _ in range(n)]
    prompt = length // 4
    mask = torch.cat([torch.zeros(prompt, dtype=torch.int64), torch.ones(length - prompt, dtype=torch.int64)])
    return {"input_ids": ids, "loss_mask": [mask.clone() for _ in ids],
            "behav_logprobs": [-(0.5 + 2 * torch.rand(length, generator=gen)) for _ in ids],
            "advantages": [torch.full((length,), float(a)) for a in torch.randn(n, generator=gen)]}


class _PlainLoop:
    """The hand-written loop the engines are measured against (see the module docstring)."""

    def __init__(self, path: str, dtype: str, lr: float, onednn: bool = False):
        from transformers import AutoModelForCausalLM

        from realcore.backends.onednn_linear import use_onednn
        from realcore.backends.varlen_attention import use_packed_attention

        self.model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
        use_packed_attention(self.model)
        if onednn:  # the torch engine's linears (realcore/backends/onednn_linear.py): its overhead alone
            use_onednn(self.model)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.bf16 = dtype == "bfloat16"

    def train_batch(self, data: dict, mb_tokens: int) -> None:
        from realcore.backends.batching import cu_seqlens, split_by_budget
        from realcore.backends.varlen_attention import packed_kwargs

        lens = [len(x) for x in data["input_ids"]]
        total = sum(float(m.sum()) for m in data["loss_mask"])
        for idx in split_by_budget(lens, mb_tokens):
            cat = {k: torch.cat([v[i] for i in idx]) for k, v in data.items()}
            ids, mlens = cat["input_ids"], [lens[i] for i in idx]
            pos = torch.cat([torch.arange(n) for n in mlens])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                logits = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                                    **packed_kwargs(cu_seqlens(mlens), mlens)).logits[0]
            # Token t+1 given tokens <= t; a sequence's first token is a prompt token, outside the loss.
            logp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None]).squeeze(-1)
            ratio = torch.exp(logp - cat["behav_logprobs"][1:])
            adv, mask = cat["advantages"][1:], cat["loss_mask"][1:].float()
            surrogate = torch.max(-adv * ratio, -adv * ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP))
            ((surrogate * mask).sum() / total).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _state_bytes(engine) -> int:
    """Parameters plus optimizer state held by this rank (a DTensor counts its local shard only)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    n = sum(local(p).numel() * p.element_size() for p in engine.model.parameters())
    for state in engine.optimizer.state.values():
        n += sum(local(t).numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return n


def _worker(rank, world, port, backend, mesh, dtype, args, out):
    torch.set_num_threads(1)
    from transformers import AutoConfig

    from realcore.api.alloc import parse_mesh
    from realcore.api.config import OptimizerConfig, RoleConfig

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    role = RoleConfig(backend="torch" if backend.startswith("plain") else backend, trainable=True, max_tokens_per_mb=args.mb_tokens, dtype=dtype,
                      optimizer=OptimizerConfig(lr=1e-5, weight_decay=0.0))
    dims = parse_mesh(mesh)
    if backend.startswith("plain"):
        engine = _PlainLoop(args.path, dtype, role.optimizer.lr, onednn=backend == "plain-onednn")
    elif backend == "torch":
        from realcore.backends.torch_engine import TorchEngine

        engine = TorchEngine(args.path, role, total_steps=args.steps + 1)
    elif backend == "fsdp":
        from realcore.backends.fsdp_engine import FSDPEngine

        engine = FSDPEngine(args.path, role, total_steps=args.steps + 1)
    else:
        from realcore.backends.megatron.engine import MegatronEngine

        engine = MegatronEngine(args.path, role, dims, total_steps=args.steps + 1)
    vocab = AutoConfig.from_pretrained(args.path).vocab_size
    data = _batch(args.seqs, args.len, vocab)
    d = dims.dp_rank(rank)
    shard = {k: v[d::dims.dp] for k, v in data.items()}  # data parallel: each replica its share
    times = []
    loss_fn = _ppo_loss_fn()
    for step in range(args.steps + 1):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        if backend.startswith("plain"):
            engine.train_batch(shard, args.mb_tokens)
        else:
            engine.train_batch(shard, loss_fn, _n_tokens)
        torch.distributed.barrier()
        if step:  # the first step warms up (allocations, lazy inits)
            times.append(time.perf_counter() - t0)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], dtype=torch.float64)
    torch.distributed.all_reduce(rss, op=torch.distributed.ReduceOp.MAX)
    state = torch.tensor([_state_bytes(engine) / 2**20 if backend not in ("megatron", "plain", "plain-onednn") else 0.0],
                         dtype=torch.float64)
    torch.distributed.all_reduce(state, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"s": statistics.median(times), "rss_mb": float(rss), "state_mb": float(state)}, f)
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(backend: str, mesh: str, dtype: str, args) -> dict:
    from realcore.api.alloc import parse_mesh

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        world = parse_mesh(mesh).world_size
        mp.spawn(_worker, args=(world, _free_port(), backend, mesh, dtype, args, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--path", default=None, help="an HF model directory (overrides --model)")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--len", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--mb-tokens", type=int, default=1024)
    p.add_argument("--backends", default="plain,plain-onednn,torch,fsdp,megatron", help="comma-separated: the layouts of these run")
    p.add_argument("--layouts", default=None, help="comma-separated backend:mesh:dtype rows to run (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny model, 8 x 32 tokens, 2 steps")
    args = p.parse_args()
    if args.quick:
        args.model, args.seqs, args.len, args.steps = "tiny", 8, 32, 2
    if args.path is None:
        from realcore.api.config import ModelConfig
        from realcore.backends.models import prepare_model

        args.path = prepare_model(ModelConfig(name=args.model), seed=1)
    tokens = args.seqs * args.len
    print(f"model {args.path}, batch {args.seqs} x {args.len} = {tokens} tokens, micro-batches <= {args.mb_tokens} "
          f"tokens, 1 thread/process, median of {args.steps} steps\n", flush=True)
    print("| backend | layout | processes | s/step | tokens/s | vs plain | peak RSS/process (MB) "
          "| params+optimizer/rank (MB) | dtype |")
    print("|---|---|---|---|---|---|---|---|---|")
    plain: dict[str, float] = {}  # dtype -> the plain loop's tokens/s
    from realcore.api.alloc import parse_mesh

    from transformers import AutoConfig

    from realcore.api.config import MegatronConfig
    from realcore.backends.megatron.parallel import check_megatron_config

    from realcore.backends.precision import bf16_unsupported

    hf_config = AutoConfig.from_pretrained(args.path)
    no_bf16 = bf16_unsupported("cuda" if torch.cuda.is_available() else "cpu")
    for backend, mesh, dtype in LAYOUTS:
        if backend not in args.backends.split(",") or (dtype == "bfloat16" and no_bf16):
            continue
        if args.layouts and f"{backend}:{mesh}:{dtype}" not in args.layouts.split(","):
            continue
        if backend == "megatron":
            try:
                check_megatron_config("actor", MegatronConfig(), parse_mesh(mesh), hf_config)
            except ValueError as e:  # e.g. SmolLM2's 9 heads do not split over TP=2
                print(f"| {backend} | {mesh} | {parse_mesh(mesh).world_size} | n/a: {e} | | | | | {dtype} |", flush=True)
                continue
        r = run(backend, mesh, dtype, args)
        state = f"{r['state_mb']:.1f}" if backend not in ("megatron", "plain", "plain-onednn") else "-"
        rate, world = tokens / r["s"], parse_mesh(mesh).world_size
        if backend == "plain":
            plain[dtype] = rate
        ratio = f"{rate / plain[dtype]:.2f}" if dtype in plain and world == 1 else "-"
        print(f"| {backend} | {mesh} | {world} | {r['s']:.3f} | {rate:.0f} | {ratio} | "
              f"{r['rss_mb']:.0f} | {state} | {dtype} |", flush=True)
    if no_bf16:
        print(f"\nbf16 rows left out: {no_bf16}")


if __name__ == "__main__":
    main()
