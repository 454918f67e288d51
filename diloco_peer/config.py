"""Configuration as data.

`RunSpec` describes one training run and `SwarmSettings` how its rounds run; both are shared by
every peer of a swarm (they become the signed run manifest), and `default_run` is the built-in
pair; `SimSpec` adds what only the simulator needs (this machine's own settings, `PeerSpec`, are
in peer_spec.py). Every field is validated in `__post_init__`, which raises `ConfigError` with a
readable message. Choices are `Literal` types, and each tuple of names is derived from its
Literal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from diloco_peer.config_checks import (
    checked_fields,
    choice,
    finite,
    fragments_fit,
    is_finite,
    non_negative,
    positive,
    share,
)
from diloco_peer.errors import ConfigError

ModelPreset = Literal["nano", "tiny", "20m", "60m", "150m", "400m"]
OuterOptimizerName = Literal["sgd", "sgdm", "nesterov", "adam", "delayed-nesterov"]
SimAlgo = Literal[
    "single",
    "ddp",
    "sync",
    "async",
    "async-poly",
    "async-polythres",
    "async-buffer",
    "dn",
    "dn-dylu",
]
Heterogeneity = Literal["none", "slight", "moderate", "very"]
AggregationName = Literal["mean", "trimmed-mean", "centered-clip"]
"""How part reducers combine contributions (averaging/robust.py; the manifest's swarm.aggregation)."""
CompressionName = Literal["none", "fp16", "int8", "int4"]
"""Pseudo-gradient encodings on the wire (averaging/compression.py)."""
ComputeSchedule = Literal["constant", "doubling", "halving", "ramp-up", "ramp-down"]
OverlapRule = Literal["none", "eager", "local", "proxy"]
"""Overlapped rounds (ALGORITHMS §1.1): off, or where the next phase starts before the fold."""
FoldRule = Literal["rebase", "mix", "pull"]
"""Overlap's fold of θ_global (ALGORITHMS §1.1): rebase, mix (Streaming DiLoCo's merge), or pull
(mix's parameters, but the δ is the phase's own progress)."""
OverlapFrom = Literal["phase", "group"]
"""When an overlapped phase starts (ALGORITHMS §1.1): at the end of the worker's own phase, or
once its group is complete and the all-reduce starts (only the all-reduce is overlapped)."""
OverlapTerm = Literal["own", "shared"]
"""What a simulated `mix` δ carries besides progress (ALGORITHMS §1.1): what the merge left in
it (`own`), or the term its group shares, added when it is applied (`shared`, the swarm's)."""
ShardMode = Literal["iid", "non-iid"]
Protocol = Literal["sync", "async"]
Weighting = Literal["uniform", "samples"]

# The choices as tuples, for messages, loops and CLI checks: one definition each, the Literal.
MODEL_PRESETS: tuple[ModelPreset, ...] = get_args(ModelPreset)
OUTER_OPTIMIZERS: tuple[OuterOptimizerName, ...] = get_args(OuterOptimizerName)
SIM_ALGOS: tuple[SimAlgo, ...] = get_args(SimAlgo)
HETEROGENEITY: tuple[Heterogeneity, ...] = get_args(Heterogeneity)
AGGREGATIONS: tuple[AggregationName, ...] = get_args(AggregationName)
COMPRESSIONS: tuple[CompressionName, ...] = get_args(CompressionName)
COMPUTE_SCHEDULES: tuple[ComputeSchedule, ...] = get_args(ComputeSchedule)
OVERLAP_RULES: tuple[OverlapRule, ...] = get_args(OverlapRule)
PROTOCOLS: tuple[Protocol, ...] = get_args(Protocol)

DEFAULT_SHARDS = 8
"""Data shards of the built-in run (and of a swarm run whose num_shards is 0)."""
GRACE_SHARE = 0.5
"""The asynchronous preset's grace period as a share of a phase, in the simulator and the
swarm alike (ALGORITHMS §2.4; docs/results.md, the async grid's notes: in the simulator any
share that spans DyLU's spread of phase ends groups them, 0.1 as well as 0.5; a real swarm
needs the longer window, spent training, to merge groups that drifted apart)."""
MAX_SAFETENSORS_HEADER_BYTES = 1 << 20
"""The largest safetensors JSON header read from outside (a peer's state or update record, a
checkpoint file): ours take ~100 bytes a tensor plus a little metadata, tens of kB for the
largest preset's peer checkpoint, while the safetensors library accepts 100 MB, and 14 MB of
hostile header JSON made 175 MB of Python objects. Checked before any header is parsed."""


@dataclass(kw_only=True, frozen=True)
class RunSpec:
    """One training run: model, data, inner and outer optimization. Identical on every peer."""

    model: ModelPreset = "tiny"
    """Model preset, one of MODEL_PRESETS."""
    data: str = "builtin:python-stdlib"
    """Data source: `builtin:python-stdlib`, a local file or folder (txt/json/jsonl/parquet), or a
    `datasets` hub name (optionally `hf:NAME[:CONFIG]`)."""
    tokenizer: str = "bytes"
    """`bytes` (vocab 256), a path to a `tokenizers` JSON file, or `bpe:VOCAB` trained on the data."""
    max_tokens: int = 4_000_000
    """Cap on corpus tokens read (keeps CPU runs fast); 0 means no cap."""
    seq_len: int = 128
    """Tokens per training sequence."""
    batch_size: int = 16
    """Sequences per inner step (the run's batch). Peers accumulate micro-batches to reach it."""
    val_sequences: int = 64
    """Held-out sequences used for the validation perplexity."""
    inner_lr: float = 2e-3
    """Peak AdamW learning rate (ALGORITHMS §1)."""
    inner_min_lr_ratio: float = 0.1
    """eta_min / eta_max of the cosine schedule (ALGORITHMS §2.6); > 0 so learning never stops."""
    warmup_steps: int = 50
    """Linear warm-up steps of each shard's schedule."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    inner_steps: int = 50
    """H: inner steps per round (the fastest peer's count under DyLU)."""
    outer_optimizer: OuterOptimizerName = "nesterov"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    dn_buffer_size: int = 0
    """N of Delayed Nesterov; 0 means the number of workers."""
    dn_c: float = 0.0
    """Leak c of Delayed Nesterov, in [0, 1/N]."""
    shards: ShardMode = "iid"
    num_shards: int = 0
    """Number of data shards; 0 means one per worker."""
    schedule_steps: int = 0
    """T of each shard's cosine schedule (ALGORITHMS §2.6); 0 means 10,000, in a swarm and the
    simulator alike (peer/inner.py SHARD_SCHEDULE_STEPS)."""
    compression: CompressionName = "none"
    """Pseudo-gradient encoding on the wire: none (fp32), fp16, int8 or int4 (blockwise absmax,
    averaging/compression.py). Lossy codecs round each contribution and the group's average."""
    prune_fraction: float = 0.0
    """In [0, 1): each peer zeroes this fraction of the smallest magnitudes of each tensor of its
    pseudo-gradient before sending it (DiLoCo Table 6); saves no bytes with these codecs."""
    seed: int = 0

    def __post_init__(self) -> None:
        choice("model preset", self.model, MODEL_PRESETS)
        choice("outer optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        choice("shard mode", self.shards, get_args(ShardMode))
        for name in ("seq_len", "batch_size", "val_sequences", "inner_lr", "inner_steps"):
            positive(name, getattr(self, name))
        for name in ("max_tokens", "warmup_steps", "weight_decay", "grad_clip", "outer_lr"):
            non_negative(name, getattr(self, name))
        for name in ("dn_buffer_size", "num_shards", "dn_c", "schedule_steps"):
            non_negative(name, getattr(self, name))
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        choice("compression", self.compression, COMPRESSIONS)
        if not 0 <= self.prune_fraction < 1:
            raise ConfigError(f"prune_fraction must be in [0, 1), got {self.prune_fraction}")
        if not 0 < self.inner_min_lr_ratio <= 1:
            raise ConfigError(
                f"inner_min_lr_ratio must be in (0, 1], got {self.inner_min_lr_ratio}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> RunSpec:
        """Rebuild from `to_dict()` output; unknown or ill-typed fields raise ConfigError."""
        return cls(
            **checked_fields(cls, data, "run config field", "run config must be a JSON object")
        )


@dataclass(kw_only=True, frozen=True)
class SimSpec:
    """A simulator run: the shared run plus the virtual swarm around it (ALGORITHMS §2.8)."""

    run: RunSpec = field(default_factory=RunSpec)
    algo: SimAlgo = "sync"
    workers: int = 4
    total_steps: int = 800
    """Budget of local (inner) steps summed over all workers. `single` does this many steps;
    `ddp` does total_steps / workers updates of a workers-times larger batch."""
    heterogeneity: Heterogeneity = "none"
    jitter: float = 0.0
    """Std of the per-step multiplicative log-normal jitter of step times (seeded)."""
    grace_s: float = 0.0
    """Async grace period in virtual seconds (ALGORITHMS §2.4): the shortest window."""
    grace_share: float = GRACE_SHARE
    """Async grace period as a share of a phase (H steps at the fastest worker's speed); the
    window is the longer of the two (ALGORITHMS §2.4). The swarm's default, as there."""
    comm_s: float = 0.0
    """Virtual seconds one all-reduce takes (a sync round's, an async group's)."""
    overlap: OverlapRule = "none"
    """Overlapped rounds (ALGORITHMS §1.1): a worker starts its next phase as soon as its own
    ends and folds the new θ_global in once the all-reduce is done. `eager` starts it from the
    outer step previewed with its own δ, `local` from its own last local θ."""
    overlap_fold: FoldRule = "mix"
    """How an overlapped phase folds θ_global in (`sim.worker.Fold`: rebase, mix or pull); the
    swarm's default (SwarmSettings.fold)."""
    overlap_keep: float = 0.5
    """The fold's share of the local progress kept (1: all of it; 0: restart from θ_global);
    the swarm's default."""
    overlap_from: OverlapFrom = "group"
    """When an overlapped phase starts: at the end of the worker's own phase (`phase`: the
    wait for the group's slowest member is trained through too) or once its group is complete
    (`group`: only the all-reduce is)."""
    overlap_term: OverlapTerm = "own"
    """`mix` only: `own`, the δ as measured (κ·(θ_global − b) of the merge in it), or `shared`,
    the swarm's: the phase's progress, plus κ·(Δ − (θ_{v−1} − θ_v)) of the last outer step when
    it is applied (`Simulator.with_term`)."""
    fragments: int = 1
    """Streaming DiLoCo's fragments (ALGORITHMS §1.2, `sim.fragments`): a sync round syncs the
    model in this many parts, one after each H/fragments inner steps (1: the whole model)."""
    staleness_threshold: int = 10
    """async-polythres drops contributions staler than this."""
    drop_prob: float = 0.0
    """Probability that a worker's contribution is lost in a sync round (DiLoCo Fig. 8)."""
    compute_schedule: ComputeSchedule = "constant"
    """Active workers over the run in sync mode (DiLoCo Fig. 7)."""
    pretrain_steps: int = 0
    """Single-worker AdamW steps before the distributed phase (the papers' shared start)."""
    init: str | None = None
    """Safetensors checkpoint to start from instead of a fresh init (skips nothing else)."""
    eval_every: int = 0
    """Evaluate the global model every this many local steps of progress; 0 picks ~20 points."""
    threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""

    def __post_init__(self) -> None:
        choice("algorithm", self.algo, SIM_ALGOS)
        choice("heterogeneity", self.heterogeneity, HETEROGENEITY)
        choice("compute schedule", self.compute_schedule, COMPUTE_SCHEDULES)
        choice("overlap rule", self.overlap, OVERLAP_RULES)
        choice("fold rule", self.overlap_fold, get_args(FoldRule))
        choice("overlap start", self.overlap_from, get_args(OverlapFrom))
        choice("overlap term", self.overlap_term, get_args(OverlapTerm))
        if self.overlap_term == "shared" and (self.overlap == "none" or self.overlap_fold != "mix"):
            raise ConfigError("--overlap-term shared needs --overlap and --overlap-fold mix")
        if not (is_finite(self.overlap_keep) and 0 <= self.overlap_keep <= 1):
            raise ConfigError(f"overlap_keep must be in [0, 1], got {self.overlap_keep}")
        positive("workers", self.workers)
        positive("total_steps", self.total_steps)
        for name in ("jitter", "grace_s", "staleness_threshold", "pretrain_steps", "eval_every"):
            non_negative(name, getattr(self, name))
        finite("comm_s", self.comm_s, 0.0, strict=False)
        share("grace_share", self.grace_share)
        if not 0 <= self.drop_prob < 1:
            raise ConfigError(f"drop_prob must be in [0, 1), got {self.drop_prob}")
        if self.compute_schedule != "constant" and self.algo != "sync":
            raise ConfigError("--compute-schedule other than 'constant' needs --algo sync")
        if self.drop_prob > 0 and self.algo != "sync":
            raise ConfigError("--drop-prob needs --algo sync")
        if self.overlap != "none" and self.algo not in ("sync", "dn", "dn-dylu"):
            raise ConfigError(f"--overlap needs --algo sync, dn or dn-dylu, not {self.algo}")
        if self.overlap != "none" and (self.drop_prob > 0 or self.compute_schedule != "constant"):
            raise ConfigError("--overlap is not modelled with --drop-prob or --compute-schedule")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class SwarmSettings:
    """How the swarm runs its rounds (DESIGN §3). Shared by every peer through the manifest."""

    protocol: Protocol = "sync"
    """`sync`: a round waits for every live peer (bounded by sync_timeout_s); `async`: a round
    waits at most grace_s for others at the same version, then applies what it has."""
    sync_timeout_s: float = 30.0
    """Sync mode: longest wait for live peers to join a round's group."""
    allreduce_timeout_s: float = 60.0
    """Longest an all-reduce may take before the round fails and the peer keeps its delta."""
    grace_s: float = 2.0
    """Async mode: how long a ready peer waits for others to form a group, at least."""
    grace_share: float = GRACE_SHARE
    """Async mode: the grace period is also at least this share of a phase (H steps at the
    fastest live peer's speed), so that it scales with the phase (ALGORITHMS §2.4)."""
    group_size: int = 16
    """Most members of one all-reduce group: one group per version while the swarm fits in it,
    two-stage averaging past it (averaging/hierarchy.py). Small, so that a member that drops
    mid-round costs only its group's δs (issue 19: 16 peers in groups of 4 kept the rate of one
    group of 16 on netlab, docs/results.md)."""
    weighting: Weighting = "uniform"
    """Average the members' deltas uniformly or weighted by their (self-reported) samples."""
    staleness_limit: int = 8
    """A kept delta older than this many versions is dropped and counted, never applied."""
    checkpoint_every: int = 5
    """Write a local checkpoint every this many versions; 0 disables."""
    expected_peers: int = 0
    """Peers the run expects. A peer's first round waits (up to start_timeout_s) until this many
    are live, so a swarm started together trains together; in async mode Delayed Nesterov's
    buffer N defaults to it. 0: no wait, N = 1."""
    start_timeout_s: float = 300.0
    """Longest a peer waits for expected_peers before it trains anyway."""
    eval_every: int = 1
    """Evaluate the held-out perplexity every this many versions (with fragments, cycles of P
    versions) and when stopping; 0: only when stopping."""
    keep_updates: int = 16
    """L: at most this many applied updates each peer keeps and serves, so a peer behind by at
    most L versions replays them instead of downloading the full state. Replay pays only while
    the missed updates cost fewer bytes than the state, so a peer keeps no more than that
    horizon plus one (Nesterov: 3; coordinator_free/update_log.py `log_capacity`)."""
    aggregation: AggregationName = "mean"
    """How each part reducer combines the members' δs: `mean`, or for open swarms the robust
    `trimmed-mean` (coordinate-wise) or `centered-clip` (averaging/robust.py)."""
    norm_factor: float = 4.0
    """A contribution whose declared δ norm exceeds this x the group's median, and also this x
    the median norm per declared step, is excluded (`contribution.norm_outliers`)."""
    min_cosine: float = 0.02
    """In groups of 3+, a part whose cosine with the coordinate-wise median of the others' is
    below this is excluded (sign-flipped or random δs); -1 disables the check."""
    ban_rounds: int = 10
    """A peer whose contribution was excluded is banned for this many versions."""
    overlap: bool = False
    """Overlapped rounds (ALGORITHMS §1.1): a peer hands its δ to a round in the background
    and trains its next phase at once from its own parameters, folding θ_global in when the
    round ends. Off: every round blocks training until its outer step is applied."""
    overlap_fold: FoldRule | None = None
    """The overlapped fold: `rebase` (its δ is the phase's own progress, as a blocking δ) or
    `mix` (Streaming DiLoCo's merge; its δ carries the group's last average in place of the
    peer's own last δ, so that honest δs pass the screens: ALGORITHMS §1.1). Unset: `fold`."""
    overlap_keep: float | None = None
    """The fold's share κ of the local progress kept. Unset: 0.5 with `mix` (Streaming
    DiLoCo's α), 1 with the others."""
    overlap_from: OverlapFrom | None = None
    """When an overlapped phase starts: at the hand-off (`phase`) or once the round's group is
    formed and its all-reduce starts (`group`: the wait for slower peers is not trained
    through, only the all-reduce and the outer step). Unset: `group` with `mix`, else `phase`."""
    fragments: int = 1
    """Streaming DiLoCo's fragments (docs/algorithms.md §1.3): the update at version v moves
    fragment v mod `fragments` alone, after H / `fragments` steps (sync; 1: the whole model)."""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"unknown swarm protocol {self.protocol!r}; choose sync or async")
        if self.weighting not in get_args(Weighting):
            raise ConfigError(f"unknown weighting {self.weighting!r}; choose uniform or samples")
        finite("sync_timeout_s", self.sync_timeout_s, 0, strict=True)
        finite("allreduce_timeout_s", self.allreduce_timeout_s, 0, strict=True)
        finite("grace_s", self.grace_s, 0, strict=False)
        share("grace_share", self.grace_share)
        if self.group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {self.group_size}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"unknown aggregation {self.aggregation!r}; choose {', '.join(AGGREGATIONS)}"
            )
        finite("norm_factor", self.norm_factor, 1, strict=True)
        if not (is_finite(self.min_cosine) and -1 <= self.min_cosine < 1):
            raise ConfigError(f"min_cosine must be in [-1, 1), got {self.min_cosine}")
        for name in ("staleness_limit", "checkpoint_every", "expected_peers", "eval_every",
                     "keep_updates", "ban_rounds"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        finite("start_timeout_s", self.start_timeout_s, 0, strict=False)
        choice("fold rule", self.fold, get_args(FoldRule))
        choice("overlap start", self.start_from, get_args(OverlapFrom))
        if not (is_finite(self.keep) and 0 <= self.keep <= 1):
            raise ConfigError(f"overlap_keep must be in [0, 1], got {self.keep}")
        fragments_fit(self.fragments, self.protocol, self.overlap, self.fold)
        if self.protocol == "async" and self.grace_s <= 0:
            raise ConfigError("async mode needs grace_s > 0: peers finishing together must meet")

    @property
    def mixes(self) -> bool:
        """Overlapped rounds with the `mix` fold: δs carry the term their group shares and
        downloads step to the head (ALGORITHMS §1.1)."""
        return self.overlap and self.fold == "mix"

    @property
    def fold(self) -> FoldRule:
        """`overlap_fold`, or where unset the rule measured best in both protocols, `mix`
        (docs/results.md, issue 18); with fragments, which need it (`fragments_fit`), `rebase`."""
        return self.overlap_fold or ("rebase" if self.fragments > 1 else "mix")

    @property
    def keep(self) -> float:
        """`overlap_keep`, or where unset 0.5 with `mix` and 1 with the other folds."""
        if self.overlap_keep is not None:
            return self.overlap_keep
        return 0.5 if self.fold == "mix" else 1.0

    @property
    def start_from(self) -> OverlapFrom:
        """`overlap_from`, or where unset `group` with `mix` (measured with it) and `phase`."""
        return self.overlap_from or ("group" if self.fold == "mix" else "phase")

    def grace(self, phase_s: float | None) -> float:
        """The async grace period around a phase of `phase_s` seconds (None: not measured)."""
        return max(self.grace_s, self.grace_share * phase_s) if phase_s else self.grace_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> SwarmSettings:
        """Rebuild from `to_dict()` output; unknown or ill-typed fields raise ConfigError."""
        return cls(
            **checked_fields(
                cls,
                data,
                "swarm setting",
                "swarm settings must be a table / JSON object",
                unset={"overlap_fold": str, "overlap_keep": float, "overlap_from": str},
            )
        )


def default_run(
    model: ModelPreset = "tiny", protocol: Protocol = "sync"
) -> tuple[RunSpec, SwarmSettings]:
    """The built-in run (tiny model, built-in corpus, byte tokens): sync DiLoCo, or async with
    Delayed Nesterov; both at outer lr 0.7 (a group of N is one Nesterov step under DN, §2.2).
    `simulate` takes its defaults from it, the schedule's length and RunSpec's warm-up of 50
    steps included (better than 20 for both protocols: docs/results.md, issue 17)."""
    run = RunSpec(model=model, num_shards=DEFAULT_SHARDS,
                  outer_optimizer="delayed-nesterov" if protocol == "async" else "nesterov")  # fmt: skip
    return run, SwarmSettings(
        protocol="sync" if protocol == "sync" else "async",
        sync_timeout_s=30.0, allreduce_timeout_s=60.0, grace_s=2.0,
    )  # fmt: skip
