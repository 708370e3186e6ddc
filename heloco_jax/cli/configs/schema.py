"""The one table of the CLI's config keys: default, what is allowed, what it means.

Each ``Key`` of ``KEYS`` is written once, here; ``default.get_config()``
builds the quickstart config from it, ``heloco-jax train --help`` lists it
(``configs.help``), and ``configs.validation`` checks every value against it
before any work, then the rules that tie keys together (a budget, a method's
look-ahead, a runtime's own section, the model and optimizers' own checks).

A key whose default is "the method's" or "decided from other keys" is an
``ml_collections.config_dict.placeholder``: None means the default, and the
command line sets a value of its type (``--config.lookahead_dispatch=true``,
``--config.outer.learning_rate=0.5``); there is no -1/0/1 code and no
"0 means the default".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import ml_collections
from ml_collections import config_dict

from heloco_jax.comm import compress, fragments, syncer
from heloco_jax.training import aggregate
from heloco_jax.lm import data, model
from heloco_jax.outer.correction import ROTATE_SCHEDULES, SCOPES
from heloco_jax.outer.heloco import MERGE_ORDERS, WEIGHT_ORDERS
from heloco_jax.outer.weighting import WEIGHTINGS
from heloco_jax.runtime import clocks, faults
from heloco_jax.runtime.state import PALSGD_COINS
from heloco_jax.training import methods

RUNTIMES = ("simulated", "devices", "ray")


@dataclasses.dataclass(frozen=True)
class Check:
  """A test of one value and what it allows, in words (``--help`` and error messages)."""
  test: Callable[[Any], bool]
  allowed: str

  def __call__(self, value: Any) -> bool:
    try:
      return bool(self.test(value))
    except (TypeError, ValueError):
      return False


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(low: int, high: Optional[int] = None, note: str = "") -> Check:
  words = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
  return Check(lambda v: _is_int(v) and low <= v and (high is None or v <= high),
               words + note)


def number(low: Optional[float] = None, high: Optional[float] = None, *,
           low_open: bool = False, high_open: bool = False, note: str = "") -> Check:
  if high is None:
    words = f"a number {'>' if low_open else '>='} {low:g}"
  else:
    words = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
  def test(v):
    return (_is_number(v) and (low is None or (v > low if low_open else v >= low))
            and (high is None or (v < high if high_open else v <= high)))
  return Check(test, words + note)


def one_of(choices: Any, note: str = "") -> Check:
  choices = tuple(choices)
  return Check(lambda v: isinstance(v, str) and v in choices,
               "one of: " + ", ".join(choices) + note)


BOOLEAN = Check(lambda v: isinstance(v, bool), "True or False")
TEXT = Check(lambda v: isinstance(v, str), "a string")


def optional(check: Check, default_words: str) -> Check:
  """``check``, or None (unset) meaning ``default_words``."""
  return Check(lambda v: v is None or check(v), f"{check.allowed}; or unset: {default_words}")


@dataclasses.dataclass(frozen=True)
class Key:
  """One config key.

  Attributes:
    name: dotted (``outer.learning_rate``).
    default: the quickstart's value; None with ``type`` for a placeholder.
    check: what a value must be (cross-key rules are in ``validation``).
    meaning: one line for ``--help``.
    type: the value type of a placeholder (default None).
  """
  name: str
  default: Any
  check: Check
  meaning: str
  type: Optional[type] = None


_SPEEDS = Check(lambda v: True, "one of: " + ", ".join(clocks.PRESETS)
                + "; or a list of num_workers seconds per step (> 0)")  # clock checks it

KEYS: tuple[Key, ...] = (
    # run
    Key("method", "heloco", one_of(methods.METHODS), "the training method (docs/ALGORITHMS.md)"),
    Key("seed", 0, integer(0, 2**32 - 1),
        "PRNG seed: model init, data order, dispatch keys, coins, the clock's jitter"),
    Key("num_workers", 5, integer(1, 4096), "K, the number of workers"),
    Key("inner_steps", 20, integer(1, 10**6),
        "H, inner steps per dispatch (per round for synchronous methods)"),
    Key("speeds", "mixed", _SPEEDS,
        "simulated seconds per inner step of each worker: a preset or a list", type=object),
    Key("jitter", 0.0, number(0.0, 1.0, high_open=True),
        "relative per-step jitter of the simulated clock"),
    Key("batch_size", 8, integer(1, note=" (runtime=devices: a multiple of every group's size)"),
        "sequences per inner step per worker"),
    Key("metrics_fetch_every", 16, integer(1), "arrival rows whose diagnostics are fetched "
        "from the device together (1 = a host read per arrival)"),
    Key("runtime", "simulated", one_of(RUNTIMES, " (ray: asynchronous methods only)"),
        "where compute runs: simulated clock, real devices, or Ray actors"),
    Key("dylu", False, BOOLEAN,
        "DyLU: worker i runs H_i = max(1, floor(v_i / v_ref * H)) steps (async methods)"),
    Key("lookahead_dispatch", None, optional(BOOLEAN, "the method's default"),
        "dispatch from θ − η·μ·m (mla: an option; heloco: always)", type=bool),
    Key("palsgd_warmup_steps", None, optional(integer(0), "H"),
        "DDP steps before PALSGD's rounds", type=int),
    Key("rejection_limit", None, optional(integer(1), "num_workers, at least 2"),
        "rejected pseudo-gradients in a row (non-finite, or refused by syncer.aggregate's "
        "screen; none applied between) that stop the run",
        type=int),
    Key("writers", "", TEXT, "metric writers, comma-separated: jsonl (always), tensorboard "
        "(DIR/tensorboard, needs tensorboardX); '' = jsonl, plus tensorboard when "
        "tensorboardX is installed"),
    Key("quiet", False, BOOLEAN,
        "no progress: neither the bar (terminal) nor the lines every 30 s (otherwise)"),
    Key("deterministic", None, optional(BOOLEAN, "on where the runtime's clock is simulated "
                                        "and model.compute_dtype=float32"),
        "XLA's deterministic GPU ops, for bit-exact replay on GPUs (about 20% slower there in "
        "float32, 2.5x in bfloat16); CPU and TPU runs replay bit for bit either way",
        type=bool),
    # budget
    Key("budget.tokens", 600_000, integer(0, note=" (budget.tokens or budget.sim_seconds "
                                               "must be > 0)"),
        "tokens of all applied inner steps together; 0 = none"),
    Key("budget.sim_seconds", 0.0, number(0.0),
        "simulated seconds (real seconds on devices and ray); 0 = none"),
    Key("budget.eval_every_tokens", 100_000, integer(0),
        "tokens between validation evaluations (also at start and end); 0 = those only"),
    # checkpoint
    Key("checkpoint.every", 10, integer(0),
        "outer updates (DDP: steps) between checkpoints; 0 = off"),
    Key("checkpoint.keep", 3, integer(1), "the newest checkpoints kept in DIR/checkpoints"),
    # model
    Key("model.d_model", 128, integer(1, 65536), "width of the residual stream"),
    Key("model.num_layers", 4, integer(1, 1024), "transformer blocks"),
    Key("model.num_heads", 4, integer(1, note=" that divides model.d_model"),
        "attention heads per block"),
    Key("model.context", 128, integer(1, 1 << 20),
        "tokens per training sequence (learned positions)"),
    Key("model.sharding", "none", one_of(("none", "fsdp", "fsdp_tp")),
        "fsdp: θ and every copy of it split over the devices (simulated: all of this "
        "process's; devices: each worker's group; ray: this process's, rebuilt in each "
        "actor); fsdp_tp: also tensor parallel over "
        "model.tensor_parallel of them; docs/DESIGN.md 'Scaling out'"),
    Key("model.tensor_parallel", 2, integer(1, note=" that divides the devices θ spans"),
        "the tp axis's size with model.sharding=fsdp_tp"),
    Key("model.compute_dtype", "float32", one_of(model.COMPUTE_DTYPES),
        "dtype of matmuls and activations; parameters, optimizer states, pseudo-gradients "
        "and the outer step stay float32"),
    Key("model.attention", "auto", one_of(model.ATTENTIONS),
        "attention kernel: auto = cuDNN's flash kernel on a GPU in bfloat16 without XLA's "
        "deterministic ops, else XLA's; xla; cudnn (also under deterministic ops, where the "
        "installed cuDNN has a deterministic backward)"),
    # data
    Key("data.source", "synthetic", one_of(data.SOURCES),
        "where the text comes from (synthetic needs no download)"),
    Key("data.path", "", Check(lambda v: isinstance(v, str), "a directory (text_dir, jsonl) or "
                               "a tensorflow-datasets name (tfds)"),
        "the folder or dataset name of the source; '' for synthetic"),
    Key("data.languages", "", Check(lambda v: isinstance(v, (str, list, tuple)),
                                    "comma-separated language names, or '' (all)"),
        "the languages to use, comma-separated; '' = all the source has", type=object),
    Key("data.partition", "non_iid", one_of(data.PARTITIONS),
        "non_iid: worker i reads language i; iid: the mix; dirichlet: mixtures drawn from "
        "Dirichlet(alpha)"),
    Key("data.dirichlet_alpha", 1.0, number(0.0, low_open=True),
        "α of the Dirichlet partition (small = more skew)"),
    Key("data.val_sequences_per_language", 16, integer(1),
        "held-out validation sequences per language"),
    Key("data.max_bytes_per_language", 0, integer(0),
        "cap on the text read per language; 0 = no cap (synthetic: its default size)"),
    Key("data.tokenizer", "bytes", Check(lambda v: isinstance(v, str), "'bytes', or the path "
                                         "of a tokenizer.json (heloco-jax corpus bpe)"),
        "token ids: bytes (257 ids), or a BPE vocabulary trained offline on the corpus "
        "(heloco-jax corpus bpe --out=DIR writes DIR/tokenizer.json)"),
    # inner
    Key("inner.learning_rate", 3e-3, number(0.0, low_open=True), "peak inner learning rate α"),
    Key("inner.warmup_steps", 20, integer(0),
        "linear warm-up from 0 to α, in a worker's own steps"),
    Key("inner.total_steps", 2_000, integer(1, note=" > inner.warmup_steps"),
        "length of the cosine decay, in a worker's own steps"),
    Key("inner.min_learning_rate_ratio", 0.1, number(0.0, 1.0),
        "final learning rate as a fraction of α"),
    Key("inner.weight_decay", 0.1, number(0.0), "AdamW decoupled weight decay (matrices only)"),
    Key("inner.grad_clip", 1.0, number(0.0), "global-norm gradient clipping; 0 = off"),
    Key("inner.reset_optimizer", None, optional(BOOLEAN, "the method's default (True but for "
                                                "palsgd)"),
        "a fresh AdamW state at every dispatch (the worker's step count and schedule kept)",
        type=bool),
    Key("inner.pseudo_sync_prob", 0.2, number(0.0, 1.0, high_open=True),
        "PALSGD's p, the probability of a pseudo-sync step"),
    Key("inner.pseudo_sync_rate", 0.5, number(0.0, note="; palsgd: pseudo_sync_rate·"
                                              "learning_rate/pseudo_sync_prob <= 1"),
        "PALSGD's η_ps, the pull toward the last synchronised model"),
    Key("inner.palsgd_coins", "shared", one_of(PALSGD_COINS),
        "PALSGD: shared (all workers pseudo-sync on the same steps, as the authors' code) or "
        "independent (a coin per worker)"),
    # outer
    Key("outer.learning_rate", None, optional(number(0.0, low_open=True),
                                              "the method's (docs/ALGORITHMS.md)"),
        "outer η", type=float),
    Key("outer.momentum", 0.9, number(0.0, 1.0, high_open=True), "outer μ (cgad: Adam's β₁)"),
    Key("outer.weighting", "constant", one_of(WEIGHTINGS),
        "arrival weight ρ: 1/√K, (1/√K)/√(1+τ), or 1"),
    Key("outer.buffer_size", None, optional(integer(1), "num_workers"),
        "delayed_nesterov's N", type=int),
    Key("outer.dn_c", 0.0, number(0.0, note=" and <= 1/N, N the buffer size"),
        "delayed_nesterov's c (hj.delayed_nesterov's c), the momentum applied between "
        "refreshes"),
    Key("outer.keep_threshold", 0.2, number(-1.0, 1.0),
        "HeLoCo c_ok: blocks with cosine >= c_ok are kept"),
    Key("outer.bad_threshold", -0.2, number(-1.0, 1.0, note=" < outer.keep_threshold (with "
                                            "rotate_schedule=normalized)"),
        "HeLoCo c_bad: the lower end of the normalized rotation schedule"),
    Key("outer.shrink_strength", 0.5, number(0.0), "HeLoCo k_s"),
    Key("outer.max_shrink", 0.5, number(0.0, 1.0), "HeLoCo β_max"),
    Key("outer.rotate_strength", 1.0, number(0.0), "HeLoCo k_d"),
    Key("outer.confidence_scale", 3.0, number(0.0), "HeLoCo κ"),
    Key("outer.rotate_schedule", "normalized", one_of(ROTATE_SCHEDULES),
        "HeLoCo r(c): normalized (the authors' code) or eq14 (1 − c)"),
    Key("outer.weight_order", "before", one_of(WEIGHT_ORDERS),
        "HeLoCo: ρ applied before the correction (authors' code) or after"),
    Key("outer.scope", "leaf", one_of(SCOPES), "HeLoCo block: each pytree leaf, or the whole "
        "tree"),
    Key("outer.merge_order", "merge_then_correct", one_of(MERGE_ORDERS),
        "HeLoCo under a quorum: merge the group, then correct once (authors' Decoupled HeLoCo), "
        "or correct each arrival against the same momentum, then merge"),
    Key("outer.age_decay", 0.1, number(0.0), "CGAD α of σ(τ) = γ(τ)·exp(−α·τ)"),
    Key("outer.age_cutoff", 32.0, number(0.0, low_open=True),
        "CGAD τ_c: the cosine gate γ(τ) reaches 0 at τ = τ_c"),
    # devices
    Key("devices.group_sizes", "", TEXT, "devices per worker; '' = jax.devices() split evenly"),
    Key("devices.server", 0, integer(0, note=" (an index into jax.devices())"),
        "index into jax.devices() of the outer step's device"),
    Key("devices.slowdown", "", TEXT,
        "factors f_i: worker i waits (f_i − 1)× its compute; '' = none"),
    # distributed
    Key("distributed.coordinator", "", TEXT,
        "'' = one process; auto = detect (Cloud TPU, SLURM); HOST:PORT"),
    Key("distributed.num_processes", None, optional(integer(1), "with HOST:PORT: required"),
        "with HOST:PORT: how many processes", type=int),
    Key("distributed.process_id", None, optional(integer(0), "with HOST:PORT: required"),
        "with HOST:PORT: this process's index", type=int),
    Key("distributed.timeout", 60.0, number(1.0),
        "seconds a process waits for the others to start (then one line names the missing)"),
    # ray
    Key("ray.address", "", TEXT, "'' = start a local Ray instance; auto or HOST:6379 = join one"),
    Key("ray.num_cpus", None, optional(integer(1), "all of this machine's"),
        "a local instance's CPUs", type=int),
    Key("ray.cpus_per_worker", None, optional(number(0.0, low_open=True), "Ray's default"),
        "CPUs each worker actor reserves", type=float),
    Key("ray.gpus_per_worker", 0.0, number(0.0), "GPUs each worker actor owns"),
    Key("ray.server_gpus", 0.0, number(0.0),
        "the parameter server's GPUs (0: it runs on its node's CPU)"),
    Key("ray.log_to_driver", False, BOOLEAN, "show the actors' stdout and stderr in this "
        "terminal"),
    Key("ray.max_restarts", 3, integer(0), "restarts of a worker actor that died (its task "
        "runs again); after that its workers move to a new actor or the live ones"),
    Key("ray.replacements", 0, integer(0), "new worker actors the run may start in place of "
        "actors out of restarts (0: their workers move to the live actors)"),
    Key("ray.devices_per_worker", 0, integer(0), "devices of its actor each worker runs "
        "data-parallel over, its batch split (0: the actor's devices shared by its workers)"),
    Key("ray.workers_per_actor", 1, integer(1), "workers each actor runs, each on its own "
        "devices (e.g. 2 workers of 4 chips on an 8-chip host)"),
    Key("ray.spares", 0, integer(0), "standby worker actors, compiled at the first dispatch: "
        "a dead actor's workers move to one at once (no restart)"),
    # comm
    Key("comm.latency", 0.0, number(0.0), "seconds per message or all-reduce"),
    Key("comm.bandwidth", None, optional(number(0.0, low_open=True), "free transfers"),
        "bytes per second", type=float),
    Key("comm.ddp_overlap", 0.0, number(0.0, 1.0, high_open=True),
        "fraction of a DDP step's compute that its all-reduce hides behind (0 = none; "
        "2/3 ~ PyTorch DDP)"),
    # streaming
    Key("streaming.fragments", 1, integer(1), "P: θ split into P fragments, fragment p synced "
        "every inner_steps at offset p·inner_steps/P (1 = θ whole; P divides inner_steps)"),
    Key("streaming.layout", "contiguous", one_of(fragments.LAYOUTS),
        "how θ's leaves are split into fragments"),
    Key("streaming.overlap_steps", 0, integer(0), "τ: inner steps a worker takes while a "
        "fragment's sync is in flight (< inner_steps/P)"),
    Key("streaming.alpha", 1.0, number(0.0, 1.0, low_open=True),
        "α: the weight of the arrived fragment against the worker's own (1 = replace it)"),
    # compression
    Key("compression.kind", "none", one_of(compress.KINDS, " (none: Δ sent as it is)"),
        "how workers compress their pseudo-gradients before sending them (not with ddp; "
        "runtime=simulated)"),
    Key("compression.block", 256, integer(1, 1 << 20), "int8/int4/int2: entries per scale"),
    Key("compression.fraction", 0.01, number(0.0, 1.0, low_open=True),
        "top_k: the fraction of entries sent"),
    Key("compression.error_feedback", False, BOOLEAN,
        "keep what the compression drops and add it to the next pseudo-gradient"),
    Key("compression.download", False, BOOLEAN,
        "compress θ's downloads too, with the same kind (asynchronous methods)"),
    # syncer
    Key("syncer.grace_window", 0.0, number(0.0),
        "seconds: arrivals this close to the first (with a quorum: to its closing) are "
        "combined"),
    Key("syncer.quorum", 1, integer(1, note=" and <= num_workers"),
        "q: arrivals an outer update waits for (asynchronous methods)"),
    Key("syncer.timeout", None, optional(number(0.0, low_open=True), "none"),
        "seconds after a group's first arrival at which it applies short of q", type=float),
    Key("syncer.adaptive_grace", 0.0, number(0.0),
        "κ > 0: the grace window is κ × the mean gap between arrivals (instead of "
        "syncer.grace_window)"),
    Key("syncer.weights", "mean", one_of(syncer.WEIGHTS),
        "how a group's pseudo-gradients merge: mean, or weighted by the tokens each trained on"),
    Key("syncer.aggregate", "mean", Check(aggregate.parse, "an hj.aggregate rule: " + ", ".join(
        aggregate.RULES) + " (keywords in parentheses, e.g. trimmed_mean(f=1))"),
        "how accepted pseudo-gradients become one update (rounds, quorum groups) or each "
        "arrival is screened (docs/ALGORITHMS.md, \"Aggregation\")"),
    # chaos
    Key("chaos.schedule", "", TEXT,
        "workers away: 'W@LEAVE-BACK,W@LEAVE' in seconds of the run's clock (W@0-T: a new worker "
        "joining at T); '' = none"),
    Key("chaos.rate", 0.0, number(0.0),
        "seeded random failures per worker per simulated second (with chaos.downtime)"),
    Key("chaos.downtime", 60.0, number(0.0, low_open=True),
        "mean simulated seconds a randomly failed worker stays away"),
    Key("chaos.faulty", "", Check(faults.Faults.parse, "'' (none) or 'W:sign', 'W:scale=S', "
                                  "'W:noise=SIGMA', 'W:nan', 'W:replay=N', "
                                  "comma-separated"),
        "faulty workers: each alters its pseudo-gradient before upload, e.g. "
        "'1:sign,3:scale=10,4:noise=0.1' (docs/ALGORITHMS.md, \"Faulty workers\")"),
)

BY_NAME: dict[str, Key] = {key.name: key for key in KEYS}

# Keys renamed since: a workdir's config.json may hold the former names (``RunDirectory``'s
# ``renamed``), and the command line names the new one for a former flag.
RENAMED: dict[str, str] = {"eval_every_tokens": "budget.eval_every_tokens",
                           "grace_window": "syncer.grace_window",
                           "checkpoint_every": "checkpoint.every",
                           "keep_checkpoints": "checkpoint.keep"}

# What each section is for; the top-level keys come first, as "run".
SECTIONS: dict[str, str] = {
    "": "run: method, workers, schedule, outputs",
    "budget": "budget: when the run ends (work still in flight then is not applied) and "
              "how often it is evaluated",
    "checkpoint": "checkpoint: how often DIR/checkpoints is written and how many are kept",
    "model": "model: the CLI's TinyGPT (flax.nnx decoder-only GPT)",
    "data": "data: the CLI's corpus, its partition over workers and the validation set",
    "inner": "inner: the workers' AdamW with warm-up + cosine schedule; PALSGD's pull",
    "outer": "outer: the outer rule's hyperparameters (docs/ALGORITHMS.md)",
    "devices": "devices: runtime=devices, workers on groups of real devices (real clock)",
    "distributed": "distributed: synchronous methods across processes (jax.distributed)",
    "ray": "ray: runtime=ray, a parameter-server actor and one actor per worker",
    "comm": "comm: simulated communication cost per message or all-reduce (its bytes)",
    "streaming": "streaming: θ in fragments with staggered syncs (Streaming DiLoCo; "
                 "docs/ALGORITHMS.md)",
    "compression": "compression: pseudo-gradients compressed before they are sent "
                   "(docs/ALGORITHMS.md)",
    "syncer": "syncer: how asynchronous arrivals are grouped and merged (quorum, grace, "
              "token weights; docs/ALGORITHMS.md)",
    "chaos": "chaos: workers that leave and join, in seconds of the run's clock "
             "(docs/FAILURES.md)",
}


def get_config() -> ml_collections.ConfigDict:
  """The quickstart config: every key of ``KEYS`` at its default."""
  config = ml_collections.ConfigDict()
  for key in KEYS:
    *sections, leaf = key.name.split(".")
    node = config
    for section in sections:
      if section not in node:
        node[section] = ml_collections.ConfigDict()
      node = node[section]
    if key.type is object:  # a preset name or a list: any type
      node[leaf] = ml_collections.FieldReference(key.default, field_type=object)
    elif key.default is None:
      node[leaf] = config_dict.placeholder(key.type)
    else:
      node[leaf] = key.default
  return config
