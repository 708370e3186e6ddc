"""The quickstart config: HeLoCo on 5 simulated workers of severe heterogeneity, one
synthetic language each (no download). Keys follow DESIGN.md ("Command line")."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.method = "heloco"          # ddp | local_sgd | diloco | async_nesterov | delayed_nesterov
                               # | mla | heloco | palsgd
  c.seed = 0
  c.num_workers = 5
  c.inner_steps = 20           # H
  # A preset name (clock.PRESETS) or a list of seconds per step, so typed `object`.
  c.speeds = ml_collections.FieldReference("severe", field_type=object)
  c.jitter = 0.0               # relative per-step jitter in [0, 1)
  c.batch_size = 8             # sequences per inner step per worker
  c.eval_every_tokens = 100_000
  c.metrics_fetch_every = 16   # arrival rows whose diagnostics are fetched from the device
                               # together (1 = a host read per arrival)
  c.runtime = "simulated"      # simulated | devices | ray
  c.checkpoint_every = 10      # outer updates (DDP: steps); 0 = off
  c.keep_checkpoints = 3       # the newest checkpoints kept in DIR/checkpoints
  c.grace_window = 0.0         # simulated seconds: arrivals this close are combined
  c.dylu = False               # H_i = max(1, floor(v_i / v_ref * H)) (async methods)
  c.lookahead_dispatch = -1    # -1: the method's default; 0: off; 1: on (mla only)
  c.palsgd_warmup_steps = -1   # DDP steps before PALSGD's rounds; -1 = H
  c.rejection_limit = 0        # non-finite pseudo-gradients in a row that stop the run;
                               # 0 = num_workers (at least 2)
  c.writers = ""               # metric writers: jsonl[,tensorboard]; "" = jsonl, plus
                               # tensorboard (DIR/tensorboard) when tensorboardX is installed
  c.quiet = False              # no progress bar (terminal) or progress lines (otherwise)
  c.deterministic = -1         # XLA's deterministic GPU ops (bit-exact replay); -1: on for
                               # runtime=simulated, off otherwise; 0: off; 1: on

  c.budget = ml_collections.ConfigDict()
  c.budget.tokens = 600_000    # tokens of all applied inner steps; 0 = none
  c.budget.sim_seconds = 0.0   # simulated seconds; 0 = none

  c.model = ml_collections.ConfigDict()
  c.model.d_model = 128
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.context = 128
  c.model.compute_dtype = "float32"  # float32 | bfloat16 (matmuls and activations; the
                                     # parameters, optimizer states and outer step stay float32)

  c.data = ml_collections.ConfigDict()
  c.data.source = "synthetic"  # synthetic | text_dir | jsonl | tfds
  c.data.path = ""
  c.data.languages = ""        # comma-separated; "" = all the source has
  c.data.partition = "non_iid"  # non_iid | iid | dirichlet
  c.data.dirichlet_alpha = 1.0
  c.data.val_sequences_per_language = 16
  c.data.max_bytes_per_language = 0  # 0 = no cap (synthetic: its default size)
  c.data.tokenizer = "bytes"   # bytes | a BPE vocabulary's tokenizer.json (heloco-jax corpus bpe)

  c.inner = ml_collections.ConfigDict()
  c.inner.learning_rate = 3e-3
  c.inner.warmup_steps = 20
  c.inner.total_steps = 2_000
  c.inner.min_learning_rate_ratio = 0.1
  c.inner.weight_decay = 0.1
  c.inner.grad_clip = 1.0
  c.inner.reset_optimizer = -1  # -1: the method's default; 0: keep; 1: reset at dispatch
  c.inner.pseudo_sync_prob = 0.2
  c.inner.pseudo_sync_rate = 0.5
  c.inner.palsgd_coins = "shared"  # shared (the authors' code: all workers pseudo-sync on the
                                   # same steps) | independent (a coin per worker)

  c.outer = ml_collections.ConfigDict()
  c.outer.learning_rate = 0.0  # 0 = the method's default (ALGORITHMS.md)
  c.outer.momentum = 0.9
  c.outer.weighting = "constant"
  c.outer.buffer_size = 0      # delayed_nesterov N; 0 = num_workers
  c.outer.dn_c = 0.0
  c.outer.keep_threshold = 0.2
  c.outer.bad_threshold = -0.2
  c.outer.shrink_strength = 0.5
  c.outer.max_shrink = 0.5
  c.outer.rotate_strength = 1.0
  c.outer.confidence_scale = 3.0
  c.outer.rotate_schedule = "normalized"
  c.outer.weight_order = "before"
  c.outer.scope = "leaf"

  # Fault injection (tests): worker `worker` sends a pseudo-gradient with a NaN
  # (or Inf) at its `arrival`-th arrival; the server must reject it.
  c.fault = ml_collections.ConfigDict()
  c.fault.worker = -1          # -1 = off
  c.fault.arrival = 1
  c.fault.value = "nan"        # nan | inf
  c.fault.kill_worker = -1     # runtime="ray": kill this worker's actor at its `arrival`-th arrival

  # runtime="devices" (DESIGN.md, "Runtimes"): real devices and the real clock
  # (speeds and jitter are then unused; slowdown gives controlled heterogeneity).
  c.devices = ml_collections.ConfigDict()
  c.devices.group_sizes = ""   # "" = jax.devices() split evenly; or K sizes, e.g. "1,1,2,4"
  c.devices.server = 0         # index into jax.devices() of the outer step's device
  c.devices.slowdown = ""      # "" = none; or K factors >= 1 (worker i waits (f_i - 1)x its compute)

  # Synchronous methods on runtime="devices" across processes (jax.distributed): every
  # process runs the same command; process 0 writes the workdir, process i DIR/process_i.
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator = ""  # "" = one process; "auto" = detect (Cloud TPU, SLURM); HOST:PORT
  c.distributed.num_processes = 0  # with HOST:PORT: how many processes
  c.distributed.process_id = -1    # with HOST:PORT: this process's index

  # runtime="ray": a parameter-server actor and one actor per worker (heloco_jax.runtime.ray).
  c.ray = ml_collections.ConfigDict()
  c.ray.address = ""           # "" = start a local Ray instance; "auto" or "HOST:6379" = join one
  c.ray.num_cpus = 0           # a local instance's CPUs; 0 = all of this machine's
  c.ray.cpus_per_worker = 0.0  # resources each worker actor reserves; 0 = Ray's default
  c.ray.gpus_per_worker = 0.0
  c.ray.server_gpus = 0.0      # the parameter server's GPUs (0: it runs on its node's CPU)
  c.ray.log_to_driver = False  # the actors' stdout/stderr in this terminal
  c.ray.max_restarts = 3       # restarts of a worker actor that died (its task runs again)

  c.comm = ml_collections.ConfigDict()
  c.comm.latency = 0.0         # seconds per message or all-reduce
  c.comm.bandwidth = 0.0       # bytes per second; 0 = free transfers
  c.comm.ddp_overlap = 0.0     # fraction of a DDP step's compute its all-reduce hides behind,
                               # [0, 1); 2/3 ~ PyTorch DDP (all-reduce during the backward pass)
  return c
