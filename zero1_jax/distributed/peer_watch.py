"""Which process of a multi-process job died: :class:`PeerWatch`.

Public as ``z1.distributed.PeerWatch``; the CLI's peers module runs one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import jax

log = logging.getLogger("zero1_jax")


class PeerWatch:
  """Which process of the job died, told within seconds.

  After a peer is killed, a survivor's next collective fails at once
  ("Gloo ... Connection reset by peer") but does not say which process is
  gone, and exiting normally waits in ``jax.distributed.shutdown`` for the
  dead peer until the heartbeat timeout (100 s), then aborts with a C++
  trace. Each process publishes ``host pid`` in the job's key-value store
  (in process 0's coordination service) and bumps a counter every
  ``tick_s``; :meth:`dead` names the peers that are gone: a pid on this host
  that no longer runs (certain, at once), a counter that stopped for
  ``stale_s``, or process 0 when the store itself stopped answering.

  Example::

    watch = z1.distributed.PeerWatch.start()
    try:
      train()
    except Exception:
      dead = watch.dead() if watch else []
      if dead:
        print(f"process {dead[0]} died"); os._exit(1)   # not the 100 s wait
      raise
  """

  PREFIX = "zero1_jax/peers"

  def __init__(self, client, rank: int, count: int, *, tick_s: float = 1.0,
               stale_s: float = 5.0):
    self.client, self.rank, self.count = client, rank, count
    self.tick_s, self.stale_s = tick_s, stale_s
    self.peers: dict[int, tuple[str, int]] = {}   # rank -> (host, pid)
    self._seen: dict[int, tuple[str, float]] = {}  # rank -> (tick, when seen)
    self.store_down_since: float | None = None
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self.on_dead = None   # called from the watch thread: on_dead(ranks)
    self.grace_s = 3.0    # ... once a peer is dead this long (errors first)
    self._dead_since: float | None = None
    client.key_value_set(f"{self.PREFIX}/who/{rank}",
                         f"{socket.gethostname()} {os.getpid()}",
                         allow_overwrite=True)
    self._thread = threading.Thread(target=self._run, daemon=True,
                                    name="zero1-peer-watch")
    self._thread.start()

  @classmethod
  def start(cls, **kwargs) -> "PeerWatch | None":
    """A watch for this job; None for one process, or where this jax has no
    key-value store to use (said in the log)."""
    if jax.process_count() < 2:
      return None
    try:
      from jax._src import distributed as jax_distributed
      client = jax_distributed.global_state.client
      if client is None:
        return None
      return cls(client, jax.process_index(), jax.process_count(), **kwargs)
    except Exception as e:  # noqa: BLE001 - a private API of jax moved
      log.warning("cannot watch the other processes (%s): a dead process is "
                  "noticed only after the heartbeat timeout", e)
      return None

  def stop(self) -> None:
    self._stop.set()

  def _run(self) -> None:
    tick = 0
    while not self._stop.wait(self.tick_s):
      tick += 1
      try:
        self.client.key_value_set(f"{self.PREFIX}/tick/{self.rank}", str(tick),
                                  allow_overwrite=True)
        self._read()
        self.store_down_since = None
      except Exception:  # noqa: BLE001 - the store (process 0) is gone
        if self.store_down_since is None:
          self.store_down_since = time.monotonic()
      if self.on_dead is not None and not self._stop.is_set():
        dead = self.dead(wait_s=0.0)
        now = time.monotonic()
        if not dead:
          self._dead_since = None
        elif self._dead_since is None:
          self._dead_since = now
        elif now - self._dead_since >= self.grace_s:
          self.on_dead(dead)

  def _read_peers(self) -> None:
    for key, value in self.client.key_value_dir_get(f"{self.PREFIX}/who/"):
      r = int(key.rsplit("/", 1)[1])
      if r != self.rank:
        host, pid = value.rsplit(" ", 1)
        self.peers[r] = (host, int(pid))

  def _read(self) -> None:
    now = time.monotonic()
    if len(self.peers) < self.count - 1:
      self._read_peers()
    for key, value in self.client.key_value_dir_get(f"{self.PREFIX}/tick/"):
      r = int(key.rsplit("/", 1)[1])
      with self._lock:
        if self._seen.get(r, (None,))[0] != value:
          self._seen[r] = (value, now)

  def dead(self, wait_s: float = 0.0) -> list[int]:
    """The ranks known dead, waiting up to ``wait_s`` for one to show."""
    deadline = time.monotonic() + wait_s
    while True:
      if len(self.peers) < self.count - 1:
        # Asked before the watch's first tick read who the peers are (a
        # SIGTERM soon after start): read them now, or none is known dead.
        try:
          self._read_peers()
        except Exception:  # noqa: BLE001 - the store is gone: ticks decide
          pass
      found = self._dead_now()
      if found or time.monotonic() >= deadline:
        return found
      time.sleep(min(0.25, self.tick_s))

  def _dead_now(self) -> list[int]:
    here = socket.gethostname()
    gone = [r for r, (host, pid) in sorted(self.peers.items())
            if host == here and not _running(pid)]
    if gone:
      return gone
    now = time.monotonic()
    if (self.rank != 0 and self.store_down_since is not None
        and now - self.store_down_since >= self.stale_s):
      return [0]       # the coordination service ran in process 0
    with self._lock:
      return [r for r, (_, when) in sorted(self._seen.items())
              if r != self.rank and r in self.peers
              and self.peers[r][0] != here and now - when >= self.stale_s]


def _running(pid: int) -> bool:
  """Whether ``pid`` (on this host) runs: not gone, not a zombie."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
  except OSError:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    except OSError:
      pass
    return not os.path.isdir("/proc/self")   # /proc exists: pid is gone
