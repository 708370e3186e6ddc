"""What the processes of a ``jax.distributed`` run agree on before any step.

docs/FAILURES.md, "Several processes". A process that refuses its part of a run (a link at
``DIR/process_i``, another config) must not leave the others waiting in a collective that
never completes. So each such check ends with ``exchange``: every process publishes a short
text in the coordination service's key-value store (the one ``jax.distributed`` starts)
and reads every other process's, each read bounded by ``timeout_s``; a process that does
not answer in time is named, and so is one that refused.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, Optional

import jax

# A run exchanges a few values at its start; each exchange gets keys of its own.
_ROUNDS = itertools.count()
TIMEOUT_S = 120.0


class ProcessesError(RuntimeError):
  """The processes of a ``jax.distributed`` run disagree, or one did not answer in time."""


def _client():
  from jax._src import distributed  # pylint: disable=g-import-not-at-top  (JAX's own KV store)
  client = distributed.global_state.client
  if client is None:
    raise ProcessesError("jax.distributed is not initialised; allowed: "
                         "config.distributed.coordinator set on every process")
  return client


def exchange(name: str, value: str, timeout_s: float = TIMEOUT_S) -> list[str]:
  """Every process's ``value`` for ``name``, in process order (``[value]`` alone).

  Raises:
    ProcessesError: a process did not publish its value within ``timeout_s`` (it died, or
      refused the run before this point without publishing), naming it.
  """
  if jax.process_count() == 1:
    return [value]
  client, me = _client(), jax.process_index()
  key = f"heloco_jax/{next(_ROUNDS)}/{name}"
  client.key_value_set(f"{key}/{me}", value)
  values = []
  for i in range(jax.process_count()):
    if i == me:
      values.append(value)
      continue
    try:
      values.append(client.blocking_key_value_get(f"{key}/{i}", int(timeout_s * 1000)))
    except Exception:  # pylint: disable=broad-except  (XlaRuntimeError: DEADLINE_EXCEEDED, …)
      raise ProcessesError(
          f"process {i} of {jax.process_count()} did not reach '{name}' within "
          f"{timeout_s:g} s (it stopped, or was started with other arguments); this "
          f"process {me} stops too") from None
  return values


def agree(name: str, error: Optional[BaseException], timeout_s: float = TIMEOUT_S) -> None:
  """Raises on every process when any process had ``error`` at the check ``name``.

  This process's own ``error`` is raised as it is; another's as ``ProcessesError``
  naming that process and its one-line message.
  """
  first_line = "" if error is None else (str(error).splitlines() or [type(error).__name__])[0]
  try:
    values = exchange(name, first_line or ("" if error is None else type(error).__name__),
                      timeout_s)
  except ProcessesError:
    if error is not None:
      raise error from None
    raise
  if error is not None:
    raise error
  for i, message in enumerate(values):
    if message:
      raise ProcessesError(f"process {i} refused the run at '{name}': {message}")


def check_same(name: str, value: str, timeout_s: float = TIMEOUT_S) -> None:
  """Raises ``ProcessesError`` on every process unless every process has the same
  ``value`` for ``name`` (e.g. a hash of the resolved config), naming the ones that differ."""
  values = exchange(name, value, timeout_s)
  differing = [i for i, v in enumerate(values) if v != values[0]]
  if differing:
    raise ProcessesError(
        f"the processes' {name} differ: process{'es' if len(differing) > 1 else ''} "
        f"{', '.join(map(str, differing))} against process 0; allowed: the same command "
        "on every process but config.distributed.process_id")


PEER_TIMEOUT_S = 30.0
_DONE = "done"
_finished = threading.Event()


def finished() -> None:
  """Tells the other processes' watchers that this one ended on purpose (``watch_peers``)."""
  if jax.process_count() == 1 or _finished.is_set():
    return
  _finished.set()
  try:
    _client().key_value_set(f"heloco_jax/alive/{jax.process_index()}", _DONE,
                            allow_overwrite=True)
  except Exception:  # pylint: disable=broad-except  (the service is gone already)
    pass


def watch_peers(on_silent: Callable[[str], None], interval_s: float = 2.0,
                timeout_s: float = PEER_TIMEOUT_S) -> Optional[threading.Thread]:
  """Starts a daemon thread that publishes this process's heartbeat in the coordination
  service and calls ``on_silent(message)`` once when another process's heartbeat is older
  than ``timeout_s`` (it was killed) or the service stops answering (process 0 died).

  JAX's own heartbeat ends the survivors after 100 s with a C++ abort and no word of who
  died; this names the process first, so that the run can stop in one line with its last
  checkpoint intact (docs/FAILURES.md, "Several processes"). None in a run of one process.
  """
  if jax.process_count() == 1:
    return None
  client, me, n = _client(), jax.process_index(), jax.process_count()

  def beat() -> None:
    seen = {i: (None, time.monotonic()) for i in range(n) if i != me}
    count = 0
    while not _finished.is_set():
      count += 1
      try:
        client.key_value_set(f"heloco_jax/alive/{me}", str(count), allow_overwrite=True)
        for i in seen:
          try:
            value = client.key_value_try_get(f"heloco_jax/alive/{i}")
          except Exception as error:  # pylint: disable=broad-except
            if "NOT_FOUND" not in str(error):  # not yet published: the peer is starting
              raise
            value = None
          if value != seen[i][0]:
            seen[i] = (value, time.monotonic())
      except Exception:  # pylint: disable=broad-except  (the service is gone)
        if not _finished.is_set():
          on_silent(f"process 0 (the coordinator) stopped answering; process {me} stops too")
        return
      now = time.monotonic()
      silent = [i for i, (value, since) in seen.items()
                if value != _DONE and now - since > timeout_s]
      if _finished.is_set():
        return
      if silent:
        on_silent(f"process {silent[0]} of {n} sent no heartbeat for {timeout_s:g} s (it "
                  f"stopped or was killed); process {me} stops too")
        return
      time.sleep(interval_s)

  thread = threading.Thread(target=beat, name="heloco_jax-peers", daemon=True)
  thread.start()
  return thread
