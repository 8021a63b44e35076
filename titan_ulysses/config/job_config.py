"""Dataclasses that mirror the TOML sections; every field can be overridden as ``--section.key value``."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_ulysses.config.profiling import Profiling
from titan_ulysses.config.hf_dataset import HFDataset  # noqa: F401  (re-exported: [training.hf_dataset])


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Where metrics.jsonl, tensorboard logs and checkpoints go."""
    description: str = ""
    """Free text, printed at start."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family of the named flavors; only "llama3" exists (hf_assets_path reads the family from config.json)."""
    flavor: str = "debugmodel"
    """Size: debugmodel, debugmodel_gqa1, 1B, 3B, 8B, 70B. Not used when hf_assets_path is set."""
    hf_assets_path: str = ""
    """A local Hugging Face model folder (config.json, *.safetensors, tokenizer.json), as
    `huggingface-cli download` leaves it. When set, the architecture (any family of models/registry.py
    and every shape) comes from its config.json and model.name / model.flavor are not used.
    A run with no checkpoint of its own starts from its *.safetensors weights unless
    checkpoint.initial_load_in_hf = false (architecture only) or checkpoint.initial_load_path is set.
    A Hub id (org/name, e.g. "Qwen/Qwen3-8B") that is not a folder here is downloaded through
    huggingface_hub into its cache (HF_HOME, HF_HUB_OFFLINE, HF_TOKEN; local rank 0 of each node
    downloads, the others wait) and read from there (docs/hub.md)."""
    hf_revision: str = ""
    """With a Hub id in hf_assets_path: the branch, tag or commit to read ("": the default branch)."""
    attn_backend: str = "sdpa"
    """Local attention inside Ulysses and cp: sdpa, flex or flash_attn (CUDA); what each can do
    (CPU training, documents, windows, softcap, cp) is in titan_ulysses/ops/attention/registry.py."""
    sdpa_backends: str = "auto"
    """With attn_backend sdpa, the order its kernels are tried in: "auto" (causal attention: cuDNN
    first on Hopper GPUs, where it measured 1.8x FlashAttention's speed, PyTorch's order elsewhere;
    with a document mask: the memory-efficient kernel first) or a comma-separated priority order
    of flash, cudnn, efficient, math for both (e.g. "flash" restores PyTorch's order on Hopper);
    kernels left out follow in PyTorch's order."""
    tokenizer: str = ""
    """"byte" (no file, 256 bytes + specials), "tiktoken" (Llama-3 tokenizer.model) or "hf"
    (tokenizer.json through the tokenizers library; BOS/EOS/PAD from tokenizer_config.json / config.json).
    "" (the default): "hf" when the model's Hugging Face folder (model.hf_assets_path, or the start
    checkpoint's hf_assets/) has a tokenizer.json, else "byte". A tokenizer that does not fit the
    model's vocabulary is refused (docs/run_spec.md)."""
    tokenizer_path: str = ""
    """The tiktoken BPE file when tokenizer = "tiktoken"; with "hf", a tokenizer.json or its folder
    (empty: model.hf_assets_path)."""
    rope_theta: float = 0.0
    """RoPE base; 0 keeps the flavor's."""
    rope_scaling_factor: float = 0.0
    """RoPE scaling factor for context extension, by the model's own method (its config.json's
    rope_scaling type, else llama3 for Llama / flavors, yarn for Qwen and Mistral); 0 keeps the model's."""
    rope_scaling_type: str = ""
    """With rope_scaling_factor: the method, "llama3", "yarn" or "linear" ("" : the model's own)."""
    rope_original_max_position_embeddings: int = 0
    """With rope_scaling_factor: the length the model was trained at (0: its existing scaling's,
    else config.json's max_position_embeddings, else the flavor's trained length: 512 for the debug models, 8192
    for the Llama shapes, models/flavors.py TRAINED_SEQ_LEN)."""
    router_aux_loss_coef: float = -1.0
    """Mixtures of experts: weight of the router's load-balancing loss in the training loss. -1: the
    model's config.json (router_aux_loss_coef when output_router_logits is true, else 0, as
    transformers trains it; most released configs say false); 0: off; up to 1 sets it (Qwen3-MoE and
    Mixtral ship 0.001 and 0.02). Logged as aux_loss either way."""
    loss_backend: str = "fused"
    """The output projection + loss (docs/loss.md): fused (gradients in forward, chunk by chunk, dW
    accumulated in fp32 on tensor cores), chunked (logits recomputed in backward), materialized (all
    logits at once), liger or cce (CUDA; pip install 'titan-ulysses[liger]' / '[cce]');
    titan_ulysses/ops/loss/registry.py says what each can do."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the fused and chunked loss backends: an override (0: chosen from the
    vocabulary, the model dim and the token count, so one default serves 4K and 1M tokens)."""
    mlp_tile_size: int = 0
    """Tokens per tile of the tiled MLP with recompute (0: untiled)."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """HSDP replicas (gradients all-reduced across them)."""
    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 takes the ranks the other degrees leave."""
    context_parallel_degree: int = 1
    """Ranks each sequence is also split over by context parallelism (torchtitan's name), outside
    ulysses_degree: attention all-gathers K and V over them, so the head count does not cap it.
    Each rank holds a head and a tail chunk of the sequence (causal load balance); seq_len must
    divide by 2 x context_parallel_degree x ulysses_degree. Every attn_backend."""
    ulysses_degree: int = 1
    """Ranks each sequence is split over (Ulysses sequence parallelism)."""
    tensor_parallel_degree: int = 1
    """Ranks heads and MLP columns are split over."""
    expert_parallel_degree: int = 1
    """Ranks a mixture-of-experts model's experts are split over (torchtitan's name). Borrowed from
    data_parallel_shard_degree x context_parallel_degree x ulysses_degree (innermost ranks first), so
    ulysses_degree 8 with expert_parallel_degree 8 is one node; tokens go to their experts' ranks by
    an all-to-all. Must divide that product and the number of experts."""
    ulysses_head_stages: int = 1
    """Attention in this many stages of head groups, each projected, exchanged and attended in turn,
    so one stage's full-sequence q/k/v/out are alive at a time (1 = off; must divide the q heads
    per Ulysses rank, at most their count where the split is uneven; not with tensor parallelism).
    Meant for activation_checkpoint.mode full or full_offload: under selective AC the layer's cache
    keeps, per stage, what selective AC keeps (projections, exchanges and the stage's [B, S/sp, D]
    share of the output), stages times the one share plain Ulysses keeps."""
    ulysses_stage_keep_attention: bool = True
    """With ulysses_head_stages > 1: each stage keeps its attention kernel's output and logsumexp
    for backward, so backward recomputes only the stage's projections and exchange, not attention
    (about the speed of plain Ulysses; under full AC, one layer's attention output at a time,
    during that layer's backward). false: a stage keeps only its input and backward runs its
    attention forward again: one more attention forward per layer, for the last GiBs at millions
    of tokens."""


@dataclass
class Training:
    dataset: str = "passkey"
    """"passkey" (synthetic long-context retrieval), "text" (pretraining on local .txt/.jsonl/.parquet)
    or "sft" (supervised fine-tuning on .jsonl/.parquet rows of prompt/completion or messages)."""
    dataset_path: str = ""
    """File or folder of the "text" or "sft" dataset, or "hf:NAME" for a `datasets` name or folder
    (its "train" split; the [training.hf_dataset] table for the other options; docs/hub.md)."""
    hf_dataset: HFDataset = field(default_factory=HFDataset)
    """The rows from the `datasets` library (a table of its own: name, config, split, column, streaming)."""
    dataset_cache_dir: str = ""
    """Where the tokenized corpus is cached; "" = a .titan_cache folder beside (or inside) dataset_path."""
    packing: bool = True
    """Pack documents (text) or samples (sft) into seq_len windows with document masking; false: one
    document or sample per window, truncated or padded."""
    shuffle: bool = True
    """Read windows in a seeded random order (the same at every layout; reshuffled every epoch)."""
    min_document_tokens: int = 0
    """Skip documents shorter than this many tokens (long-context selection); 0 keeps all."""
    overlong_samples: str = "error"
    """SFT samples longer than seq_len: "error" (stop, naming how many), "truncate" or "drop"."""
    include_prompt_loss: bool = False
    """SFT: the loss covers prompt (user/system) tokens too, not only completion/assistant tokens."""
    chat_template: str = ""
    """SFT messages: a .jinja file or a tokenizer_config.json with the chat template; "" = the
    tokenizer's, else tokenizer_config.json beside model.tokenizer_path, else ChatML."""
    passkey_digits: int = 5
    """Digits of the "passkey" dataset's key (1 to 9). Copying a multi-digit key needs induction
    heads, which a small model forms only after far more tokens than a CPU run sees; one digit is
    found by a single content-matching head (docs/context_extension.md)."""
    seq_len: int = 2048
    """Tokens per sample; must divide by ulysses_degree (by 2 x context_parallel_degree x ulysses_degree with cp)."""
    local_batch_size: int = 1
    """Samples per microbatch on one data-parallel rank."""
    global_batch_size: int = -1
    """Samples per optimizer step over all ranks; -1 = local_batch_size x dp. Larger: gradient accumulation."""
    steps: int = 100
    """Optimizer steps of the run."""
    seed: int = 42
    """Seed of weights and synthetic data."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True)."""
    max_norm: float = 1.0
    """Gradient clipping norm over all ranks (0 disables clipping)."""
    skip_nonfinite_steps: int = 0
    """A step whose loss or gradient norm is NaN/inf never reaches the weights. Up to this many such
    steps in a row are skipped (weights, optimizer and schedule unchanged, the batch consumed, as
    torchtitan and Megatron do); the next one stops the run. 0 stops at the first."""
    sync_free_step: bool = True
    """That skip is decided on the device (fused AdamW's found_inf); loss and grad norm are read on steps that
    log, save or validate, else one step late: an ordinary step never waits. false: read before each update."""
    gc_freq: int = 50
    """Python garbage collection only between steps, every this many steps; 0: Python's automatic one."""
    allow_over_memory_estimate: bool = False
    """Launch even when the planner's memory estimate of this layout exceeds the device (refused by default,
    before the model is built: docs/memory.md); for a layout you have measured to fit."""
    mixed_precision_param: str = "bfloat16"
    """Dtype parameters are gathered in for compute: bfloat16 or float32."""
    mixed_precision_reduce: str = "float32"
    """Dtype of gradient reduction: float32 or bfloat16."""
    enable_cpu_offload: bool = False
    """FSDP2 CPU offload: sharded parameters, gradients and optimizer state in host memory."""
    prefetch_batches: int = 2
    """Steps of batches a background thread prepares ahead (read, sliced for this rank, pinned on
    CUDA) while the device trains; 0 = read each step's batches when it starts (synchronous)."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Only AdamW (fused on CUDA)."""
    lr: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    """Linear warmup steps."""
    decay_ratio: float = 0.0
    """Fraction of the run spent decaying at its end (warmup-stable-decay); 0: constant after warmup."""
    decay_type: str = "linear"
    """linear, cosine or sqrt."""
    min_lr_factor: float = 0.0
    """LR at the end of decay, as a fraction of the peak."""


@dataclass
class ActivationCheckpoint:
    mode: str = "none"
    """none, full (recompute each block), selective (keep matmul/attention/collective outputs)
    or full_offload (full, with each block's saved input in host memory)."""
    layers_per_checkpoint: int = 1
    """Under mode full / full_offload: blocks are also checkpointed in groups of this many (the last
    group may be shorter), so forward keeps (offloads) only each group's input: 1/k of the block inputs.
    Backward recomputes a group's forward first, holding its k block inputs (and gathered parameters)
    on the device, then each block's own: k - 1 more block forwards per group. 1 = per block."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (fullgraph)."""


@dataclass
class Float8:
    enable: bool = False
    """float8 linear layers through torchao (CUDA, compute capability >= 8.9); the output layer stays high precision."""
    recipe: str = "tensorwise"
    """tensorwise (FSDP all-gathers weights in float8) or rowwise scaling (more accurate)."""
    emulate: bool = False
    """Emulate the float8 matmul in high precision, on any device (tests, CPU demos); no speedup."""
    enable_fsdp_float8_all_gather: bool = True
    """tensorwise only: FSDP all-gathers the weights in float8, with scales precomputed after each step."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save and resume with torch.distributed.checkpoint."""
    folder: str = "checkpoint"
    """Subfolder of job.dump_folder holding step-N checkpoints."""
    interval: int = 500
    """Save every this many steps (and at the last step, and on SIGTERM/SIGUSR1)."""
    async_mode: str = "disabled"
    """disabled, async, or async_with_pinned_mem."""
    keep_latest_k: int = 0
    """Keep only the newest k checkpoints; 0 keeps all."""
    initial_load_path: str = ""
    """A step-N folder to start a new run from (when the run has no checkpoint of its own)."""
    initial_load_model_only: bool = True
    """Load only weights from initial_load_path (context extension); false loads the full state."""
    initial_load_in_hf: bool | None = None
    """Start the run from the safetensors weights of model.hf_assets_path (model only; the run's
    own checkpoints still win when it resumes). Each rank reads only the slices of its shards.
    Unset (the default): true when that folder has *.safetensors and no initial_load_path is set;
    false: the folder gives the architecture only and the weights are a random init."""
    allow_fresh_start: bool = False
    """Start over (from initial_load_path, the Hugging Face weights or a random init) even though
    every checkpoint of this run is damaged (set aside as step-N.bad); without it such a run stops."""
    override_recorded: str = ""
    """On resume: comma-separated settings that change what the model computes (model, RoPE, LoRA, attention,
    precision) whose value in this config wins over the one the checkpoint saved, e.g.
    "model.rope_scaling_factor,lora.alpha" (docs/run_spec.md). Without it such a change is refused; with it
    the change is named on the start-up line, as are changed layout, activation checkpointing and compile
    settings, which a resume applies. (A new run from checkpoint.initial_load_path keeps the recorded
    model and RoPE unless a RoPE setting is given, which is then named.)"""
    allow_data_change: bool = False
    """Resume even though the data settings (dataset, path, tokenizer, seq_len, seed, ...) differ
    from the checkpoint's; the run continues at the same global sample index of the new data."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log every this many steps (and the first and last)."""
    enable_tensorboard: bool = False
    """Also write tensorboard events under dump_folder/tb."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (rank 0; `pip install wandb`). WANDB_MODE=offline needs no
    network (upload later with `wandb sync`); the run files go under dump_folder/wandb, and a
    resume from this folder's checkpoint continues the same W&B run."""
    wandb_project: str = "titan-ulysses"
    """W&B project of the run (no / \\ # ? % : characters, at most 128 long)."""
    wandb_entity: str = ""
    """W&B team or user the project belongs to; "" = your default entity."""
    wandb_run_name: str = ""
    """Display name of the W&B run; "" = the dump folder's name."""
    wandb_tags: str = ""
    """Comma-separated W&B tags, e.g. "long-context,sp8" (each at most 64 characters)."""


@dataclass
class Validation:
    enable: bool = False
    """Compute the loss on held-out data every freq steps, at the training layout."""
    dataset: str = ""
    """"passkey", "text" or "sft"; "" = training.dataset."""
    dataset_path: str = ""
    """File or folder of the held-out "text" / "sft" data (passkey: other seeds, no path)."""
    freq: int = 100
    """Validate every this many steps (and at the last step)."""
    steps: int = 10
    """Global batches per validation (always the same ones)."""


@dataclass
class Comm:
    mode: str = "default"
    """"default" (real process group) or "fake": one process plays rank 0 of a
    fake_world_size job on a fake process group, to measure per-rank memory and compute of a
    production layout on one device. Collectives move no data: losses are meaningless."""
    fake_world_size: int = 8
    """World size simulated when mode = "fake"."""
    link_bandwidth_gbps: float = 450.0
    """GB/s per direction between sp ranks, for the all-to-all time model (H100 NVLink: 450)."""
    init_timeout_seconds: int = 300
    """Collective timeout from start-up to the end of the first step (compilation included), and for
    checkpoint saves and loads: a rank that never arrives ends the job after this long."""
    train_timeout_seconds: int = 100
    """Collective timeout after the first step: a stalled or dead rank ends the job after this long
    instead of gloo's 30-minute (NCCL: 10-minute) default."""


# lora.target_modules: the projections of a block, by Hugging Face name -> our name (models/decoder/model.py)
LORA_TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
                "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def parse_lora_targets(text: str) -> tuple[str, ...]:
    """``lora.target_modules`` (comma-separated, Hugging Face names or ours) -> Hugging Face names in
    block order; ValueError naming the valid ones for an unknown name."""
    ours = {v: k for k, v in LORA_TARGETS.items()}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in LORA_TARGETS and n not in ours]
    if unknown or not names:
        what = f"unknown module {unknown[0]!r}" if unknown else "is empty"
        raise ValueError(f"lora.target_modules: {what}; valid: {', '.join(LORA_TARGETS)} "
                         f"(or ours: {', '.join(ours)})")
    chosen = {ours.get(n, n) for n in names}
    return tuple(n for n in LORA_TARGETS if n in chosen)


@dataclass
class LoRA:
    rank: int = 0
    """Rank of the LoRA adapters; 0 = off (full fine-tuning). With rank > 0 every base weight is
    frozen in the compute dtype (no gradient, no optimizer state) and only the adapters train."""
    alpha: float = 16.0
    """The adapters' update is scaled by alpha / rank (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training (peft's lora_dropout), in [0, 1)."""
    target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated projections given adapters: Hugging Face names (q_proj, k_proj, v_proj,
    o_proj, gate_proj, up_proj, down_proj) or ours (wq, wk, wv, wo, w1, w3, w2). Default: all."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    parallelism: Parallelism = field(default_factory=Parallelism)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    comm: Comm = field(default_factory=Comm)
    lora: LoRA = field(default_factory=LoRA)
    profiling: Profiling = field(default_factory=Profiling)


# Settings with a fixed set of values.
CHOICES = {
    "model.name": ("llama3",),
    "model.attn_backend": ("sdpa", "flex", "flash_attn"),  # ops/attention/registry.py's BACKENDS (config/ is a leaf)
    "model.loss_backend": ("fused", "chunked", "materialized", "liger", "cce"),  # ops/loss/registry.py's BACKENDS
    "model.rope_scaling_type": ("", "llama3", "yarn", "linear"),
    "model.tokenizer": ("", "byte", "tiktoken", "hf"),
    "training.dataset": ("passkey", "text", "sft"),
    "training.overlong_samples": ("error", "truncate", "drop"),
    "validation.dataset": ("", "passkey", "text", "sft"),
    "training.mixed_precision_param": ("bfloat16", "float32"),
    "training.mixed_precision_reduce": ("float32", "bfloat16"),
    "optimizer.name": ("AdamW",),
    "lr_scheduler.decay_type": ("linear", "cosine", "sqrt"),
    "activation_checkpoint.mode": ("none", "full", "selective", "full_offload"),
    "float8.recipe": ("tensorwise", "rowwise"),
    "checkpoint.async_mode": ("disabled", "async", "async_with_pinned_mem"),
    "comm.mode": ("default", "fake"),
}
