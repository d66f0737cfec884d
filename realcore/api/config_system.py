"""Config sections of the processes and their scheduler: name resolution, Slurm, Ray, and the
system settings (threads, GPUs, addresses, deadlines, wire limits). `realcore.api.config` composes
them into ExperimentConfig.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from realcore.api.config_base import StrictModel


# A CUDA_VISIBLE_DEVICES entry: an index or a GPU UUID; hydra hands `system.gpus=[0,1]` over as ints.
GpuId = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v)]


class NameResolveConfig(StrictModel):
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


class SlurmConfig(StrictModel):
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


class RayConfig(StrictModel):
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


class SystemConfig(StrictModel):
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
