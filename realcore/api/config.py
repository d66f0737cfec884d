"""Typed experiment configuration (pydantic v2). Unknown keys are rejected everywhere.

Hydra composes YAML from `experiments/` in `realcore/launch`; everything else receives these objects.
The process and scheduler sections (system, name_resolve, slurm, ray) are in `config_system.py`.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from realcore.api.alloc import POLICY_ROLE, parse_allocation_mode
from realcore.api.config_base import StrictModel
# The process and scheduler sections live in config_system; callers keep importing them from here.
from realcore.api.config_system import NameResolveConfig as NameResolveConfig
from realcore.api.config_system import RayConfig, SlurmConfig, SystemConfig


class TinyModelConfig(StrictModel):
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


class ModelConfig(StrictModel):
    """Which weights every model role starts from."""

    name: str = Field("tiny", description="'tiny', 'smollm2-135m', or a label for `path`")
    path: str | None = Field(None, description="any HF model directory; overrides `name`")
    tiny: TinyModelConfig = Field(TinyModelConfig(), description="shape of the random model built for name=tiny (path unset)")
    use_chat_template: bool | None = Field(
        None, description="wrap prompts with the tokenizer's chat template. None: auto, decided once by the launcher "
        "and printed in the run's first lines: on when the tokenizer has a chat template and the model is an instruct "
        "or chat model (a word instruct..., chat or it in model.name or the model folder's name, e.g. "
        "Qwen2.5-0.5B-Instruct, gemma-2-2b-it); off for a base model, even one whose tokenizer ships a template")
    cache_dir: str = Field("~/.cache/realcore", description="where converted models are cached")


class OptimizerConfig(StrictModel):
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


class MegatronConfig(StrictModel):
    """Megatron-core options of a role (backend=megatron); parallel sizes come from allocation_mode."""

    sequence_parallel: bool | None = Field(None, description="None: on when TP > 1 (Megatron-LM's advice)")
    distributed_optimizer: bool = Field(True, description="shard optimizer state over data-parallel ranks")
    virtual_pipeline_stages: int | None = Field(None, gt=1, description="model chunks per PP rank (interleaved 1F1B)")
    batch_p2p_comm: bool = Field(True, description="batch PP send/recv (must be False with virtual stages at PP=2)")
    overlap_p2p_comm: bool = Field(False, description="overlap PP send/recv with compute (virtual stages only)")
    moe_token_dispatcher: Literal["alltoall", "allgather"] = Field(
        "alltoall", description="MoE models: how tokens reach their experts across ranks (megatron-core "
        "moe_token_dispatcher_type); no effect on dense models")


class LoraConfig(StrictModel):
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


class RoleConfig(StrictModel):
    """A model role (actor, ref, critic, reward, or a user's): its weights, head, backend and, if
    trainable, its optimizer. Its mesh is given in allocation_mode (default: the actor's)."""

    model_path: str | None = Field(
        None, description="the HF model directory this role starts from (e.g. a reward model's folder); None: "
        "model.path (a critic starts from the policy's weights with a fresh value head)")

    backend: Literal["torch", "fsdp", "megatron"] | None = Field(
        None, description="torch (replicated on every data-parallel rank) | fsdp (the torch engine with parameters, "
        "gradients and optimizer state sharded over data-parallel ranks by FSDP2; generates on generation servers "
        "only) | megatron; None: a role on a mesh of its own in allocation_mode (and the actor) torch when that "
        "mesh is data-parallel only, megatron when it asks for pN/tN/cN/eN > 1; a role colocated with the actor: "
        "the actor's backend")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="compute dtype. auto: bfloat16 on a GPU, float32 on a CPU. bfloat16 — torch: autocast to bf16; fsdp: parameters gathered in bf16 "
        "(FSDP2 MixedPrecisionPolicy), gradients reduced in float32; both keep float32 parameters and optimizer "
        "state. megatron: megatron-core's mixed precision, bf16 parameters with float32 main gradients, master "
        "weights and Adam state. Log-probs are taken in float32 from the bf16 logits. Refused on a CPU without bf16 "
        "instructions (avx512_bf16 or amx_bf16)")
    megatron: MegatronConfig = Field(default_factory=MegatronConfig, description="read by backend=megatron only")
    head: Literal["policy", "value", "score"] = Field(
        "policy", description="what the model outputs. policy: per-token log-probs (the language model head); value: "
        "one value per token (a critic: the LM head replaced by a fresh linear layer to 1 output); score: one scalar "
        "per sequence, the value head at its last token (a reward model)")
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


class DatasetConfig(StrictModel):
    """Prompts and reference answers. `type` names a registered dataset."""

    type: str = Field("tiny-arith", description="tiny-arith | jsonl | parquet | hf | reasoning-gym | a registered "
                      "name (docs/datasets.md)")
    path: str | None = Field(None, description="local data: a jsonl or parquet file (type=jsonl, parquet), or the folder "
                             "datasets' save_to_disk wrote (type=hf)")
    split: str | None = Field(None, description="type=hf: the split of a DatasetDict folder (e.g. train); none: the "
                              "folder's only split")
    prompt_key: str = Field(
        "question", description="the row's key holding the prompt: text (through prompt_template, then the chat template "
        "when model.use_chat_template) or a list of chat messages {role, content} (through the chat template). A "
        "dotted key reaches into nested fields (a.b)")
    answer_key: str = Field(
        "answer", description="the row's key holding the reference answer (the reward's `answer`); dotted as prompt_key")
    task: str = Field("basic_arithmetic", description="reasoning-gym task name (type=reasoning-gym)")
    task_kwargs: dict[str, Any] = Field(default_factory=dict, description="reasoning-gym task options")
    size: int = Field(256, gt=0, description="number of generated problems (generated datasets)")
    seed: int = Field(1, description="seeds generated datasets (tiny-arith, reasoning-gym) and the shuffle of "
                      "every epoch's order")
    format: Literal["rl", "sft"] = Field("rl", description="rl: prompt_ids + answer; sft: input_ids + loss_mask")
    prompt_template: str = Field(
        "Question: {question}\nAnswer:", description="for a text prompt: `{question}` is replaced by it (str.format: "
        "write other braces as {{ and }})")
    system_prompt: str | None = Field(None, description="with a chat template: replaces its default system message "
                                      "(chat messages: put first unless they start with a system message)")
    max_prompt_len: int = Field(
        256, gt=0, description="prompts of more tokens (after the template) are skipped and counted")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="options of a user-registered dataset (it reads them as cfg.kwargs)")
    holdout: float = Field(
        0.0, ge=0, lt=1, description="fraction of the distinct questions left out of training, chosen by a hash of the "
        "question text (the same questions whatever the seed); an evaluation of the same task then sees only them. "
        "Built-in datasets")


class GenerationConfig(StrictModel):
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


class PPOConfig(StrictModel):
    """Clipped PPO / GRPO hyperparameters (names follow the papers)."""

    eps_clip: float = Field(0.2, gt=0, description="the ratio is clipped to [1 - eps_clip, 1 + eps_clip] (PPO's epsilon)")
    c_clip: float | None = Field(None, gt=1, description="dual-clip constant (Ye et al. 2020); None disables")
    kl_coef: float = Field(
        0.0, ge=0, description="weight of KL(actor || ref) in the loss; > 0 needs the ref_logprobs input; 0 = off: "
        "then, unless a kl_in_reward reads them, the MFC computing ref_logprobs is not run and the ref role not built")
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
    warn_logprob_gap_mean: float | None = Field(
        0.05, gt=0, description="a step whose consistency/logprob_gap_mean (mean |behaviour - recomputed log-prob| "
        "over the trained tokens) exceeds it logs a warning line naming the figure; None: no warning")
    warn_logprob_gap_p99: float | None = Field(
        None, gt=0, description="the same for consistency/logprob_gap_p99 (its 99th percentile); None: no warning")
    warn_logprob_gap_max: float | None = Field(
        None, gt=0, description="the same for consistency/logprob_gap_max (its largest token); None: no warning")
    warn_version_span: int | None = Field(
        None, ge=0, description="a step whose consistency/version_span (newest version_end - oldest version_start "
        "of the trained sequences, async mode) exceeds it logs a warning line; None: no warning")


class RewardConfig(StrictModel):
    """The scoring function of the `reward` MFC (sync) and of the rollout workers' agents (async)."""

    type: str = Field("math", description="a registered reward: fn(prompt, completion, prompt_ids, completion_ids, **data) -> float (sync or async)")
    timeout_s: float = Field(30.0, gt=0, description="a reward call running longer is stopped (its process killed): reward 0, counted in reward/timeouts")
    n_procs: int = Field(1, gt=0, description="processes per worker that run reward calls (in parallel)")


class RolloutConfig(StrictModel):
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


class EvalConfig(StrictModel):
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


class TrainerConfig(StrictModel):
    """Length of the run and its checkpoints."""

    total_steps: int = Field(
        10, gt=0, description="training steps of the run (each runs the dataflow graph on batch_size prompts); the "
        "cosine LR decay ends at the last of them")
    batch_size: int = Field(8, gt=0, description="prompts per step")
    save_freq_steps: int | None = Field(None, gt=0, description="HF checkpoints (checkpoints/step_N); None: at the last step only")
    recover_freq_steps: int | None = Field(
        None, gt=0, description="recover checkpoints (recover/step_N: everything to continue exactly) every N steps; "
        "also at preemption, and at the last step when this is set or recover_mode is not disabled. None: only those")


class MFCConfig(StrictModel):
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
        "pydantic model its class declares as `Args` (`self.args = self.Args(**mfc.args)` in its `__init__`); an "
        "error on a class that declares none")


class WandbConfig(StrictModel):
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


class LoggingConfig(StrictModel):
    """Where step metrics go besides metrics.jsonl, TensorBoard (OUTPUT_DIR/tensorboard) and the console."""

    wandb: WandbConfig = Field(WandbConfig(), description="Weights & Biases (off unless logging.wandb.project is set)")


def _model_parallel(allocation_mode: str, role: str = POLICY_ROLE) -> bool:
    """Whether `role`'s training mesh splits the model (pN/tN/cN/eN > 1); False for an unparsable
    mode, which the launcher's checks report."""
    try:
        m = parse_allocation_mode(allocation_mode).mesh_dims(role)
    except ValueError:
        return False
    return (m.pp, m.tp, m.cp, m.ep) != (1, 1, 1, 1)


class ExperimentConfig(StrictModel):
    """One run: what `python -m realcore.launch` composes from experiments/ and the command line."""

    # `roles` (the field) is stored as roles_ beside the method roles(); written and read as `roles`.
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    experiment_name: str = Field(
        description="names the run with trial_name (name-resolution keys, Slurm job, Ray namespace, the default "
        "output_dir outputs/EXPERIMENT/TRIAL); letters, digits, _ . + = -")
    trial_name: str = Field("trial0", description="one run of the experiment, kept apart from its other trials")
    output_dir: str = Field(
        description="folder of everything the run writes: resolved config, metrics.jsonl, ledger.jsonl, logs/, "
        "checkpoints/, recover/; the launcher's default: outputs/EXPERIMENT/TRIAL under the current directory")
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
        "or ENGINE.MESH+MESH (local, sglang, vllm, or one registered in `imports`): generation servers, then the training mesh. "
        "The training mesh may be given per role, ROLE:MESH,... (e.g. actor:d1p1t1,critic:d1p1t1,ref:d1p1t1, or "
        "local.d1+actor:d1,critic:d1): each named role gets model workers of its own, and MFCs on different meshes run "
        "at the same time; the actor must be named; a role not named shares the actor's mesh. A plain mesh puts every role on it")
    imports: list[str] = Field(
        default_factory=list, description="user modules imported by the launcher and every worker before the graph is "
        "built (they register MFCs, workflows, rewards, datasets)")
    script: str | None = Field(
        None, description="a Python file whose RL loop (realcore.Controller) the master process runs in place of "
        "the graph's own step loop; running the file itself (`python FILE key=value ...`) sets it")
    model: ModelConfig = Field(ModelConfig(), description="the weights every model role starts from")
    dataset: DatasetConfig = Field(DatasetConfig(), description="the training prompts")
    actor: RoleConfig = Field(RoleConfig(trainable=True), description="the policy role (trainable unless set otherwise)")
    ref: RoleConfig | None = Field(
        None, description="the reference role (ref_logprobs for the KL term); None: no ref (valid when nothing reads "
        "ref_logprobs: ppo.kl_coef=0 and no kl_in_reward). A ref that no MFC needs is not built: the launcher drops "
        "an MFC whose outputs nobody reads (e.g. ref_inf at kl_coef=0), then the roles left with nothing to run")
    roles_: dict[str, RoleConfig] = Field(
        default_factory=dict, alias="roles", description="the other model roles by name (critic, reward, a user's), "
        "each with its head, weights and backend; MFCs name them in `model`. actor and ref are given above")
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
        for name in self.roles_:
            if name == POLICY_ROLE or (name == "ref" and self.ref is not None):
                raise ValueError(f"roles.{name}: the role {name!r} is given twice (as `{name}:` and in `roles:`)")
        try:
            placed = parse_allocation_mode(self.allocation_mode).role_meshes
        except ValueError:
            placed = {}  # the launcher's checks report an unparsable mode
        roles = self.roles()
        for name in placed:
            if name not in roles:
                raise ValueError(f"allocation_mode: unknown role {name!r} (declared roles: {', '.join(roles)})")
        if self.actor.backend is None:
            self.actor.backend = "megatron" if _model_parallel(self.allocation_mode) else "torch"
        for name, r in roles.items():
            if r.backend is None:  # a role on the actor's mesh takes the actor's backend; on its own, its mesh's
                own = "megatron" if _model_parallel(self.allocation_mode, name) else "torch"
                r.backend = own if name in placed else self.actor.backend
        return self

    def roles(self) -> dict[str, RoleConfig]:
        """Model roles declared by this experiment, the actor first."""
        out = {POLICY_ROLE: self.actor}
        if self.ref is not None:
            out["ref"] = self.ref
        out.update({k: v for k, v in self.roles_.items() if k not in out})
        return out

    def policy_role(self) -> str:
        """The role that generates, whose version the run counts and whose weights go to the
        generation servers."""
        return POLICY_ROLE

    def role_model_path(self, role: str) -> str | None:
        """Where `role`'s initial weights are: its model_path, else model.path."""
        return self.roles()[role].model_path or self.model.path


def _models(annotation) -> list[type[BaseModel]]:
    """The config models inside an annotation (`X`, `X | None`, `list[X]`, `dict[str, X]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


REQUIRED = object()  # ConfigKey.default of a key that has none


@dataclass(frozen=True)
class ConfigKey:
    """One key as `--help` and docs/configuration.md show it."""

    key: str  # dotted: `actor.optimizer.lr`; `mfcs.name` for the items of a list, `roles.head` of a dict
    description: str | None
    default: Any  # REQUIRED when it has none
    section: type[BaseModel] | None  # the config model under this key (its keys follow it), or None


def config_entries(model: type[BaseModel] = ExperimentConfig, prefix: str = "",
                   section: BaseModel | None = None) -> list[ConfigKey]:
    """Every key, depth first in field order. A section's keys take their defaults from the
    section's own default (`actor.trainable` is true: the actor's default is
    RoleConfig(trainable=True)), else from its model (`ref.trainable` is false)."""
    out = []
    for name, field in model.model_fields.items():
        if section is not None:
            value = getattr(section, name)
        else:
            value = REQUIRED if field.is_required() else field.get_default(call_default_factory=True)
        subs = _models(field.annotation)
        out.append(ConfigKey(prefix + (field.alias or name), field.description, value, subs[0] if subs else None))
        for sub in subs:
            out += config_entries(sub, out[-1].key + ".", value if isinstance(value, sub) else None)
    return out


def config_keys() -> dict[str, str | None]:
    """Dotted key -> its description (config_entries)."""
    return {e.key: e.description for e in config_entries()}


def config_sections(model: type[BaseModel] = ExperimentConfig) -> list[type[BaseModel]]:
    """Every config model reachable from `model`."""
    seen, todo = [], [model]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.append(m)
            todo += [sub for f in m.model_fields.values() for sub in _models(f.annotation)]
    return seen
