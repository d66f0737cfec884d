"""The built-in generation engine: KV-cached, batched decoding of an HF causal LM, on the device
its model is on (a CPU, or the process's GPU).

It is structured for continuous batching (the async generation server will drive it): every
request carries its own state (tokens, log-probs, random generator), and `step()` decodes one token
for every running request, then lets waiting requests join (their prefill yields their first
token). Finished rows leave the batch at once, so a long-tail request does not pay for finished
ones. `generate()` adds all prompts and steps until everything is done.

Interruption (for the HTTP server, realcore.backends.genserver): `abort()` ends requests now
with their partial output (finish_reason "abort"); `retract()` drops the running batch's KV cache
and puts its requests back in the queue: when they are admitted again, their prefill covers
prompt + output so far with whatever weights the model holds then, and decoding continues.

Batching: the KV cache is preallocated (realcore.backends.kv_cache): row i of the running batch
owns slot i, its token at position p sits in column p, and a decode step writes one column per
row in place and attends over the live prefix with a per-row mask; explicit position ids make a
row's output independent of its batch-mates. Prefill runs the new requests left-padded through
an HF `DynamicCache` and copies each row's keys/values into its slot; requests admitted together
with the same tokens (GRPO's group: one prompt n times) share one prefill row, its logits and a
copy of its keys/values.

Precision (`dtype`, given when the engine owns its model: a generation server): "float32", whose
linear layers then multiply through oneDNN rather than torch's default BLAS
(realcore.backends.onednn_linear: the same float32 products up to summation order, ~1.6x the
tokens/s on an AMD CPU), or
"bfloat16" where the device has bf16 instructions
(realcore.backends.precision): the decoder's linear layers then hold and multiply bf16 weights
(~2x faster matmuls and half the memory traffic on an avx512_bf16 CPU), while the residual stream,
norms, attention, KV cache and embeddings stay float32. The output projection multiplies a bf16
copy of its weight, then recomputes each row's 64 largest logits in float32 (`_Bf16Head`): a bf16
logit is off by up to 0.06 at a logit of 16, so only the unlikely tail keeps bf16 values. Why not
the whole model in bf16: on SmolLM2-135M that doubles the log-prob error against the trainer's fp32
recomputation (median 1.4e-2 vs 6e-3 per sampled token) at about the same speed, since the matmuls
are the time.

On a GPU (realcore.backends.genserver.http.run_server loads the model there), "bfloat16" is the whole model in
bf16 (the CPU's mixed mode above is a CPU speed path: oneDNN packing, a float32 residual stream)
and "float32" the model in float32; the KV cache takes the model's dtype, decode attention's
scores and softmax stay float32 (realcore.backends.kv_cache) and log-probs are computed in float32
from the logits.

Host syncs: on a GPU, reading a tensor's value on the host (`.item()`, `.tolist()`, `if t.any()`,
`.nonzero()`, a boolean index) waits for every kernel queued before it, and so does a copy from
pageable host memory to the device. A decode step reads the device once: one copy of its sampled
tokens and log-probs (`_sample`). Everything else the host decides from what it already knows (each
row's length, last token and sampling settings, kept in Python), and the few values a step needs
on the device go up from pinned memory without waiting (`_to_device`). The prefill (once per
admission) may sync a few times (inside HF's attention-mask code). The exception is the CPU's
top-p search (`sync_free=False`, the CPU's default, where the device is the host and nothing waits).

Log-probs: `output_logprobs[i] = log_softmax(logits / temperature)[token]`, over the full
vocabulary, BEFORE top-k / top-p filtering, and with the configured temperature even when greedy.
Why: the trainer recomputes log-probs of the same tokens with the same temperature over the full
vocabulary; the behaviour log-probs must be that same quantity for PPO's importance ratio.
"""

from __future__ import annotations

import collections
import glob
import os
from dataclasses import dataclass, field

import safetensors.torch
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from realcore.api.config import GenerationConfig
from realcore.api.engine import GenerationResult
from realcore.backends.device import to_device
from realcore.backends.kv_cache import ATTENTION, SlotKVCache, register_attention
from realcore.backends.onednn_linear import PackedWeight, use_onednn
from realcore.backends.precision import compute_dtype


@dataclass
class _Request:
    rid: int
    prompt_ids: list[int]
    gconfig: GenerationConfig
    stop_ids: frozenset[int]
    rng: torch.Generator  # per request, so its samples do not depend on who shares its batch
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None
        return GenerationResult(list(self.output_ids), list(self.output_logprobs), self.finish_reason)


class GenerationEngine:
    """Continuous-batching generation over one HF model (see the module docstring)."""

    def __init__(self, model, tokenizer, *, seed: int = 0, dtype: str | None = None):
        """The engine runs on the device of `model`'s parameters (a CPU or a GPU).

        `dtype` (GenerationConfig.dtype, resolved: "float32" or "bfloat16") given: the engine owns
        `model` (a generation server) and changes it in place. On a CPU "bfloat16" converts its
        decoder linears and "float32" runs its float32 linears through oneDNN
        (realcore.backends.onednn_linear); on a GPU the whole model takes `dtype`. None: `model` is
        shared (a trainer's, which generates in sync mode, and routes its linears itself) and left
        as it is, on whatever device and in whatever dtype it is."""
        self.device = next(model.parameters()).device
        self._head: _Bf16Head | None = None
        if dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"generation: dtype {dtype!r} is not float32 or bfloat16")
        config = model.config
        # The slot cache serves plain full-attention layers.
        if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=config).layers):
            raise ValueError("generation: the built-in engine supports full-attention models only (no sliding window)")
        weights = None if dtype is None else compute_dtype(dtype, self.device)  # ValueError where the device lacks bf16
        if weights is not None and self.device.type != "cpu":
            model.to(weights)  # a no-op when loaded in it (gen_server loads it so)
        elif dtype == "bfloat16":
            _linears_to_bf16(model.get_decoder())
            self._head = _Bf16Head.attach(model.get_output_embeddings())
        elif dtype == "float32":
            use_onednn(model)
        self.dtype = model.dtype  # of activations and the KV cache (float32 unless the model is bf16)
        # Whether a decode step reads nothing of the device but its sampled tokens (module
        # docstring): always on an accelerator. On a CPU, top-p's search widens its top-k step by step
        # instead, reading how much mass each width covers (no sync there: the CPU is the host), which
        # is ~4 ms per row faster than the full sort the sync-free search takes.
        self.sync_free = self.device.type != "cpu"
        # An owned model computes under inference mode (no version counters or autograd checks per op:
        # +5-10% tokens/s at batch 32); a shared one under no_grad, so no inference tensor reaches the
        # trainer (its KV cache and any buffer its forward sets stay ordinary tensors).
        self._grad_off = torch.no_grad if dtype is None else torch.inference_mode
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.seed = seed
        self.eos_token_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
        self.pad_token_id = pad if pad is not None else 0  # any id: padded columns are masked out
        self.max_positions = getattr(config, "max_position_embeddings", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        register_attention()
        self._kv = SlotKVCache(text.num_hidden_layers, kv_heads, head_dim, self.dtype, self.device)
        self.next_rid = 0  # request ids seed the samplers: part of the engine's random state
        self._waiting: collections.deque[_Request] = collections.deque()
        # The running batch: row i lives in slot i of the KV cache.
        self._running: list[_Request] = []

    # --- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], gconfig: GenerationConfig) -> int:
        """Queue a prompt; it joins the running batch at the next `step()`. Returns its id."""
        if not prompt_ids:
            raise ValueError("generation: empty prompt")
        if self.max_positions is not None and len(prompt_ids) + gconfig.max_new_tokens > self.max_positions:
            raise ValueError(
                f"generation: prompt of {len(prompt_ids)} tokens + max_new_tokens={gconfig.max_new_tokens} "
                f"exceeds the model's {self.max_positions} positions"
            )
        rid = self.next_rid
        self.next_rid += 1
        eos = {self.eos_token_id} if self.eos_token_id is not None and not gconfig.ignore_eos else set()
        stop = set(gconfig.stop_token_ids) | eos
        # Seed from (engine seed, request id): reproducible, and distinct across a GRPO group.
        rng = torch.Generator(device=self.device).manual_seed((self.seed * 1_000_003 + rid) % 2**63)
        self._waiting.append(_Request(rid, list(prompt_ids), gconfig, frozenset(stop), rng))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def n_running(self) -> int:
        return len(self._running)

    def output_lengths(self) -> dict[int, int]:
        """Request id -> tokens generated so far, for every unfinished request."""
        return {r.rid: len(r.output_ids) for r in (*self._waiting, *self._running)}

    def abort(self, rids: list[int] | None = None) -> list[tuple[int, GenerationResult]]:
        """End the given requests (None = all) now: partial output, finish_reason "abort".
        Unknown or finished ids are ignored. Call between steps."""
        with self._grad_off():  # retiring rows moves KV cache contents
            return self._abort(rids)

    def _abort(self, rids: list[int] | None) -> list[tuple[int, GenerationResult]]:
        hit = lambda r: rids is None or r.rid in rids  # noqa: E731
        done = []
        for r in [r for r in self._waiting if hit(r)]:
            self._waiting.remove(r)
            r.finish_reason = "abort"
            done.append((r.rid, r.result()))
        for r in self._running:
            if hit(r):
                r.finish_reason = "abort"
        return done + self._retire()

    def retract(self) -> int:
        """Drop the running batch's KV cache and queue its requests first; returns how many.

        Why: after a weight update they resume from prompt + output so far, their KV recomputed
        with the new weights (SGLang's `pause_generation(mode="retract")`)."""
        n = len(self._running)
        self._waiting.extendleft(reversed(self._running))
        self._running = []  # their slots are free: readmission prefills them again
        return n

    def generate(self, prompts: list[list[int]], gconfig: GenerationConfig) -> list[GenerationResult]:
        """One continuation per prompt, in prompt order (the caller repeats prompts for groups)."""
        assert not self.has_unfinished(), "generate() needs an idle engine; a server drives step() itself"
        rids = [self.add_request(p, gconfig) for p in prompts]
        done: dict[int, GenerationResult] = {}
        while self.has_unfinished():
            done.update(self.step())
        return [done[r] for r in rids]

    def step(self) -> list[tuple[int, GenerationResult]]:
        """Decode one token for every running request, admit waiting ones; return those finished."""
        finished = []
        with self._grad_off():
            if self._running:
                self._decode()
                finished += self._retire()
            self._admit()
            finished += self._retire()
        return finished

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor], *, partial: bool = False) -> None:
        """Copy `tensors` (name -> tensor, HF names) into the live model; call between steps.

        Every parameter must be given (tied duplicates such as lm_head.weight may be), unless
        `partial` (one bucket of a bucketed update, as SGLang applies them); all checks
        run before the first copy, so a bad update changes nothing. Running requests keep their
        KV cache (computed with the old weights); retract() them first to recompute it."""
        state = self.model.state_dict()  # shares storage with the parameters; tied weights under both names
        unknown = sorted(set(tensors) - set(state))
        missing = [] if partial else sorted(n for n, _ in self.model.named_parameters() if n not in tensors)
        wrong = [n for n, t in tensors.items() if n in state and tuple(t.shape) != tuple(state[n].shape)]
        for what, names in (("unknown", unknown), ("missing", missing), ("wrongly shaped", wrong)):
            if names:
                raise ValueError(f"weights: {len(names)} {what} parameter(s), e.g. {names[:3]}")
        for name, t in tensors.items():
            state[name].copy_(t)  # casts: bf16 linears take float32 updates

    # --- batch mechanics --------------------------------------------------------------------------

    def _decode(self) -> None:
        reqs = self._running
        n = [r.n_tokens() for r in reqs]  # the last token of each row is fed now
        width = max(n)
        self._kv.reserve(len(reqs), width, live=(len(reqs), width - 1))
        # The host knows each row's last token and its position (its column in the row's slot).
        fed = _to_device([[r.output_ids[-1] for r in reqs], [k - 1 for k in n]], self.device, torch.long)  # (2, B)
        tokens, pos = fed[0, :, None], fed[1]  # (B, 1), (B,)
        self._kv.begin_decode(pos, width)
        config = self.model.config
        before, config._attn_implementation = config._attn_implementation, ATTENTION  # for this call only
        try:
            logits = self.model(
                input_ids=tokens,
                attention_mask=self._attention_mask(pos, width),
                position_ids=pos[:, None],
                past_key_values=self._kv,
                use_cache=True,
            ).logits  # (B, 1, V)
        finally:
            config._attn_implementation = before
        self._sample(reqs, logits[:, -1])

    def _attention_mask(self, pos: torch.Tensor, width: int) -> torch.Tensor:
        """(B, 1, 1, width) additive mask: row i attends to columns 0..pos[i] of its slot.
        Additive (0 / dtype min), not bool: right for both the sdpa and the eager attention."""
        cols = torch.arange(width, device=self.device)
        blocked = cols[None, :] > pos[:, None]  # (B, width)
        mask = torch.zeros(blocked.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(blocked, torch.finfo(self.dtype).min)[:, None, None, :]

    def _admit(self) -> None:
        """Prefill waiting requests while the batch has room; they join the running batch's slots."""
        new: list[_Request] = []
        while self._waiting and len(self._running) + len(new) < self._waiting[0].gconfig.max_batch_size:
            new.append(self._waiting.popleft())
        if not new:
            return
        # A retracted request has output already: its prefill covers it and samples the next token.
        seqs = [r.prompt_ids + r.output_ids for r in new]
        # GRPO's group is one prompt n times: each distinct sequence is prefilled once, and the
        # requests that share it take its logits (each samples with its own generator) and a copy
        # of its keys/values.
        first: dict[tuple[int, ...], int] = {}
        rows = [first.setdefault(tuple(s), len(first)) for s in seqs]  # request i -> its prefill row
        distinct = [list(s) for s in first]
        length = max(len(s) for s in distinct)
        ids = [[self.pad_token_id] * (length - len(seq)) + seq for seq in distinct]  # (U, L) left-padded
        mask = [[0] * (length - len(seq)) + [1] * len(seq) for seq in distinct]
        ids, mask = _to_device([ids, mask], self.device, torch.long)  # one copy up
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # real-token positions; pads get 0
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # only the last position is sampled; saves (U, L, V) logits
        )
        logits = out.logits[:, -1]  # (U, V)
        rows_t = _to_device(rows, self.device, torch.long) if len(distinct) < len(new) else None
        self._sample(new, logits if rows_t is None else logits[rows_t], rows_t)
        B = len(self._running)
        width = max([r.n_tokens() - 1 for r in self._running] + [length])
        self._kv.reserve(B + len(new), width, live=(B, width))
        self._kv.write_prefill(B, cache.layers, [len(s) for s in seqs], rows)
        self._running = self._running + new

    def _retire(self) -> list[tuple[int, GenerationResult]]:
        """Drop finished rows: the last running rows move into their slots, so slots 0..B-1 stay the batch."""
        done = [(r.rid, r.result()) for r in self._running if r.finish_reason is not None]
        if not done:
            return []
        running = self._running
        n = len(running) - len(done)
        holes = [i for i in range(n) if running[i].finish_reason is not None]
        movers = [i for i in range(n, len(running)) if running[i].finish_reason is None]
        for hole, mover in zip(holes, movers):
            self._kv.move(mover, hole, running[mover].n_tokens() - 1)  # its cached columns
            running[hole] = running[mover]
        self._running = running[:n]
        if not self._running and not self._waiting:
            self._kv.release()  # idle: give the memory back
        return done

    def _sample(self, reqs: list[_Request], logits: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Pick one token per row (logits: (B, V)), record it and its log-prob, mark finished rows.
        `rows`: each request's row of the forward that made the logits, where requests share rows
        (a prefill of distinct sequences); None: row i is request i."""
        tokens, logprobs = sample_tokens(
            logits,
            temperature=[r.gconfig.temperature for r in reqs],
            top_k=[r.gconfig.top_k for r in reqs],
            top_p=[r.gconfig.top_p for r in reqs],
            greedy=[r.gconfig.greedy for r in reqs],
            rngs=[r.rng for r in reqs],
            sync_free=self.sync_free,
        )
        if self._head is not None:  # a token from the bf16 tail: its log-prob from its float32 logit
            batch = torch.arange(len(reqs), device=logits.device)
            temps = _to_device([r.gconfig.temperature for r in reqs], logits.device, torch.float32)
            logprobs = logprobs + (self._head.exact(tokens, rows) - logits[batch, tokens].float()) / temps
        # The step's one read of the device: tokens and log-probs in one copy (float64 holds both exactly).
        ids, lps = torch.stack((tokens.double(), logprobs.double())).tolist()
        for r, tok, lp in zip(reqs, map(int, ids), lps):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            if tok in r.stop_ids:
                r.finish_reason = "stop"
            elif len(r.output_ids) >= r.gconfig.max_new_tokens:
                r.finish_reason = "length"


class _Bf16Linear(torch.nn.Module):
    """A linear layer whose weight is stored and multiplied in bf16; input, bias and output stay
    float32 (the residual stream is not rounded). Parameter names are the Linear's, so weight
    updates by name still land (copy_ casts). The multiply takes a oneDNN-packed copy of the
    weight (`PackedWeight`, rebuilt after an update): the bf16 decoder holds its linears twice,
    as much memory as their float32 weights."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.mm = PackedWeight(self, torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mm(x.to(torch.bfloat16)).to(x.dtype)
        return y if self.bias is None else y + self.bias


class _Bf16Head:
    """The output projection in bf16 where it matters for speed, float32 where it matters for the
    log-probs. The vocabulary matmul (the largest one per decode step: 28M weights on SmolLM2) runs
    on a bf16 copy of the weight, ~2.4x faster here; its bf16-rounded logits are only a first pass:
    the TOP_K largest per row are recomputed exactly from the float32 weight and hidden state, so
    greedy choices, the softmax's normaliser (dominated by the top logits) and the log-prob of any
    top-K token are float32's; the engine corrects a token sampled from the tail with its float32
    logit (`exact`; the normaliser's tail stays bf16, a tail's small share). The module keeps its
    float32 weight and parameter names (weight updates and tied embeddings land there as before);
    the bf16 copy (oneDNN-packed: `PackedWeight`) is rebuilt whenever that weight changed."""

    TOP_K = 64

    def __init__(self, linear: torch.nn.Linear):
        self.linear, self.mm = linear, PackedWeight(linear, torch.bfloat16)

    @classmethod
    def attach(cls, linear: torch.nn.Module) -> _Bf16Head | None:
        if type(linear) is not torch.nn.Linear:
            return None  # an unusual head: left in float32
        head = cls(linear)
        linear.forward = head  # an instance attribute: the module and its state_dict stay as they were
        return head

    def exact(self, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits of `tokens` (B,) at the last position of the last call's rows (B, T, H),
        or of its rows `rows` (B,) where tokens share rows."""
        w, b = self.linear.weight, self.linear.bias
        x = self.last_x[:, -1] if rows is None else self.last_x[rows, -1]
        out = (w[tokens] * x.float()).sum(-1)
        return out if b is None else out + b[tokens]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.linear.weight, self.linear.bias
        self.last_x = x
        rough = self.mm(x.to(torch.bfloat16))  # (..., V) bf16
        k = min(self.TOP_K, rough.shape[-1])
        idx = rough.topk(k, dim=-1).indices  # (..., k); on bf16: ~20% less than on its float32 copy
        logits = rough.float()
        # embedding() gathers the rows ~4x faster than w[idx] here
        exact = (F.embedding(idx, w) * x.float().unsqueeze(-2)).sum(-1)  # (..., k, H) . (..., 1, H)
        if b is not None:
            logits = logits + b
            exact = exact + b[idx]
        return logits.scatter_(-1, idx, exact)


def _linears_to_bf16(module: torch.nn.Module) -> None:
    """Every nn.Linear under `module` (the decoder: not the output projection) -> _Bf16Linear."""
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear:
            setattr(module, name, _Bf16Linear(child))
        else:
            _linears_to_bf16(child)


def read_hf_weights(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files of an HF directory (sharded or not)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []
    if not files:
        raise ValueError(f"weights: {path!r} is not a directory holding *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(safetensors.torch.load_file(f))
    return out


def _to_device(values, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Host values (nested lists) as a tensor on `device`, without waiting for the device
    (realcore.backends.device.to_device: from pinned memory on a GPU)."""
    return to_device(torch.tensor(values, dtype=dtype, device="cpu"), device)


def _take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Rows `rows` of `t` (None: all of them, no copy)."""
    return t if rows is None else t.index_select(0, rows)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    greedy: list[bool],
    rngs: list[torch.Generator],
    sync_free: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with per-row settings. logits: (B, V) -> tokens (B,), logprobs (B,),
    on the logits' device.

    The log-prob is of the temperature-scaled, unfiltered distribution (module docstring). Each
    row draws one uniform from its own generator (on the logits' device) and samples by inverse CDF.

    Nothing here reads the device on the host (module docstring: host syncs): which rows are greedy,
    plain or filtered is known from the settings, so their rows go up as index lists. `sync_free`
    (None: unless the logits are on a CPU) False lets top-p widen its search by reading the device.

    Every full-vocabulary pass costs ~1-4 ms per step at batch 32 and 49k tokens on a CPU (a
    fresh (B, V) tensor each): rows without top-k / top-p sample from exp(log_softmax), computed
    once for the log-probs, and the greedy choice is taken only for greedy rows.
    """
    dev = logits.device
    sync_free = dev.type != "cpu" if sync_free is None else sync_free
    scaled = logits.float()  # (B, V)
    if any(t != 1.0 for t in temperature):  # x / 1.0 == x: skip a (B, V) division in the common case
        scaled = scaled / _to_device(temperature, dev, torch.float32)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    u = torch.cat([torch.rand(1, generator=g, device=dev) for g in rngs])  # (B,) drawn even for greedy rows
    plain = [not g and k == 0 and p >= 1.0 for g, k, p in zip(greedy, top_k, top_p)]
    filtered = [not g and not pl for g, pl in zip(greedy, plain)]
    tokens = None
    for mask, pick in ((greedy, lambda rows, idx: _take(scaled, rows).argmax(dim=-1)),
                       (plain, lambda rows, idx: _inverse_cdf(_take(logprobs, rows).exp(), _take(u, rows))),
                       (filtered, lambda rows, idx: _sample_top_k_top_p(
                           torch.softmax(_take(scaled, rows), dim=-1), _take(u, rows), [top_k[i] for i in idx],
                           [top_p[i] for i in idx], sync_free=sync_free))):
        if all(mask):
            tokens = pick(None, range(len(mask)))  # every row: no (B, V) index copy
        elif any(mask):
            idx = [i for i, m in enumerate(mask) if m]
            rows = _to_device(idx, dev, torch.long)
            if tokens is None:
                tokens = torch.zeros(len(mask), dtype=torch.long, device=dev)
            tokens.index_copy_(0, rows, pick(rows, idx))
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


_CDF_CHUNK = 1024  # inverse CDF in two levels: sums of chunks of this many tokens, then one chunk


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i of each row with cdf[i-1] <= u * total < cdf[i] (never a zero-probability token).
    probs: (B, n) unnormalised, u: (B,) in [0, 1).

    A cumulative sum over a 49k vocabulary is a sequential (B, V) pass (~1.5 ms at batch 32): the
    chunk holding u is found from the chunks' sums first, and only that chunk is summed up.

    Rounding can put u * total at or past a sum's end (the chunks' sums and one chunk's own
    cumulative sum round differently): a search past the end is held at the last token (or chunk)
    with mass, found by the same search for the total, so no row needs a second pass (whose
    condition the host would have to read)."""
    B, n = probs.shape
    if n <= 2 * _CDF_CHUNK:
        return _one_level(probs, u)
    chunks = F.pad(probs, (0, -n % _CDF_CHUNK)).view(B, -1, _CDF_CHUNK)  # (B, C, chunk)
    before = chunks.sum(dim=-1).cumsum(dim=-1)  # (B, C) mass up to the end of each chunk
    target = u[:, None] * before[:, -1:]  # (B, 1)
    c = torch.minimum(torch.searchsorted(before, target, right=True), _last_with_mass(before))  # (B, 1)
    # A chunk's tokens before u: mass below target minus what the earlier chunks hold.
    rest = target - torch.where(c > 0, before.gather(1, (c - 1).clamp(min=0)), 0.0)  # (B, 1)
    inner = chunks.gather(1, c[:, :, None].expand(B, 1, _CDF_CHUNK))[:, 0].cumsum(dim=-1)  # (B, chunk)
    i = torch.minimum(torch.searchsorted(inner, rest, right=True), _last_with_mass(inner))  # (B, 1)
    return (c * _CDF_CHUNK + i).squeeze(1)


def _one_level(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)  # (B, n)
    idx = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)  # (B, 1)
    return torch.minimum(idx, _last_with_mass(cdf)).squeeze(1)


def _last_with_mass(cdf: torch.Tensor) -> torch.Tensor:
    """(B, 1) the last index of each row's cumulative sum (B, n) where it grows: its last term > 0.
    The first index that reaches the row's total: sums of terms >= 0 never fall."""
    return torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)


def _sample_top_k_top_p(probs: torch.Tensor, u: torch.Tensor, ks: list[int], ps: list[float], *,
                        sync_free: bool) -> torch.Tensor:
    """Top-k (0 = off), then top-p on the renormalised top-k distribution (the whole distribution
    without top-k), as transformers' warpers apply them. probs: (B, V); ks, ps: per row.

    Only the top of each row is sorted (`topk`): the top-k, or, where a row has top-p without top-k,
    as many tokens as its nucleus needs. sync_free: every token (a full sort; fast on a GPU, and
    top-p below 1 is rare in RL, where it biases the behaviour log-probs). Otherwise a widening
    loop, reading on the host whether the first k tokens hold `top_p` of the mass (then the nucleus
    lies inside them): sorting a 49k vocabulary costs ~4 ms per row on a CPU (more than a decode
    step of a 135M model), and the nucleus is usually a few dozen tokens.
    """
    V = probs.shape[1]
    # Rows with top-k are covered once k reaches theirs; rows with top-p alone by their mass.
    k = min(V, max(ks))
    open_ended = [kk == 0 and p < 1.0 for kk, p in zip(ks, ps)]
    if any(open_ended):
        k = V if sync_free else max(k, min(V, 64))
    ks_t = _to_device(ks, probs.device, torch.long)
    ps_t = _to_device(ps, probs.device, torch.float32)
    while True:
        vals, order = probs.topk(k, dim=-1)  # (B, k), sorted descending
        if k == V or not any(open_ended) or bool(((ks_t > 0) | (vals.sum(dim=-1) >= ps_t)).all()):
            break
        k = min(V, k * 8)
    ranks = torch.arange(k, device=probs.device)[None, :]
    keep = (ks_t[:, None] == 0) | (ranks < ks_t[:, None])  # top-k, in rank space
    vals = vals * keep
    # The top-k's mass, or the whole row's (a softmax: 1) without top-k.
    vals = vals / torch.where(ks_t > 0, vals.sum(dim=-1), 1.0)[:, None]
    keep &= (vals.cumsum(dim=-1) - vals) < ps_t[:, None]  # mass ranked above < top_p: the first always stays
    return order.gather(1, _inverse_cdf(vals * keep, u)[:, None]).squeeze(1)
