"""Typed experiment configuration (pydantic v2). Unknown keys are rejected everywhere.

Hydra composes YAML from `experiments/` in `realcore/launch`; everything else receives these objects.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(_Strict):
    """Shape of the random tiny model built in code (tests only)."""

    family: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    vocab_size: int = Field(512, ge=64, description="target vocab of the tokenizer trained in code")


class ModelConfig(_Strict):
    """Which weights every model role starts from."""

    name: str = Field("tiny", description="'tiny', 'smollm2-135m', or a label for `path`")
    path: str | None = Field(None, description="any HF model directory; overrides `name`")
    tiny: TinyModelConfig = TinyModelConfig()
    use_chat_template: bool = Field(False, description="wrap prompts with the tokenizer's chat template")
    cache_dir: str = Field("~/.cache/realcore", description="where converted models are cached")


class OptimizerConfig(_Strict):
    """AdamW with linear warm-up then cosine (or constant) decay."""

    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_scheduler: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float = Field(1.0, gt=0)


class MegatronConfig(_Strict):
    """Megatron-core options of a role (backend=megatron); parallel sizes come from allocation_mode."""

    sequence_parallel: bool | None = Field(None, description="None: on when TP > 1 (Megatron-LM's advice)")
    distributed_optimizer: bool = Field(True, description="shard optimizer state over data-parallel ranks")
    virtual_pipeline_stages: int | None = Field(None, gt=1, description="model chunks per PP rank (interleaved 1F1B)")
    batch_p2p_comm: bool = Field(True, description="batch PP send/recv (must be False with virtual stages at PP=2)")
    overlap_p2p_comm: bool = Field(False, description="overlap PP send/recv with compute (virtual stages only)")
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"


class RoleConfig(_Strict):
    """A model role (actor, ref): its backend and, if trainable, its optimizer."""

    backend: Literal["torch", "megatron"] | None = Field(
        None, description="torch | megatron; None: torch for the actor, the actor's backend for other roles")
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

    @model_validator(mode="after")
    def _check(self) -> "RoleConfig":
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
    seed: int = 1
    format: Literal["rl", "sft"] = Field("rl", description="rl: prompt_ids + answer; sft: input_ids + loss_mask")
    prompt_template: str = Field("Question: {question}\nAnswer:", description="`{question}` is replaced")
    system_prompt: str | None = Field(None, description="with a chat template: replaces its default system message")
    max_prompt_len: int = Field(256, gt=0, description="longer prompts are skipped and counted")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to a user-registered dataset")


class GenerationConfig(_Strict):
    """Sampling for the `generate` MFC."""

    n_samples: int = Field(4, gt=0, description="sequences per prompt (the GRPO group)")
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    greedy: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, description="in addition to the EOS token")
    ignore_eos: bool = Field(False, description="keep generating past EOS (benchmarks, tests)")
    max_batch_size: int = Field(64, gt=0, description="prompts decoded together")


class PPOConfig(_Strict):
    """Clipped PPO / GRPO hyperparameters (names follow the papers)."""

    eps_clip: float = Field(0.2, gt=0)
    c_clip: float | None = Field(None, gt=1, description="dual-clip constant (Ye et al. 2020); None disables")
    kl_coef: float = Field(0.0, ge=0, description="weight of KL(actor || ref) in the loss")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    adv_norm: Literal["group", "batch", "none"] = "group"
    adv_eps: float = Field(1e-6, gt=0)
    ppo_n_minibatches: int = Field(1, gt=0)
    use_decoupled_loss: bool = Field(False, description="decoupled PPO: ratio against prox_logprobs, behaviour weight")
    behav_imp_weight_cap: float | None = Field(None, gt=1, description="mask tokens whose behaviour weight exceeds it")
    ppo_epochs: int = Field(1, gt=0)


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
    max_concurrent_rollouts: int = Field(16, gt=0, description="rollouts in flight across all rollout workers")
    routing: Literal["round_robin", "least_requests"] = "least_requests"
    weight_update: Literal["disk", "memory"] = Field("disk", description="disk: HF safetensors; memory: tensors over the wire (built-in servers)")
    filter_equal_reward_groups: bool = Field(False, description="dynamic filtering: drop groups whose rewards are all equal")
    request_timeout_s: float = Field(600.0, gt=0, description="deadline for one generation request")
    request_retries: int = Field(3, ge=0, description="a request whose server fails or goes silent runs again on another server, this many times")
    episode_retries: int = Field(2, ge=0, description="a failing agent episode is retried this many times, then its group is dropped and counted")
    server_token: str | None = Field(None, description="bearer token; required when a server binds a non-loopback address")
    server_python: str | None = Field(
        None, description="the interpreter that runs SGLang/vLLM servers (e.g. /opt/sglang-venv/bin/python), so the "
        "engine can live in its own environment; None: realcore's own (sys.executable)")


class EvalConfig(_Strict):
    """Evaluation on held-out prompts: during training every `freq_steps` steps (on the generation
    servers, or on the actor in sync mode without them) and with `python -m realcore.eval`. Each
    prompt runs the rollout workflow once greedily (eval/accuracy: reward > 0; eval/reward: mean
    reward) and `n_samples` times sampled (eval/pass@k, k = n_samples: any of them has reward > 0)."""

    freq_steps: int | None = Field(None, gt=0, description="evaluate after every N training steps and after the last; None: never")
    dataset: DatasetConfig | None = Field(
        None, description="held-out prompts; None: the training dataset's type with seed + 1 (a new draw of a generated "
        "dataset; give a held-out file for jsonl datasets)")
    n_prompts: int = Field(32, gt=0, description="prompts evaluated (the first n of the dataset)")
    n_samples: int = Field(4, gt=0, description="sampled episodes per prompt, for eval/pass@k")
    max_new_tokens: int | None = Field(None, gt=0, description="None: generation.max_new_tokens")
    temperature: float | None = Field(None, gt=0, description="of the sampled episodes; None: generation.temperature")


class TrainerConfig(_Strict):
    total_steps: int = Field(10, gt=0)
    batch_size: int = Field(8, gt=0, description="prompts per step")
    save_freq_steps: int | None = Field(None, gt=0, description="HF checkpoints (checkpoints/step_N); None: at the last step only")
    recover_freq_steps: int | None = Field(
        None, gt=0, description="recover checkpoints (recover/step_N: everything to continue exactly) every N steps; "
        "also at preemption, and at the last step when recover_mode is not disabled")


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


class NameResolveConfig(_Strict):
    """Where workers publish and find each other's addresses."""

    type: Literal["fs", "redis", "etcd"] = Field("fs", description="fs: a (shared) directory; redis or etcd: a server")
    root: str = Field("/tmp/realcore/name_resolve", description="fs: the directory (shared by all nodes)")
    address: str | None = Field(None, description="redis/etcd host:port; None: 127.0.0.1:6379 (redis), 127.0.0.1:2379 (etcd)")
    namespace: str = Field("realcore", description="redis/etcd: prefix of every key on a shared server")
    timeout_s: float = Field(5.0, gt=0, description="redis/etcd: connect and request deadline")


class SlurmConfig(_Strict):
    """scheduler=slurm: one sbatch allocation, one job step per worker type (realcore/launch/slurm.py)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str | None = Field(None, description="sbatch --time, e.g. 2-00:00:00")
    nodes: int | None = Field(None, gt=0, description="sbatch --nodes; None lets Slurm choose")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node; model workers and generation servers get one each")
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
    gpus_per_worker: int = Field(0, ge=0, description="GPUs of each model worker and generation server")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    python: str | None = Field(None, description="interpreter on the nodes; None: the launcher's own")


class SystemConfig(_Strict):
    """Process, wire and deadline settings."""

    threads_per_process: int = Field(1, gt=0, description="torch/OMP threads per process on CPU")
    host: str = Field("127.0.0.1", description="address workers bind and publish; 'auto': this node's address")
    interface: str | None = Field(None, description="bind on this network interface's IPv4 address (e.g. ib0); overrides host")
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="a worker silent this long is lost (hung): its stacks are dumped, then it is killed")
    startup_timeout_s: float = Field(300.0, gt=0, description="deadline for workers to register and configure")
    request_timeout_s: float = Field(1800.0, gt=0, description="deadline for one MFC call")
    shutdown_timeout_s: float = Field(10.0, gt=0, description="grace before SIGKILL at exit")
    preempt_timeout_s: float = Field(
        120.0, gt=0, description="SIGTERM to the launcher: the step in progress finishes and a recover checkpoint is "
        "written within this, then the run exits 75; past it, everything is killed")
    name_resolve: NameResolveConfig = NameResolveConfig()
    max_http_body_bytes: int = Field(
        16 * 2**20, ge=2**16, description="largest request body the built-in generation server reads (413 above "
        "it). The largest legitimate body is a /generate batch: max_batch_size prompts of up to the model's context "
        "as JSON token ids, at most 8 bytes each ('151643, '): the default fits 64 prompts of 30k tokens")
    # ZeroMQ wire limits and replay protection (realcore/system/wire.py, docs/wire.md).
    max_message_bytes: int = Field(
        2**31, gt=0, description="largest frame a tensor-carrying ZeroMQ socket accepts (ZMQ_MAXMSGSIZE; one frame "
        "is one tensor, the largest being one weight tensor of an in-memory weight update); a sender fails naming "
        "this key when a tensor is larger, a receiver drops the connection of a peer that sends one")
    max_control_message_bytes: int = Field(
        64 * 2**20, gt=0, description="largest control message (and message header) a socket accepts: control "
        "sockets carry msgpack metadata only (capped at max_message_bytes)")
    clock_skew_s: float = Field(
        30.0, ge=0, description="a receiver rejects messages stamped earlier than its own start minus this (replays "
        "captured before it restarted); also the clock difference between hosts that is tolerated")
    drop_log_interval_s: float = Field(
        60.0, gt=0, description="a dropped message is logged the first time its (socket, reason) occurs, then in at "
        "most one summary line per this many seconds; every drop is counted in metrics.jsonl (dropped/*)")


class ExperimentConfig(_Strict):
    experiment_name: str
    trial_name: str = "trial0"
    output_dir: str
    seed: int = 1
    mode: Literal["sync", "async"] = "sync"
    recover_mode: Literal["disabled", "resume", "auto"] = Field(
        "disabled", description="disabled: a failure ends the run; resume: a launch with the same output_dir continues from "
        "its last recover checkpoint; auto: resume, and after a failure the launcher restarts the run (up to recover_retries)")
    recover_retries: int = Field(3, ge=0, description="recover_mode=auto: whole-run restarts before giving up (exit 1)")
    recover_delay_s: float = Field(5.0, ge=0, description="recover_mode=auto: wait before restarting after a failure")
    scheduler: Literal["local", "slurm", "ray"] = "local"
    allocation_mode: str = Field("d2p1t1", description="AReaL form, e.g. d2p1t1")
    imports: list[str] = Field(default_factory=list, description="user modules loaded before the graph is built")
    model: ModelConfig = ModelConfig()
    dataset: DatasetConfig = DatasetConfig()
    actor: RoleConfig = RoleConfig(trainable=True)
    ref: RoleConfig | None = None
    generation: GenerationConfig = GenerationConfig()
    ppo: PPOConfig = PPOConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    mfcs: list[MFCConfig] = Field(default_factory=list)
    system: SystemConfig = SystemConfig()
    slurm: SlurmConfig = SlurmConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _check(self) -> "ExperimentConfig":
        if not self.mfcs:
            raise ValueError("mfcs: an experiment declares at least one MFC")
        if self.actor.backend is None:
            self.actor.backend = "torch"
        if self.ref is not None and self.ref.backend is None:  # roles share one mesh: same backend by default
            self.ref.backend = self.actor.backend
        return self

    def roles(self) -> dict[str, RoleConfig]:
        """Model roles declared by this experiment."""
        out = {"actor": self.actor}
        if self.ref is not None:
            out["ref"] = self.ref
        return out
