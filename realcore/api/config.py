"""Typed experiment configuration (pydantic v2). Unknown keys are rejected everywhere.

Hydra composes YAML from `experiments/` in `realcore/launch`; everything else receives these objects.
"""

from __future__ import annotations

import os
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


# A CUDA_VISIBLE_DEVICES entry: an index or a GPU UUID; hydra hands `system.gpus=[0,1]` over as ints.
GpuId = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(_Strict):
    """Shape of the random tiny model built in code (model.name=tiny: tests and quick CPU runs), cached
    under model.cache_dir by (shape, seed)."""

    family: Literal["qwen2", "llama"] = Field("qwen2", description="architecture: HF Qwen2Config or LlamaConfig")
    hidden_size: int = Field(64, gt=0, description="width of the residual stream")
    intermediate_size: int = Field(128, gt=0, description="width of the MLP's hidden layer")
    num_hidden_layers: int = Field(2, gt=0, description="transformer layers")
    num_attention_heads: int = Field(4, gt=0, description="query heads; head dim = hidden_size / num_attention_heads")
    num_key_value_heads: int = Field(
        2, gt=0, description="key/value heads (grouped-query attention; must divide num_attention_heads)")
    vocab_size: int = Field(512, ge=64, description="target vocab of the tokenizer trained in code")


class ModelConfig(_Strict):
    """Which weights every model role starts from."""

    name: str = Field("tiny", description="'tiny', 'smollm2-135m', or a label for `path`")
    path: str | None = Field(None, description="any HF model directory; overrides `name`")
    tiny: TinyModelConfig = Field(TinyModelConfig(), description="shape of the random model built for name=tiny (path unset)")
    use_chat_template: bool = Field(False, description="wrap prompts with the tokenizer's chat template")
    cache_dir: str = Field("~/.cache/realcore", description="where converted models are cached")


class OptimizerConfig(_Strict):
    """AdamW with linear warm-up then cosine (or constant) decay. Steps here are optimizer steps: a
    ppo_update step makes ppo.ppo_n_minibatches x ppo.ppo_epochs of them, an sft_update step one."""

    lr: float = Field(1e-5, gt=0, description="peak learning rate (reached at the end of warm-up)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay; 0 = off")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's decay rate of the gradient's running mean")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW's decay rate of the squared gradient's running mean")
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon, added to the denominator")
    warmup_steps: int = Field(
        0, ge=0, description="optimizer steps of linear warm-up: step i (0-based) uses lr * (i + 1) / warmup_steps; 0 = none")
    lr_scheduler: Literal["cosine", "constant"] = Field(
        "cosine", description="after warm-up: cosine decays to min_lr_ratio * lr at the run's last optimizer step "
        "(trainer.total_steps training steps); constant keeps lr")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine only: the final learning rate as a fraction of lr")
    max_grad_norm: float = Field(
        1.0, gt=0, description="gradients are clipped to this global L2 norm before every optimizer step (the stat "
        "grad_norm is the norm before clipping)")


class MegatronConfig(_Strict):
    """Megatron-core options of a role (backend=megatron); parallel sizes come from allocation_mode."""

    sequence_parallel: bool | None = Field(None, description="None: on when TP > 1 (Megatron-LM's advice)")
    distributed_optimizer: bool = Field(True, description="shard optimizer state over data-parallel ranks")
    virtual_pipeline_stages: int | None = Field(None, gt=1, description="model chunks per PP rank (interleaved 1F1B)")
    batch_p2p_comm: bool = Field(True, description="batch PP send/recv (must be False with virtual stages at PP=2)")
    overlap_p2p_comm: bool = Field(False, description="overlap PP send/recv with compute (virtual stages only)")
    moe_token_dispatcher: Literal["alltoall", "allgather"] = Field(
        "alltoall", description="MoE models: how tokens reach their experts across ranks (megatron-core "
        "moe_token_dispatcher_type); no effect on dense models")


class LoraConfig(_Strict):
    """LoRA adapters (PEFT) on a trainable torch or fsdp role: only the adapters train, and weight
    updates and checkpoints carry only them (docs/lora.md)."""

    rank: int = Field(8, gt=0, description="r: the inner dimension of each adapter's A (r x in) and B (out x r)")
    alpha: float = Field(16.0, gt=0, description="lora_alpha: the adapter's output is scaled by alpha / rank")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
        description="names (last component) of the Linear modules that get an adapter, e.g. q_proj, gate_proj")
    dropout: float = Field(0.0, ge=0, lt=1, description="lora_dropout on the adapter's input during training")
    export_merged: bool = Field(
        False, description="save_hf (checkpoints, trainer.save_freq_steps) also writes `merged/`: the base weights with "
        "the adapter merged in, a plain HF model that loads in transformers alone")


class RoleConfig(_Strict):
    """A model role (actor, ref): its backend and, if trainable, its optimizer."""

    backend: Literal["torch", "fsdp", "megatron"] | None = Field(
        None, description="torch (replicated on every data-parallel rank) | fsdp (the torch engine with parameters, "
        "gradients and optimizer state sharded over data-parallel ranks by FSDP2; generates on generation servers "
        "only) | megatron; None: for the actor torch on a data-parallel training mesh, megatron when "
        "allocation_mode asks for pN/tN/cN/eN > 1; other roles: the actor's backend")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="compute dtype. auto: bfloat16 on a GPU, float32 on a CPU. bfloat16 — torch: autocast to bf16; fsdp: parameters gathered in bf16 "
        "(FSDP2 MixedPrecisionPolicy), gradients reduced in float32; both keep float32 parameters and optimizer "
        "state. megatron: megatron-core's mixed precision, bf16 parameters with float32 main gradients, master "
        "weights and Adam state. Log-probs are taken in float32 from the bf16 logits. Refused on a CPU without bf16 "
        "instructions (avx512_bf16 or amx_bf16)")
    megatron: MegatronConfig = Field(default_factory=MegatronConfig, description="read by backend=megatron only")
    trainable: bool = Field(False, description="has an optimizer: MFCs that train (ppo_update, sft_update) need it")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="used when trainable")
    max_tokens_per_mb: int = Field(
        4096, gt=0, description="token budget of one packed micro-batch of a forward (and backward) pass; a longer "
        "sequence gets a micro-batch of its own. An MFC's own max_tokens_per_mb overrides it for that MFC")
    gradient_checkpointing: bool = Field(
        False, description="trainable roles: keep only each transformer layer's input and recompute the layer in "
        "backward (less activation memory, about one more forward of compute). torch: HF gradient checkpointing; "
        "megatron: megatron-core full recompute, one layer per unit")
    lora: LoraConfig | None = Field(
        None, description="trainable torch and fsdp roles: train LoRA adapters on the frozen base model instead of every "
        "weight (None: full fine-tuning)")

    @model_validator(mode="after")
    def _check(self) -> "RoleConfig":
        if self.lora is not None and not self.trainable:
            raise ValueError("lora: only a trainable role trains adapters (set trainable: true or drop lora)")
        if self.lora is not None and self.backend == "megatron":
            raise ValueError("lora: backend=megatron has no LoRA in realcore; use backend=torch or fsdp")
        if self.gradient_checkpointing and not self.trainable:
            raise ValueError("gradient_checkpointing: only a trainable role runs backward (set trainable: true "
                             "or drop it)")
        return self


class DatasetConfig(_Strict):
    """Prompts and reference answers. `type` names a registered dataset."""

    type: str = Field("tiny-arith", description="tiny-arith | jsonl | reasoning-gym | a registered name")
    path: str | None = Field(None, description="jsonl file with `question` and `answer` (type=jsonl)")
    task: str = Field("basic_arithmetic", description="reasoning-gym task name (type=reasoning-gym)")
    task_kwargs: dict[str, Any] = Field(default_factory=dict, description="reasoning-gym task options")
    size: int = Field(256, gt=0, description="number of generated problems (generated datasets)")
    seed: int = Field(1, description="seeds generated datasets (tiny-arith, reasoning-gym) and the shuffle of "
                      "every epoch's order")
    format: Literal["rl", "sft"] = Field("rl", description="rl: prompt_ids + answer; sft: input_ids + loss_mask")
    prompt_template: str = Field(
        "Question: {question}\nAnswer:", description="`{question}` is replaced (str.format: write other braces "
        "as {{ and }})")
    system_prompt: str | None = Field(None, description="with a chat template: replaces its default system message")
    max_prompt_len: int = Field(
        256, gt=0, description="prompts of more tokens (after the template) are skipped and counted")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="options of a user-registered dataset (it reads them as cfg.kwargs)")
    holdout: float = Field(
        0.0, ge=0, lt=1, description="fraction of the distinct questions left out of training, chosen by a hash of the "
        "question text (the same questions whatever the seed); an evaluation of the same task then sees only them. "
        "Built-in datasets")


class GenerationConfig(_Strict):
    """Sampling for the `generate` MFC."""

    n_samples: int = Field(4, gt=0, description="sequences per prompt (the GRPO group)")
    max_new_tokens: int = Field(
        32, gt=0, description="most tokens of one generation call (one turn of a multi-turn workflow)")
    temperature: float = Field(
        1.0, gt=0, description="sampling temperature; generation, inference and training log-probs are all of "
        "logits / temperature")
    top_p: float = Field(
        1.0, gt=0, le=1, description="nucleus sampling: sample from the most likely tokens whose probability sums to "
        "top_p; 1 = off")
    top_k: int = Field(0, ge=0, description="sample from the k most likely tokens; 0 disables top-k")
    greedy: bool = Field(False, description="decode by argmax instead of sampling")
    stop_token_ids: list[int] = Field(default_factory=list, description="in addition to the EOS token")
    ignore_eos: bool = Field(False, description="keep generating past EOS (benchmarks, tests)")
    max_batch_size: int = Field(
        64, gt=0, description="sequences decoded together by the built-in engine; also each generation server's "
        "limit (built-in: prompts per /generate request; SGLang --max-running-requests; vLLM --max-num-seqs)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the built-in generation server's engine runs (weights, KV cache, sampling). auto: "
        "the GPU its process was placed on when it has one (system.gpus), else the CPU; cuda: a GPU or a one-line "
        "error; cpu: the CPU even on a GPU node (the built-in servers are placed on no GPU; the training ranks take "
        "the first ones)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weights of the built-in generation server's engine. auto: bfloat16 on a GPU (the whole "
        "model in bf16, log-probs from its logits in float32), float32 on a CPU; SGLang/vLLM servers on GPUs get it "
        "as --dtype (auto: bfloat16). On a CPU, float32: its linear layers "
        "multiply through oneDNN (as vLLM's CPU backend; torch's default BLAS was half as fast on an AMD CPU). "
        "bfloat16 stores and multiplies "
        "the decoder's linear layers in bf16 (1.5-1.6x the tokens/s of float32 on a CPU with avx512_bf16 / amx_bf16; "
        "refused with an error on a CPU without them) while the residual stream, attention, KV cache and output "
        "projection stay float32, so behaviour log-probs come from float32 logits: median error ~7e-3 per token "
        "against the trainer's float32 recomputation, rare tokens up to ~0.3; greedy tokens may differ from "
        "float32's. The trainer's own sync-mode generation keeps its model's dtype")


class PPOConfig(_Strict):
    """Clipped PPO / GRPO hyperparameters (names follow the papers)."""

    eps_clip: float = Field(0.2, gt=0, description="the ratio is clipped to [1 - eps_clip, 1 + eps_clip] (PPO's epsilon)")
    c_clip: float | None = Field(None, gt=1, description="dual-clip constant (Ye et al. 2020); None disables")
    kl_coef: float = Field(
        0.0, ge=0, description="weight of KL(actor || ref) in the loss; 0 = off, > 0 needs the ref_logprobs input")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="per-token KL estimator (Schulman 2020), with log r = ref - actor log-prob: k1 = -log r, "
        "k2 = (log r)^2 / 2, k3 = (r - 1) - log r; used when kl_coef > 0")
    entropy_coef: float = Field(
        0.0, ge=0, description="entropy bonus: the loss subtracts entropy_coef x the token-mean entropy of the policy "
        "(temperature-scaled, over the response tokens); keeps a policy from collapsing to one answer. 0 = off")
    adv_norm: Literal["group", "batch", "none"] = Field(
        "group", description="advantage of a sequence, from its group's rewards: group: (r - mean) / (std + adv_eps) "
        "within the group (GRPO); batch: r - group mean, divided by the batch std of those (+ adv_eps); none: "
        "r - group mean (Dr. GRPO)")
    adv_eps: float = Field(1e-6, gt=0, description="added to the std that adv_norm group/batch divide by")
    ppo_n_minibatches: int = Field(
        1, gt=0, description="each data-parallel rank splits its batch into this many minibatches, one optimizer "
        "step each")
    use_decoupled_loss: bool = Field(False, description="decoupled PPO: ratio against prox_logprobs, behaviour weight")
    behav_imp_weight_cap: float | None = Field(
        None, gt=1, description="use_decoupled_loss only: tokens whose behaviour weight exp(prox - behav) exceeds it "
        "get loss 0 (still counted in the token mean); None: no cap")
    ppo_epochs: int = Field(
        1, gt=0, description="passes over the batch per training step, each ppo_n_minibatches optimizer steps; "
        "advantages and behaviour log-probs stay those of the batch; stats are the last pass's")


class RewardConfig(_Strict):
    """The scoring function of the `reward` MFC (sync) and of the rollout workers' agents (async)."""

    type: str = Field("math", description="a registered reward: fn(prompt, completion, prompt_ids, completion_ids, **data) -> float (sync or async)")
    timeout_s: float = Field(30.0, gt=0, description="a reward call running longer is stopped (its process killed): reward 0, counted in reward/timeouts")
    n_procs: int = Field(1, gt=0, description="processes per worker that run reward calls (in parallel)")


class RolloutConfig(_Strict):
    """Asynchronous mode: rollout workers, generation servers, staleness control (AReaL's names)."""

    n_workers: int = Field(2, gt=0, description="rollout worker processes")
    workflow: str = Field(
        "math-single-step", description="a registered rollout workflow (realcore.api.workflow): math-single-step | "
        "math-multi-turn | math-tool | a user's. It runs on rollout workers (async) and in the generate MFC (sync)")
    workflow_kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the workflow (e.g. max_turns)")
    max_head_offpolicyness: int = Field(0, ge=0, description="eta: admitted rollouts are at most this many versions stale")
    drop_stale: bool = Field(
        True, description="async mode. true: a trajectory whose first token is more than max_head_offpolicyness versions older than "
        "the policy that would train it is dropped, and a rollout certain to be dropped stops early (a hard bound); "
        "false: the bound holds at admission only, as in AReaL: every finished rollout is trained, a slow one possibly "
        "staler than that (staleness/head shows it), and no generation is thrown away")
    max_concurrent_rollouts: int = Field(16, gt=0, description="rollouts in flight across all rollout workers")
    max_concurrent_tool_calls: int = Field(
        16, gt=0, description="tool-sandbox calls (run_python, e.g. math-tool's) running at once on one node, across "
        "all of the run's processes there (rollout workers, evaluation, the generate MFC in sync mode): each call holds one of this "
        "many flock'ed slot files under OUTPUT_DIR/sandbox_slots/HOST while it runs, so their memory is at most this "
        "many x max_procs x mem_mb; a call that finds no free slot within 60 s returns the error \"busy\" to its agent")
    routing: Literal["round_robin", "least_requests"] = Field(
        "least_requests", description="which generation server (of those holding the current weights) runs the next "
        "rollout: least_requests: the one with fewest rollouts in flight; round_robin: each in turn")
    weight_update: Literal["disk", "memory", "nccl"] = Field(
        "disk", description="how new weights reach the servers: disk: HF safetensors they load; memory: tensors over "
        "the authenticated wire (built-in servers); nccl: a bucketed broadcast from trainer rank 0 over a weight-update "
        "group (SGLang's /init_weights_update_group + /update_weights_from_distributed; NCCL with CUDA, gloo without: "
        "trainer rank 0 and the servers on different GPUs, or both on the CPU; refused before start otherwise)")
    inflight_weight_update: bool = Field(
        False, description="built-in servers (local.*): a weight update lands between two decode steps (nccl, and a "
        "LoRA adapter from disk: the servers hold their requests while it arrives) and the running requests go on "
        "with the KV cache of the older weights, each token tagged with the version that sampled it (PipelineRL's "
        "in-flight update; staleness still counts from a rollout's first token). False: they end and are resubmitted, "
        "their prefix recomputed with the new weights (AReaL's)")
    weight_bucket_mb: float = Field(
        512.0, gt=0, description="weight_update=nccl: tensors per HTTP request + broadcast round, up to this many MiB "
        "(a larger tensor goes alone)")
    filter_equal_reward_groups: bool = Field(
        False, description="dynamic filtering (async mode; sync mode ignores it): rollout workers drop groups whose "
        "rewards are all equal, and new rollouts take their place")
    request_timeout_s: float = Field(600.0, gt=0, description="deadline for one generation request")
    request_retries: int = Field(3, ge=0, description="a request whose server fails or goes silent runs again on another server, this many times")
    episode_retries: int = Field(
        2, ge=0, description="an episode that raises is retried this many times; then async mode drops its group "
        "(counted in rollout/failed_episodes), sync mode fails the generate call")
    server_token: str | None = Field(
        None, description="the bearer token every generation server of the run requires (loopback too); None: "
        "rollout.server_token_file, else $REALCORE_SERVER_TOKEN, else derived from the run's secret "
        "(OUTPUT_DIR/.secret). Set it to call the servers yourself. Given on the command line it is visible to "
        "every user of the machine (ps): prefer rollout.server_token_file or $REALCORE_SERVER_TOKEN")
    server_token_file: str | None = Field(
        None, description="a file whose content (surrounding whitespace stripped) is rollout.server_token, read "
        "by the launcher: the token stays off the command line; it must not be readable by other users")
    server_mem_fraction: float | None = Field(
        None, gt=0, le=1, description="SGLang (--mem-fraction-static) and vLLM (--gpu-memory-utilization) on GPUs: the "
        "share of each GPU's memory the server takes for weights and KV cache. None: scheduler=local: 0.85 divided "
        "by the number of processes placed on that GPU (system.gpus); Slurm/Ray: 0.85")
    server_python: str | None = Field(
        None, description="the interpreter that runs SGLang/vLLM servers (e.g. /opt/sglang-venv/bin/python), so the "
        "engine can live in its own environment; None: realcore's own (sys.executable)")


class EvalConfig(_Strict):
    """Evaluation on held-out prompts: during training every `freq_steps` steps (on the generation
    servers, or on the actor in sync mode without them) and with `python -m realcore.eval`. Each
    prompt runs the rollout workflow once greedily (eval/accuracy: reward > 0; eval/reward: mean
    reward) and `n_samples` times sampled (eval/pass@k, k = n_samples: any of them has reward > 0)."""

    freq_steps: int | None = Field(None, gt=0, description="evaluate the base policy before the first step (not on resume), after every N "
        "training steps and after the last; None: never")
    dataset: DatasetConfig | None = Field(
        None, description="held-out prompts; None: the training dataset's config with seed + size (a disjoint draw of a generated "
        "dataset; give a held-out file for jsonl datasets). Questions also in the training dataset are left out")
    n_prompts: int = Field(32, gt=0, description="prompts evaluated (the first n of the dataset)")
    n_samples: int = Field(4, ge=0, description="sampled episodes per prompt, for eval/pass@k; 0: the greedy pass only")
    max_new_tokens: int | None = Field(None, gt=0, description="None: generation.max_new_tokens")
    temperature: float | None = Field(None, gt=0, description="of the sampled episodes; None: generation.temperature")


class TrainerConfig(_Strict):
    """Length of the run and its checkpoints."""

    total_steps: int = Field(
        10, gt=0, description="training steps of the run (each runs the dataflow graph on batch_size prompts); the "
        "cosine LR decay ends at the last of them")
    batch_size: int = Field(8, gt=0, description="prompts per step")
    save_freq_steps: int | None = Field(None, gt=0, description="HF checkpoints (checkpoints/step_N); None: at the last step only")
    recover_freq_steps: int | None = Field(
        None, gt=0, description="recover checkpoints (recover/step_N: everything to continue exactly) every N steps; "
        "also at preemption, and at the last step when this is set or recover_mode is not disabled. None: only those")


class MFCConfig(_Strict):
    """One node of the dataflow graph."""

    name: str = Field(description="unique node name (logs, stats `time/NAME_s`, errors)")
    type: str = Field(description="a registered MFC implementation")
    model: str | None = Field(None, description="model role; None for model-free MFCs (reward)")
    inputs: list[str] = Field(default_factory=list, description="buffer keys it reads (data source or other MFCs)")
    outputs: list[str] = Field(default_factory=list, description="names it writes (output_remap renames them)")
    input_remap: dict[str, str] = Field(default_factory=dict, description="buffer key -> name the MFC reads")
    output_remap: dict[str, str] = Field(default_factory=dict, description="name the MFC writes -> buffer key")
    n_seqs: int | None = Field(None, gt=0, description="samples per call; default trainer.batch_size")
    max_tokens_per_mb: int | None = Field(
        None, gt=0, description="this MFC's micro-batch token budget, passed to its engine calls (logprobs, "
        "train_batch); None: the role's max_tokens_per_mb. Only for MFC types that micro-batch (inference, "
        "ppo_update, sft_update): on others it is an error")
    args: dict[str, Any] = Field(
        default_factory=dict, description="this MFC's own settings, validated when the graph is built by the "
        "pydantic model its class declares as `Args` (`self.args = self.Args(**mfc.args)` in its __init__); an "
        "error on a class that declares none")


class NameResolveConfig(_Strict):
    """Where workers publish and find each other's addresses."""

    type: Literal["fs", "redis", "etcd"] = Field("fs", description="fs: a (shared) directory; redis or etcd: a server")
    root: str | None = Field(
        None, description="fs: the folder holding the keys, seen by every node of the run. None: "
        "OUTPUT_DIR/.name_resolve, which every node of a Slurm or Ray run shares (a per-user folder in /tmp would "
        "be one per node) and nobody else writes to. Created mode 0700; a folder that is not yours, or that group "
        "or others can write to, is refused before anything starts (its owner could redirect the run)")
    address: str | None = Field(None, description="redis/etcd host:port; None: 127.0.0.1:6379 (redis), 127.0.0.1:2379 (etcd)")
    namespace: str = Field("realcore", description="redis/etcd: prefix of every key on a shared server")
    timeout_s: float = Field(5.0, gt=0, description="redis/etcd: connect and request deadline")
    username: str | None = Field(
        None, description="redis/etcd: the user the client logs in as (Redis ACL user, etcd user; etcd: needs "
        "tls_ca_file, its client sends no password over plain TCP); None: redis's default user, no login on etcd")
    password_file: str | None = Field(
        None, description="redis/etcd: a file holding the password (a trailing newline dropped; refused if group or others "
        "can read it). Never on the command line: it would show in `ps`")
    password_env: str | None = Field(
        None, description="redis/etcd: the name of an environment variable holding the password (every process "
        "of the run must inherit it; set it or password_file, not both)")
    tls_ca_file: str | None = Field(
        None, description="redis/etcd: talk TLS to the server, verifying its certificate with this CA bundle "
        "(PEM); None: plain TCP")


class SlurmConfig(_Strict):
    """scheduler=slurm: one sbatch allocation, one job step per worker type (realcore/launch/slurm.py)."""

    partition: str | None = Field(None, description="sbatch --partition; None: the cluster's default")
    account: str | None = Field(None, description="sbatch --account; None: your default account")
    qos: str | None = Field(None, description="sbatch --qos; None: the default QOS")
    time_limit: str | None = Field(None, description="sbatch --time, e.g. 2-00:00:00")
    nodes: int | None = Field(None, gt=0, description="sbatch --nodes; None lets Slurm choose")
    gpus_per_node: int | None = Field(
        None, ge=0, description="GPUs per node. N: each model worker gets one GPU, each built-in server one (none "
        "with generation.device=cpu), each SGLang/vLLM server tp*pp (allocation_mode) on one node of N (sbatch "
        "--gpus-per-node=N). None: asked of Slurm (sinfo -o %G, of slurm.partition): the fewest GPUs of a node that "
        "has some, 0 when no node has one; where sinfo cannot answer (no Slurm here), GPUs only when the servers are "
        "SGLang/vLLM. 0: no GPUs requested (CPU nodes)")
    cpus_per_task: int = Field(1, gt=0, description="CPUs of every worker process")
    mem_per_cpu_mb: int | None = Field(None, gt=0, description="sbatch/srun --mem-per-cpu (needed where memory is a consumable)")
    container_prefix: str = Field("", description="prefix of every worker command, e.g. 'apptainer exec --nv image.sif'")
    setup: list[str] = Field(default_factory=list, description="shell lines run before the steps (module load, venv activate)")
    sbatch_args: list[str] = Field(default_factory=list, description="extra #SBATCH directives, e.g. --exclusive")
    srun_args: list[str] = Field(default_factory=list, description="extra arguments of every srun step")
    python: str | None = Field(None, description="interpreter on the nodes; None: the launcher's own")
    poll_interval_s: float = Field(2.0, gt=0, description="how often the launcher asks squeue")
    cancel_timeout_s: float = Field(60.0, gt=0, description="deadline for a cancelled job to leave squeue")
    requeue: bool = Field(
        False, description="a preempted job (its master wrote a recover checkpoint and exited 75) requeues itself "
        "(scontrol requeue; sbatch --requeue) and, started again by Slurm, resumes from the checkpoint; needs "
        "recover_mode resume or auto. False: the job ends with exit code 75 (sbatch --no-requeue)")


class RayConfig(_Strict):
    """scheduler=ray: workers are Ray tasks; each model mesh is one placement group (realcore/launch/ray_scheduler.py)."""

    address: str | None = Field(None, description="ray.init address ('auto', 'ray://host:10001'); None starts a local Ray")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs of every worker process (fractions allowed)")
    gpus_per_worker: int | None = Field(
        None, ge=0, le=1, description="0: no GPU; 1: each model worker (one rank) and built-in server (unless "
        "generation.device=cpu) gets one GPU, each SGLang/vLLM server tp*pp (allocation_mode). None: 1 when the Ray "
        "cluster has GPUs (ray.cluster_resources() at start), else 0")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray strategy of each mesh's placement group (the model workers; the generation servers): "
        "PACK: few nodes; SPREAD: many; STRICT_PACK: one node; STRICT_SPREAD: one worker per node")
    python: str | None = Field(None, description="interpreter on the nodes; None: the launcher's own")


class SystemConfig(_Strict):
    """Process, wire and deadline settings."""

    threads_per_process: int = Field(
        1, gt=0, description="CPU threads of every worker process (torch.set_num_threads, OMP_NUM_THREADS, MKL_NUM_THREADS)")
    gpus: list[GpuId] | None = Field(
        None, description="scheduler=local: the node's GPU slots, as CUDA_VISIBLE_DEVICES entries, in the order "
        "processes are placed on them: generation servers first (tp*pp each; a built-in server one, none with "
        "generation.device=cpu), then one per training rank; without servers (dN) rank r takes slot r. None: the "
        "visible CUDA devices (none on a CPU machine: every process runs on the CPU). A GPU named twice holds two "
        "processes (e.g. [0,0]: a server and a trainer on one GPU); [] runs everything on the CPU "
        "(CUDA_VISIBLE_DEVICES=\"\" for every process)")
    host: str = Field("127.0.0.1", description="address workers bind and publish; 'auto': this node's address")
    interface: str | None = Field(None, description="bind on this network interface's IPv4 address (e.g. ib0); overrides host")
    heartbeat_interval_s: float = Field(
        1.0, gt=0, description="how often every process proves it is alive (its heartbeat file, the master's pings) "
        "and rollout workers and the gserver manager probe the generation servers' /health (also each probe's "
        "deadline); keep it well below heartbeat_timeout_s")
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="a worker silent this long is lost (hung): its stacks are dumped, then it is killed")
    startup_timeout_s: float = Field(300.0, gt=0, description="deadline for workers to register and configure")
    relay_group_size: int = Field(
        8, ge=1, description="the master sends its requests for up to this many model workers of one node (same host "
        "in their addresses) as one message to the first of them, which forwards each and answers with all their "
        "replies, heartbeats included: the master's messages per step grow with nodes, not workers; 1: a message "
        "to every worker")
    relay_fanout: int = Field(
        8, ge=1, description="relays of relays: the master's messages for up to this many relays (of "
        "relay_group_size workers each, taken in order) go as one message to the first of them, which passes each "
        "relay its own and answers with all their replies: at 1000 workers in groups of 8, 16 messages per "
        "request round instead of 125; 1: a message to every relay")
    request_timeout_s: float = Field(
        1800.0, gt=0, description="deadline for one MFC call, and for every other request between realcore processes "
        "(a batch from the rollout stream, tensor transfers, weight pushes, manager calls, torch.distributed "
        "collectives)")
    shutdown_timeout_s: float = Field(10.0, gt=0, description="grace before SIGKILL at exit")
    preempt_timeout_s: float = Field(
        120.0, gt=0, description="SIGTERM to the launcher: the step in progress finishes and a recover checkpoint is "
        "written within this, then the run exits 75; past it, everything is killed")
    name_resolve: NameResolveConfig = Field(
        NameResolveConfig(), description="where processes publish and find each other's addresses")
    max_http_body_bytes: int = Field(
        16 * 2**20, ge=2**16, description="largest request body the built-in generation server reads (413 above "
        "it). The largest legitimate body is a /generate batch: max_batch_size prompts of up to the model's context "
        "as JSON token ids, at most 8 bytes each ('151643, '): the default fits 64 prompts of 30k tokens")
    http_header_timeout_s: float = Field(
        20.0, gt=0, description="the built-in generation server closes a connection whose request line and headers "
        "are not complete this long after it opened or after its last answer (slow or idle clients, before the "
        "token is checked); also how long an idle keep-alive connection stays open. Above aiohttp's client "
        "keep-alive (15 s), so pooled client connections are closed by the client first")
    http_body_timeout_s: float = Field(
        60.0, gt=0, description="the built-in generation server answers 408 and closes the connection when an "
        "authenticated request's body is not complete this long after its headers; an unauthenticated body is "
        "never read (at most this long is spent discarding it)")
    weight_group_connect_timeout_s: float = Field(
        10.0, gt=0, description="the built-in generation server's /init_weights_update_group answers 400 when the "
        "trainer's TCPStore at master_address:master_port does not accept a connection within this (joining the "
        "group once connected has its own, longer deadline)")
    # ZeroMQ wire limits and replay protection (realcore/transport/wire.py, docs/wire.md).
    max_message_bytes: int = Field(
        2**31, gt=0, description="largest frame a tensor-carrying ZeroMQ socket accepts (ZMQ_MAXMSGSIZE; one frame "
        "is one tensor, the largest being one weight tensor of an in-memory weight update); a sender fails naming "
        "this key when a tensor is larger, a receiver drops the connection of a peer that sends one")
    max_control_message_bytes: int = Field(
        64 * 2**20, gt=0, description="largest control message (and message header) a socket accepts: control "
        "sockets carry msgpack metadata only (capped at max_message_bytes)")
    max_message_frames: int = Field(
        65536, ge=4, description="most frames one ZeroMQ message may have on a tensor-carrying socket (a data-plane "
        "reply or a weight push sends one frame per tensor, e.g. one per weight of the model); a message with more "
        "is read to its end without being kept, dropped and counted as malformed (control sockets take 8)")
    wire_curve: bool = Field(
        True, description="encrypt and authenticate every ZeroMQ connection with CURVE, keys derived from the run's "
        "secret: a peer without the secret cannot complete a handshake, so it cannot make a listener read or parse "
        "anything. false saves CURVE's cost (docs/wire.md) but lets anyone who reaches system.host connect, send "
        "frames that are read before the MAC refuses them, and read every message (prompts, rollouts, weights) in "
        "clear on the network")
    clock_skew_s: float = Field(
        30.0, ge=0, description="a receiver rejects messages stamped earlier than its own start minus this (replays "
        "captured before it restarted); also the clock difference between hosts that is tolerated")
    drop_log_interval_s: float = Field(
        60.0, gt=0, description="a dropped message is logged the first time its (socket, reason) occurs, then in at "
        "most one summary line per this many seconds; every drop is counted in metrics.jsonl (dropped/*)")


class WandbConfig(_Strict):
    """Weights & Biases: the master logs every step's numbers of metrics.jsonl to one W&B run (needs
    `pip install wandb`). A W&B error never stops training: one warning, then the run goes on without it."""

    project: str | None = Field(
        None, min_length=1, description="W&B project the master logs every step's metrics to (needs `pip install "
        "wandb`); None: no W&B logging")
    entity: str | None = Field(None, description="W&B team or user that owns the project; None: your default entity")
    name: str | None = Field(None, description="run name shown in W&B; None: EXPERIMENT/TRIAL")
    group: str | None = Field(None, description="W&B run group (e.g. the trials of one sweep); None: no group")
    mode: Literal["online", "offline"] = Field(
        "online", description="online: stream to the W&B server; offline: write under OUTPUT_DIR/wandb only, upload "
        "later with `wandb sync OUTPUT_DIR/wandb/offline-run-*`")
    tags: list[str] = Field(default_factory=list, description="W&B run tags, e.g. [grpo,tiny]")


class LoggingConfig(_Strict):
    """Where step metrics go besides metrics.jsonl, TensorBoard (OUTPUT_DIR/tensorboard) and the console."""

    wandb: WandbConfig = Field(WandbConfig(), description="Weights & Biases (off unless logging.wandb.project is set)")


def _model_parallel(allocation_mode: str) -> bool:
    """Whether the training mesh splits the model (pN/tN/cN/eN > 1); False for an unparsable mode,
    which the launcher's checks report."""
    from realcore.api.alloc import parse_allocation_mode

    try:
        m = parse_allocation_mode(allocation_mode).train
    except ValueError:
        return False
    return (m.pp, m.tp, m.cp, m.ep) != (1, 1, 1, 1)


class ExperimentConfig(_Strict):
    """One run: what `python -m realcore.launch` composes from experiments/ and the command line."""

    experiment_name: str = Field(
        description="names the run with trial_name (name-resolution keys, Slurm job, Ray namespace, the default "
        "output_dir outputs/EXPERIMENT/TRIAL); letters, digits, _ . + = -")
    trial_name: str = Field("trial0", description="one run of the experiment, kept apart from its other trials")
    output_dir: str = Field(
        description="folder of everything the run writes: resolved config, metrics.jsonl, ledger.jsonl, logs/, "
        "checkpoints/, recover/")
    seed: int = Field(
        1, description="seeds the tiny model's weights, sampling (generation server i: seed + 1000 i) and Megatron's "
        "RNGs; the dataset's generation and order use dataset.seed")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: every step runs the whole dataflow graph on new dataset prompts (generation, if "
        "any, inside it: the generate MFC); async: rollout workers stream trajectories from generation servers while "
        "the trainer trains (needs servers in allocation_mode)")
    recover_mode: Literal["disabled", "resume", "auto"] = Field(
        "disabled", description="disabled: a failure ends the run; resume: a launch with the same output_dir continues from "
        "its last recover checkpoint, and a dead or hung rollout-side process (generation server, gserver manager, "
        "rollout worker) is restarted in place; auto: resume, and after a failure the launcher restarts the run (up "
        "to recover_retries)")
    start_over: bool = Field(
        False, description="a launch into an output_dir holding another run's records (metrics.jsonl, ledger.jsonl, "
        "recover/, checkpoints/) is refused unless recover_mode is resume or auto (continue that run) or this is true: "
        "then, whatever recover_mode says, everything that run left in output_dir moves into "
        "output_dir/previous/DATE-TIME/ (nothing is deleted) and this run starts from step 0; a later resume "
        "continues this run, never the old one")
    recover_retries: int = Field(
        3, ge=0, description="recover_mode=auto: whole-run restarts before giving up (exit 1); resume/auto: a "
        "rollout-side process that dies within a minute of starting more than this many times fails the run")
    recover_delay_s: float = Field(5.0, ge=0, description="recover_mode=auto: wait before restarting after a failure")
    scheduler: Literal["local", "slurm", "ray"] = Field(
        "local", description="local: processes on this machine; slurm: one sbatch job (slurm:); ray: Ray tasks (ray:)")
    allocation_mode: str = Field(
        "d2p1t1", description="AReaL form: the training mesh (d2p1t1 = DP 2 x PP 1 x TP 1; cN, eN optional), generation colocated; "
        "or ENGINE.MESH+MESH (local, sglang, vllm, or one registered in `imports`): generation servers, then the training mesh")
    imports: list[str] = Field(
        default_factory=list, description="user modules imported by the launcher and every worker before the graph is "
        "built (they register MFCs, workflows, rewards, datasets)")
    model: ModelConfig = Field(ModelConfig(), description="the weights every model role starts from")
    dataset: DatasetConfig = Field(DatasetConfig(), description="the training prompts")
    actor: RoleConfig = Field(RoleConfig(trainable=True), description="the policy role (trainable unless set otherwise)")
    ref: RoleConfig | None = Field(None, description="the reference role (ref_logprobs for the KL term); None: no ref")
    generation: GenerationConfig = Field(
        GenerationConfig(), description="sampling of rollouts (generate MFC, rollout workers, generation servers)")
    ppo: PPOConfig = Field(PPOConfig(), description="the ppo_update MFC's hyperparameters")
    reward: RewardConfig = Field(RewardConfig(), description="the reward function and how it is run")
    rollout: RolloutConfig = Field(RolloutConfig(), description="the rollout workflow; async mode's workers and servers")
    trainer: TrainerConfig = Field(TrainerConfig(), description="run length, batch size, checkpoints")
    eval: EvalConfig = Field(EvalConfig(), description="held-out evaluation")
    mfcs: list[MFCConfig] = Field(default_factory=list, description="the dataflow graph's nodes (at least one)")
    system: SystemConfig = Field(SystemConfig(), description="processes, addresses, wire limits, deadlines")
    slurm: SlurmConfig = Field(SlurmConfig(), description="scheduler=slurm only")
    ray: RayConfig = Field(RayConfig(), description="scheduler=ray only")
    logging: LoggingConfig = Field(LoggingConfig(), description="experiment trackers the master logs step metrics to (W&B)")

    @model_validator(mode="after")
    def _check(self) -> "ExperimentConfig":
        if not self.mfcs:
            raise ValueError("mfcs: an experiment declares at least one MFC")
        if self.system.name_resolve.root is None:  # the run's own folder, shared by its nodes (NameResolveConfig.root)
            self.system.name_resolve.root = os.path.join(os.path.abspath(self.output_dir), ".name_resolve")
        if self.actor.backend is None:
            self.actor.backend = "megatron" if _model_parallel(self.allocation_mode) else "torch"
        if self.ref is not None and self.ref.backend is None:  # roles share one mesh: same backend by default
            self.ref.backend = self.actor.backend
        return self

    def roles(self) -> dict[str, RoleConfig]:
        """Model roles declared by this experiment."""
        out = {"actor": self.actor}
        if self.ref is not None:
            out["ref"] = self.ref
        return out


def _models(annotation) -> list[type[BaseModel]]:
    """The config models inside an annotation (`X`, `X | None`, `list[X]`, `dict[str, X]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def config_keys(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> dict[str, str | None]:
    """Dotted key -> its description, recursively (`mfcs.name` for the items of a list); what
    `python -m realcore.launch --help` prints."""
    out = {}
    for name, field in model.model_fields.items():
        key = prefix + name
        out[key] = field.description
        for sub in _models(field.annotation):
            out.update(config_keys(sub, key + "."))
    return out


def config_sections(model: type[BaseModel] = ExperimentConfig) -> list[type[BaseModel]]:
    """Every config model reachable from `model`."""
    seen, todo = [], [model]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.append(m)
            todo += [sub for f in m.model_fields.values() for sub in _models(f.annotation)]
    return seen
