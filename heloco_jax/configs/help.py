"""The config keys as `heloco-jax train --help` lists them.

``describe(config)`` gives one line per key (dotted, e.g.
``outer.keep_threshold``) with its value in ``config`` (the default, for
``default.get_config()``) and what is allowed, and under it a line saying
what the key means, grouped by section. The allowed values come from
``heloco_jax.configs.validation`` (``CHOICES``, ``ALLOWED``: next to the
checks), the meanings from ``MEANINGS`` below; docs/DESIGN.md ("Command
line") has the contract.
"""

from __future__ import annotations

from typing import Any, Iterator

import ml_collections

from heloco_jax.configs import validation

# What each section is for; the top-level keys come first, as "run".
SECTIONS: dict[str, str] = {
    "": "run: method, workers, schedule, outputs",
    "budget": "budget: when the run ends (work still in flight then is not applied)",
    "model": "model: the CLI's TinyGPT (flax.nnx decoder-only GPT, byte vocabulary)",
    "data": "data: the CLI's corpus, its partition over workers and the validation set",
    "inner": "inner: the workers' AdamW with warm-up + cosine schedule; PALSGD's pull",
    "outer": "outer: the outer rule's hyperparameters (docs/ALGORITHMS.md)",
    "fault": "fault: fault injection, for tests",
    "devices": "devices: runtime=devices, workers on groups of real devices (real clock)",
    "distributed": "distributed: synchronous methods across processes (jax.distributed)",
    "ray": "ray: runtime=ray, a parameter-server actor and one actor per worker",
    "comm": "comm: simulated communication cost per model-sized message or all-reduce",
}

# One line per key: what it means (defaults and allowed values are shown beside it).
MEANINGS: dict[str, str] = {
    "method": "the training method (docs/ALGORITHMS.md)",
    "seed": "PRNG seed: model init, data order, dispatch keys, coins, the clock's jitter",
    "num_workers": "K, the number of workers",
    "inner_steps": "H, inner steps per dispatch (per round for synchronous methods)",
    "speeds": "simulated seconds per inner step of each worker: a preset or a list",
    "jitter": "relative per-step jitter of the simulated clock",
    "batch_size": "sequences per inner step per worker",
    "eval_every_tokens": "tokens between validation evaluations (also at start and end)",
    "metrics_fetch_every": "arrival rows whose diagnostics are fetched from the device "
                           "together (1 = a host read per arrival)",
    "runtime": "where compute runs: simulated clock, real devices, or Ray actors",
    "checkpoint_every": "outer updates (DDP: steps) between checkpoints; 0 = off",
    "keep_checkpoints": "the newest checkpoints kept in DIR/checkpoints",
    "grace_window": "simulated seconds: arrivals this close to the first are combined",
    "dylu": "DyLU: worker i runs H_i = max(1, floor(v_i / v_ref * H)) steps (async methods)",
    "lookahead_dispatch": "-1: the method's default; 0: dispatch from θ; 1: from θ − η·μ·m",
    "palsgd_warmup_steps": "DDP steps before PALSGD's rounds; -1 = H",
    "rejection_limit": "non-finite pseudo-gradients in a row (none applied between) that stop "
                       "the run; 0 = num_workers, at least 2",
    "writers": "metric writers, comma-separated: jsonl (always), tensorboard (DIR/tensorboard, "
               "needs tensorboardX); '' = jsonl, plus tensorboard when tensorboardX is installed",
    "quiet": "no progress: neither the bar (terminal) nor the lines every 30 s (otherwise)",
    "deterministic": "XLA's deterministic GPU ops, for bit-exact replay on GPUs (~20% slower "
                     "there); -1: on for runtime=simulated; 0: off; 1: on",
    "budget.tokens": "tokens of all applied inner steps together; 0 = none",
    "budget.sim_seconds": "simulated seconds (real seconds on devices and ray); 0 = none",
    "model.d_model": "width of the residual stream",
    "model.num_layers": "transformer blocks",
    "model.num_heads": "attention heads per block",
    "model.context": "tokens per training sequence (learned positions)",
    "model.compute_dtype": "dtype of matmuls and activations; parameters, optimizer states, "
                           "pseudo-gradients and the outer step stay float32",
    "data.source": "where the text comes from (synthetic needs no download)",
    "data.path": "the folder or dataset name of the source; '' for synthetic",
    "data.languages": "the languages to use, comma-separated; '' = all the source has",
    "data.partition": "non_iid: worker i reads language i; iid: the mix; dirichlet: "
                      "mixtures drawn from Dirichlet(alpha)",
    "data.dirichlet_alpha": "α of the Dirichlet partition (small = more skew)",
    "data.val_sequences_per_language": "held-out validation sequences per language",
    "data.tokenizer": "token ids: bytes (257 ids), or a BPE vocabulary trained offline on the "
                      "corpus (heloco-jax corpus bpe --out=DIR writes DIR/tokenizer.json)",
    "data.max_bytes_per_language": "cap on the text read per language; 0 = no cap "
                                   "(synthetic: its default size)",
    "inner.learning_rate": "peak inner learning rate α",
    "inner.warmup_steps": "linear warm-up from 0 to α, in a worker's own steps",
    "inner.total_steps": "length of the cosine decay, in a worker's own steps",
    "inner.min_learning_rate_ratio": "final learning rate as a fraction of α",
    "inner.weight_decay": "AdamW decoupled weight decay (matrices only)",
    "inner.grad_clip": "global-norm gradient clipping; 0 = off",
    "inner.palsgd_coins": "PALSGD: shared (all workers pseudo-sync on the same steps, as the "
                          "authors' code) or independent (a coin per worker)",
    "inner.reset_optimizer": "-1: the method's default; 0: keep AdamW state across "
                             "dispatches; 1: reset it at every dispatch",
    "inner.pseudo_sync_prob": "PALSGD's p, the probability of a pseudo-sync step",
    "inner.pseudo_sync_rate": "PALSGD's η_ps, the pull toward the last synchronised model",
    "outer.learning_rate": "outer η; 0 = the method's default (docs/ALGORITHMS.md)",
    "outer.momentum": "outer μ",
    "outer.weighting": "arrival weight ρ: 1/√K, (1/√K)/√(1+τ), or 1",
    "outer.buffer_size": "delayed_nesterov's N; 0 = num_workers",
    "outer.dn_c": "delayed_nesterov's c, the momentum applied between refreshes",
    "outer.keep_threshold": "HeLoCo c_ok: blocks with cosine >= c_ok are kept",
    "outer.bad_threshold": "HeLoCo c_bad: the lower end of the normalized rotation schedule",
    "outer.shrink_strength": "HeLoCo k_s",
    "outer.max_shrink": "HeLoCo β_max",
    "outer.rotate_strength": "HeLoCo k_d",
    "outer.confidence_scale": "HeLoCo κ",
    "outer.rotate_schedule": "HeLoCo r(c): normalized (the authors' code) or eq14 (1 − c)",
    "outer.weight_order": "HeLoCo: ρ applied before the correction (authors' code) or after",
    "outer.scope": "HeLoCo block: each pytree leaf, or the whole tree",
    "fault.worker": "the worker that sends a non-finite pseudo-gradient; -1 = off",
    "fault.arrival": "at its arrival number N (1 = the first)",
    "fault.value": "what it sends: NaN or Inf (the server must reject it)",
    "fault.kill_worker": "runtime=ray: kill this worker's actor at its fault.arrival-th arrival",
    "devices.group_sizes": "devices per worker; '' = jax.devices() split evenly",
    "devices.server": "index into jax.devices() of the outer step's device",
    "devices.slowdown": "factors f_i: worker i waits (f_i − 1)× its compute; '' = none",
    "distributed.coordinator": "'' = one process; auto = detect (Cloud TPU, SLURM); HOST:PORT",
    "distributed.num_processes": "with HOST:PORT: how many processes",
    "distributed.process_id": "with HOST:PORT: this process's index",
    "ray.address": "'' = start a local Ray instance; auto or HOST:6379 = join one",
    "ray.num_cpus": "a local instance's CPUs; 0 = all of this machine's",
    "ray.cpus_per_worker": "CPUs each worker actor reserves; 0 = Ray's default",
    "ray.gpus_per_worker": "GPUs each worker actor owns",
    "ray.server_gpus": "the parameter server's GPUs (0: it runs on its node's CPU)",
    "ray.log_to_driver": "show the actors' stdout and stderr in this terminal",
    "ray.max_restarts": "restarts of a worker actor that died (its task runs again); after "
                        "that its workers move to the live actors",
    "comm.latency": "seconds per message or all-reduce",
    "comm.bandwidth": "bytes per second; 0 = free transfers",
    "comm.ddp_overlap": "fraction of a DDP step's compute that its all-reduce hides behind "
                        "(0 = none; 2/3 ~ PyTorch DDP)",
}


def leaves(config: ml_collections.ConfigDict, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """(dotted key, value) of every leaf of ``config``."""
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def _show(value: Any) -> str:
  """A value as it is written on the command line ('' for the empty string)."""
  if isinstance(value, str):
    return value if value else "''"
  if isinstance(value, (list, tuple)):
    return ",".join(str(v) for v in value)
  return str(value)


def _allowed(key: str, value: Any) -> str:
  if key in validation.ALLOWED:
    return validation.ALLOWED[key]
  if isinstance(value, bool):
    return "True or False"
  if isinstance(value, int):
    return "an integer"
  if isinstance(value, float):
    return "a number"
  return "a string"


def describe(config: ml_collections.ConfigDict) -> str:
  """The help text of ``config``'s keys: key, default, allowed values, meaning.

  Args:
    config: a run config, e.g. ``heloco_jax.configs.default.get_config()``;
      its values are shown as the defaults.

  Returns:
    Lines grouped by section: a section title, then per key
    ``  key  default  allowed`` and an indented line with its meaning.
    Keys the tables do not know are listed too, with what their type allows.
  """
  order = {key: i for i, key in enumerate(MEANINGS)}  # default.py's order
  rows = sorted(leaves(config), key=lambda row: (order.get(row[0], len(order)), row[0]))
  width = max((len(key) for key, _ in rows), default=0)
  value_width = min(max((len(_show(v)) for _, v in rows), default=0), 12)
  sections: dict[str, list[str]] = {}
  for key, value in rows:
    section = key.rsplit(".", 1)[0] if "." in key else ""
    lines = sections.setdefault(section, [])
    lines.append(f"  {key:<{width}}  {_show(value):<{value_width}}  {_allowed(key, value)}")
    if key in MEANINGS:
      lines.append(f"  {'':<{width}}    {MEANINGS[key]}")
  out = []
  known = {name: i for i, name in enumerate(SECTIONS)}
  for section in sorted(sections, key=lambda name: (known.get(name, len(known)), name)):
    lines = sections[section]
    out.append(SECTIONS.get(section, section))
    out.extend(lines)
    out.append("")
  return "\n".join(out).rstrip() + "\n"
