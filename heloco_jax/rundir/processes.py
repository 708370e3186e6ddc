"""What the processes of a ``jax.distributed`` run agree on before any step.

docs/FAILURES.md, "Several processes". A process that refuses its part of a run (a link at
``DIR/process_i``, another config) must not leave the others waiting in a collective that
never completes. So each such check ends with ``exchange``: every process publishes a short
text in the coordination service's key-value store (the one ``jax.distributed`` starts)
and reads every other process's, each read bounded by ``timeout_s``; a process that does
not answer in time is named, and so is one that refused.
"""

from __future__ import annotations

import errno
import itertools
import socket
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


# How long a process waits for its peers at the start (config.distributed.timeout); JAX's own
# wait, jax.distributed.initialize's initialization_timeout, is 300 s and ends in a C++ abort
# that names nobody (docs/FAILURES.md, "Several processes").
ARRIVAL_TIMEOUT_S = 60.0
_HELLO = "heloco_jax roll call"


def _address(coordinator: str) -> tuple[str, int]:
  host, _, port = coordinator.rpartition(":")
  return host.strip("[]"), int(port)


def _line(sock: socket.socket, deadline: float) -> str:
  """One line from ``sock`` (at most 1 KiB) by ``deadline``; '' at its end or at the deadline."""
  data = b""
  while not data.endswith(b"\n") and len(data) < 1024:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
      chunk = sock.recv(1024 - len(data))
    except (socket.timeout, OSError):
      return ""
    if not chunk:
      return ""
    data += chunk
  return data.decode(errors="replace").strip()


def roll_call(coordinator: str, num_processes: int, process_id: int,
              timeout_s: float = ARRIVAL_TIMEOUT_S) -> None:
  """Before ``jax.distributed.initialize``: waits until every process has arrived at
  ``coordinator`` (HOST:PORT), at most ``timeout_s``.

  Process 0 listens at the coordinator's port (JAX's service takes it over afterwards) and
  each other process connects and gives its id and ``num_processes``; when all have come,
  process 0 answers "go" to each. Otherwise every process stops with one line naming the
  missing process ids and the coordinator (JAX's own wait ends in a C++ abort after 300 s
  that names nobody), or the id given twice, or the other ``num_processes``.

  Raises:
    ProcessesError: as above; on process 0 also when something already listens at the port
      (another process 0, whose peers would wait for it forever).
  """
  if process_id == 0:
    _call_the_roll(coordinator, num_processes, timeout_s)
  else:
    _answer_the_roll(coordinator, num_processes, process_id, timeout_s)


def _missing(num_processes: int, arrived: set) -> str:
  missing = [i for i in range(num_processes) if i not in arrived]
  ids = ", ".join(map(str, missing))
  return (f"process{'es' if len(missing) > 1 else ''} {ids} of {num_processes} did not "
          "arrive")


def _call_the_roll(coordinator: str, num_processes: int, timeout_s: float) -> None:
  host, port = _address(coordinator)
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  listener = socket.socket(family, socket.SOCK_STREAM)
  # JAX's service binds [::]:PORT after this socket is closed (peers close first: no TIME_WAIT
  # here); a listener already there (a second process 0, JAX's) still refuses the bind.
  listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  peers: dict[int, list[socket.socket]] = {}
  try:
    try:
      try:
        listener.bind((host, port))
      except OSError as error:  # a name it cannot bind here (behind NAT): any address, as JAX
        if error.errno == errno.EADDRINUSE:
          raise
        listener.bind(("::" if family == socket.AF_INET6 else "", port))
    except OSError as error:
      if error.errno == errno.EADDRINUSE:
        raise ProcessesError(
            f"something already listens at {coordinator} (another process with "
            "config.distributed.process_id=0?); allowed: each process_id once, and a free "
            "port for process 0") from None
      raise ProcessesError(f"config.distributed.coordinator={coordinator!r}: process 0 cannot "
                           f"listen at its port: {error.strerror or error}") from None
    listener.listen(max(8, num_processes))
    deadline = time.monotonic() + timeout_s
    refusal = ""
    while len(peers) < num_processes - 1 and time.monotonic() < deadline:
      listener.settimeout(max(0.01, deadline - time.monotonic()))
      try:
        sock, _ = listener.accept()
      except socket.timeout:
        break
      words = _line(sock, min(deadline, time.monotonic() + 5.0)).split()
      hello = _HELLO.split()
      if words[:len(hello)] != hello or len(words) != len(hello) + 2:
        sock.close()  # not one of ours (a port scanner, a stray client)
        continue
      their_id, their_n = int(words[-2]), int(words[-1])
      peers.setdefault(their_id, []).append(sock)
      if their_n != num_processes:
        refusal = (f"config.distributed.num_processes: process {their_id} gave {their_n}, "
                   f"process 0 {num_processes}; allowed: the same on every process")
        break
      if their_id == 0 or len(peers[their_id]) > 1:
        refusal = (f"config.distributed.process_id={their_id} was given to "
                   f"{len(peers[their_id]) + (their_id == 0)} processes; allowed: each of 0 … "
                   f"{num_processes - 1} once")
        break
    if not refusal and len(peers) < num_processes - 1:
      refusal = (f"{_missing(num_processes, {0, *peers})} at the coordinator {coordinator} "
                 f"within {timeout_s:g} s (config.distributed.timeout={timeout_s:g}): it was not "
                 "started, stopped, or was given another coordinator")
    answer = f"refused {refusal}" if refusal else "go"
    for sock in (sock for socks in peers.values() for sock in socks):
      try:
        sock.sendall(answer.encode() + b"\n")
      except OSError:
        pass
    if refusal:
      raise ProcessesError(f"{refusal}; this process 0 stops too")
    for sock in (sock for socks in peers.values() for sock in socks):
      _line(sock, time.monotonic() + 5.0)  # until the peer closes first
  finally:
    for sock in (sock for socks in peers.values() for sock in socks):
      sock.close()
    listener.close()


def _answer_the_roll(coordinator: str, num_processes: int, process_id: int,
                     timeout_s: float) -> None:
  host, port = _address(coordinator)
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      sock = socket.create_connection((host, port),
                                      timeout=max(0.1, deadline - time.monotonic()))
      break
    except OSError:
      if time.monotonic() >= deadline:
        raise ProcessesError(
            f"process 0 (the coordinator) did not answer at {coordinator} within {timeout_s:g} s "
            f"(config.distributed.timeout={timeout_s:g}): it was not started, stopped, or was "
            f"given another coordinator; this process {process_id} stops too") from None
      time.sleep(0.2)
  with sock:
    sock.sendall(f"{_HELLO} {process_id} {num_processes}\n".encode())
    # Process 0 answers by its own deadline, at most timeout_s after it began to listen.
    answer = _line(sock, time.monotonic() + timeout_s + 10.0)
  if answer == "go":
    return
  if answer.startswith("refused "):
    raise ProcessesError(f"process 0 refused the run: {answer[len('refused '):]}; this "
                         f"process {process_id} stops too")
  raise ProcessesError(f"process 0 (the coordinator at {coordinator}) stopped before every "
                       f"process arrived; this process {process_id} stops too")


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
