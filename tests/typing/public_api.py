"""Type-checked by `.ci/run` (`pyright tests/typing`), never run: the public API as a user's
type checker sees it (heloco_jax ships py.typed). Each line is something a user writes; an
error here means the annotations of the public API are wrong or missing."""

import asyncio
from typing import Any

import jax
import jax.numpy as jnp
import optax

import heloco_jax as hj


def outer_rules(params: dict[str, jax.Array], pseudo_grads: dict[str, jax.Array]) -> None:
  for tx in (hj.heloco(learning_rate=0.7, momentum=0.9, num_workers=5),
             hj.mla(0.7, num_workers=5), hj.async_nesterov(0.07, num_workers=5),
             hj.delayed_nesterov(0.07, buffer_size=5, num_workers=5)):
    state = tx.init(params)
    updates, state = tx.update(pseudo_grads, state, params, staleness=2)
    new_params = optax.apply_updates(params, updates)
    del new_params
  chained: optax.GradientTransformation = optax.chain(optax.clip_by_global_norm(1.0),
                                                      hj.heloco(num_workers=5))
  start: Any = hj.lookahead_params(chained.init(params), params)
  weight: float = float(hj.arrival_weight(3, num_workers=5, weighting="constant"))
  del start, weight


def engine(params: dict[str, jax.Array], data: list[list[dict[str, jax.Array]]]) -> float:
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  writer = hj.TensorBoardWriter("/tmp/tb")
  result: hj.SimulationResult = hj.simulate(
      loss_fn, params, data, method="heloco", inner_steps=20, speeds="severe",
      budget=hj.Budget(steps=1000, eval_every_steps=100), inner_tx=hj.inner_adamw(),
      on_row=writer, comm=hj.CommModel(latency=0.25, ddp_overlap=2 / 3))
  writer.close()
  rows: list[dict[str, Any]] = result.history
  del rows
  return float(result.summary["final_val_loss"])


def engines(params: dict[str, jax.Array], data: list[list[dict[str, jax.Array]]]) -> None:
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  engine = hj.make_engine(
      loss_fn, params, data, method="mla",
      method_options={"learning_rate": 0.5, "lookahead_dispatch": True, "dylu": False},
      budget=hj.Budget(tokens=1_000_000, tokens_per_step=4 * 128, eval_every_tokens=100_000),
      runtime=hj.simulated_runtime(),
      syncer=hj.Syncer(grace_window=1.0),
      streaming=hj.Streaming(fragments=2, layout="strided", overlap_steps=1, alpha=0.5),
      workdir=hj.Workdir("/tmp/run", checkpoint_every=5, keep_checkpoints=2),
      on_row=lambda row: None, handle_signals=True)
  with hj.stop_on_signals(engine):
    summary: dict[str, Any] = asyncio.run(engine.run(on_row=lambda row: None))
  again: dict[str, Any] = asyncio.run(engine.run())  # make_engine's on_row and signals
  rows: list[dict[str, Any]] = engine.rows
  final: Any = engine.params
  engine.request_stop("a reason")
  engine.close()
  del summary, again, rows, final
  for runtime in (None, hj.simulated_runtime(), hj.devices_runtime(batch_size=8),
                  hj.ray_runtime(num_cpus=4)):
    hj.simulate(loss_fn, params, data, budget=hj.Budget(sim_seconds=60.0), runtime=runtime,
                workdir="/tmp/run", handle_signals=True)
  palsgd: hj.SimulationResult = hj.simulate(
      loss_fn, params, data, method="palsgd", budget=hj.Budget(steps=1000),
      inner_tx=hj.palsgd_inner(optax.identity(), 0.02, pseudo_sync_prob=0.2),
      method_options={"coins": "independent", "warmup_steps": 10},
      streaming=None, syncer=None, workdir=hj.Workdir("/tmp/palsgd"))
  del palsgd
  budget: hj.Budget = hj.Budget(steps=100)
  streaming: hj.Streaming = hj.Streaming(fragments=2)
  del budget, streaming


def server(params: dict[str, jax.Array], delta: dict[str, jax.Array]) -> None:
  srv = hj.Server(hj.heloco(num_workers=5), params)
  start = srv.dispatch(worker=0)
  srv.apply(delta, staleness=1)
  new_params, outer_state = srv.get()
  del start, new_params, outer_state


def errors() -> tuple[type[Exception], ...]:
  return (hj.BudgetError, hj.DivergenceError, hj.DeterminismError, hj.WorkdirError,
          hj.Stopped)
