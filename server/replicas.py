"""Data-parallel replicas: N engines behind one server, each request routed to the least-loaded one.

Replica 0 is the server's own `LLM`, on its `EngineWorker` thread as with one replica. Replicas
1..N-1 are child processes (spawned, so each has its own interpreter, GIL, torch thread pool and
model copy); each rebuilds the `LLM` from the server's `LLM.init_args` and runs the same `EngineWorker`
there, whose updates travel back over a pipe (`_ChildLoop`). In the server process a `RemoteReplica`
stands in for each child with `EngineWorker`'s interface, and `ReplicaPool` — also with that interface,
so the rest of the server does not know how many engines there are — routes:

- a new request goes to the live replica with the fewest requests in flight (ties: the one that has
  served fewest, so requests that each finish before the next arrives still spread), except that a websocket
  session sticks to the replica of its first request while that replica lives (its next turns find
  what the engine learnt from the earlier ones — the suffix drafter's index — warm). HTTP clients are
  not pinned: many of them share one peer address (a proxy, a benchmark), which would pin them all;
- otherwise a prompt goes where its first tokens went before (a hash of its first
  `PREFIX_AFFINITY_TOKENS`: a shared system prompt, a chat's history), since that replica's prefix
  cache most likely still holds their KV — unless it has more than `PREFIX_AFFINITY_SLACK` requests in
  flight beyond the least-loaded replica (load first: a cached prefix saves a prefill, a queue costs more);
- cancels go to the request's replica; `cancel_all` and `stop` go to every replica;
- a replica that dies (its process exits or its pipe breaks) ends each of its requests with an "error"
  summary naming it, is skipped from then on, and shows as dead in /health and /metrics — the others
  go on.

`call(fn)` (tests, soak checks) runs on replica 0 only: functions do not cross processes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections import Counter, OrderedDict

from specserve.server.engine_load import EngineLoad
from specserve.server.engine_worker import EngineWorker, Summary, Update, _dispatch

log = logging.getLogger("specserve.server")

READY_TIMEOUT_S = 300.0
_MAX_STICKY_CLIENTS = 4096
PREFIX_AFFINITY_TOKENS = 64  # the prompt's first blocks (4 of the default 16 tokens) that route it
PREFIX_AFFINITY_SLACK = 4  # in-flight requests a prefix's replica may have above the least loaded and still get it
_MAX_PREFIXES = 4096
SESSION_PREFIX = "sess_"  # websocket sessions' client ids (session.py)


class _ChildLoop:
    """What a child's `EngineWorker` takes for an event loop: each batch of (sink, update) pairs a step
    produced goes over the pipe as one message ([(request_id, update)], load)."""

    def __init__(self, conn, worker_ref: list) -> None:
        self.conn, self.worker_ref = conn, worker_ref
        self.lock = threading.Lock()  # the engine thread and the command reader both send

    def call_soon_threadsafe(self, fn, out) -> None:
        worker = self.worker_ref[0]
        self.send(("updates", [u for _, u in out], worker.load if worker is not None else None))

    def send(self, message) -> None:
        with self.lock:
            self.conn.send(message)


def _replica_main(conn, llm_args: dict, index: int) -> None:
    """A child replica: build the LLM, warm it up, run an EngineWorker, apply the parent's commands until "stop"."""
    import torch

    from specserve.llm import LLM

    device = str(llm_args.get("device", "auto"))
    if device in ("auto", "cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        # One GPU per replica where there are several (replica 0, the server's own, keeps cuda:0).
        llm_args = {**llm_args, "device": f"cuda:{index % torch.cuda.device_count()}"}
    try:
        llm = LLM(**llm_args)
        # As `specserve serve` does for replica 0 before it listens: "ready" means ready to answer, not ready
        # to spend its first requests compiling kernels (a fresh install: a minute on two cores).
        llm.warm_up()
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    worker_ref: list = [None]
    loop = _ChildLoop(conn, worker_ref)
    worker = EngineWorker(llm.engine, loop, name=f"specserve-engine-{index}")
    worker_ref[0] = worker
    worker.start()
    loop.send(("ready", os.getpid(), worker.load))
    sink = _no_sink  # updates are sent whole by _ChildLoop; the parent keeps the real sinks
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:  # the server is gone
                break
            kind = cmd[0]
            if kind == "submit":
                rid, prompt_ids, params, speculate, received, parts, client = cmd[1:]
                worker.submit(rid, prompt_ids, params, speculate, received, sink, parts, client)
            elif kind == "cancel":
                worker.cancel(cmd[1])
            elif kind == "cancel_all":
                worker.cancel_all()
            elif kind == "stop":
                break
    finally:
        worker.stop()
        llm.close()


def _no_sink(update: Update) -> None:
    pass


class RemoteReplica:
    """A child replica, seen from the server: `EngineWorker`'s interface over a pipe.

    Sinks stay here (they write to sockets); the child sends each step's updates, which a reader
    thread hands to the event loop in one call, as `EngineWorker` does.
    """

    def __init__(self, index: int, llm_args: dict, loop) -> None:
        self.index, self.loop = index, loop
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_replica_main, args=(child, llm_args, index), daemon=True,
                                   name=f"specserve-replica-{index}")
        self._sinks: dict[str, object] = {}
        self._lock = threading.Lock()  # sinks are added by the loop, removed by the reader thread
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"specserve-replica-{index}-reader", daemon=True)
        self._ready = threading.Event()
        self._dead: str | None = None  # why it died
        self._stopping = False
        self.load = EngineLoad(0, 0, 0, 0)
        self.pid: int | None = None

    @property
    def alive(self) -> bool:
        return self._dead is None and self.process.is_alive()

    def start(self) -> None:
        self.process.start()
        self._reader.start()

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout):
            raise ValueError(f"replica {self.index} did not start within {timeout:.0f} s")
        if self._dead is not None:
            raise ValueError(f"replica {self.index} could not start: {self._dead}")

    def submit(self, request_id, prompt_ids, params, speculate, received, sink, drafter_parts=None, client=None) -> None:
        with self._lock:
            self._sinks[request_id] = sink
        if not self._send(("submit", request_id, list(prompt_ids), params, speculate, received, drafter_parts, client)):
            self._fail([request_id])

    def cancel(self, request_id: str) -> None:
        self._send(("cancel", request_id))

    def cancel_all(self) -> None:
        self._send(("cancel_all",))

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True  # the pipe closing from here on is the stop, not a death
        self._send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._dead = self._dead or "stopped"

    def _send(self, message) -> bool:
        if self._dead is not None:
            return False
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (BrokenPipeError, EOFError, OSError):
            self._died("its pipe broke")
            return False

    # ---- the reader thread ------------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._died(f"its process ended (exit code {self.process.exitcode})" if not self.process.is_alive()
                           else "its pipe closed")
                return
            kind = message[0]
            if kind == "ready":
                self.pid, self.load = message[1], message[2]
                self._ready.set()
            elif kind == "failed":
                self._dead = message[1]
                self._ready.set()
                return
            elif kind == "updates":
                updates, load = message[1], message[2]
                if load is not None:
                    self.load = load
                out = []
                with self._lock:
                    for u in updates:
                        sink = self._sinks.get(u.request_id)
                        if sink is None:
                            continue
                        if u.done is not None:
                            del self._sinks[u.request_id]
                        out.append((sink, u))
                self._deliver(out)

    def _died(self, why: str) -> None:
        if self._dead is None:
            if not self._stopping:
                log.error("replica %d died: %s; failing its %d request(s)", self.index, why, len(self._sinks))
            self._dead = "stopped" if self._stopping else why
        self._ready.set()
        with self._lock:
            rids = list(self._sinks)
        self._fail(rids)

    def _fail(self, rids: list[str]) -> None:
        out = []
        with self._lock:
            for rid in rids:
                sink = self._sinks.pop(rid, None)
                if sink is not None:
                    out.append((sink, Update(rid, "", 0, Summary("error", error=f"replica {self.index} died"))))
        self._deliver(out)

    def _deliver(self, out) -> None:
        if out:
            try:
                self.loop.call_soon_threadsafe(_dispatch, out)
            except RuntimeError:  # the loop has closed
                pass


class ReplicaPool:
    """Several engines with `EngineWorker`'s interface: replica 0 in process, the rest `RemoteReplica`s."""

    def __init__(self, local: EngineWorker, llm_args: dict, count: int, loop) -> None:
        self.replicas: list = [local] + [RemoteReplica(i, llm_args, loop) for i in range(1, count)]
        self._owner: dict[str, object] = {}  # request id -> replica
        self._sticky: OrderedDict[str, object] = OrderedDict()  # websocket session -> its replica
        self._prefix_home: OrderedDict[int, object] = OrderedDict()  # hash of a prompt's first tokens -> replica
        self.served = [0] * count  # requests routed to each replica

    # ---- EngineWorker's interface -----------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return any(r.alive for r in self.replicas)

    @property
    def load(self) -> EngineLoad:
        loads = [r.load for r in self.replicas if r.alive]
        return EngineLoad(*(sum(getattr(x, f) for x in loads) for f in ("waiting", "running", "kv_blocks_total",
                                                                         "kv_blocks_free", "kv_blocks_cached",
                                                                         "kv_blocks_evictable")))

    def start(self, ready_timeout: float = READY_TIMEOUT_S) -> None:
        for r in self.replicas:
            r.start()
        deadline = time.monotonic() + ready_timeout
        for r in self.replicas[1:]:
            r.wait_ready(max(1.0, deadline - time.monotonic()))

    def submit(self, request_id, prompt_ids, params, speculate, received, sink, drafter_parts=None, client=None) -> None:
        replica = self._route(client, prompt_ids)
        self._owner[request_id] = replica
        self.served[self.replicas.index(replica)] += 1

        def finished(update: Update, sink=sink) -> None:
            if update.done is not None:
                self._owner.pop(update.request_id, None)
            sink(update)

        replica.submit(request_id, prompt_ids, params, speculate, received, finished, drafter_parts, client)

    def cancel(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            replica.cancel(request_id)

    def cancel_all(self) -> None:
        for r in self.replicas:
            if r.alive:
                r.cancel_all()

    def call(self, fn):
        """Run ``fn(engine)`` on replica 0's engine thread."""
        return self.replicas[0].call(fn)

    def stop(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.stop(timeout)

    def describe(self) -> list[dict]:
        """Per replica, for /health: index, alive, in-flight requests, load."""
        return [{"replica": i, "alive": r.alive, "pid": os.getpid() if i == 0 else r.pid, "served": self.served[i],
                 "in_flight": self._in_flight(r), "running": r.load.running, "waiting": r.load.waiting}
                for i, r in enumerate(self.replicas)]

    # ---- routing ----------------------------------------------------------------------------------

    def _in_flight(self, replica) -> int:
        return sum(1 for owner in self._owner.values() if owner is replica)

    def _route(self, client: str | None, prompt_ids=()):
        live = [r for r in self.replicas if r.alive]
        if not live:
            return self.replicas[0]  # it answers with its own error (a dead worker's requests fail)
        session = client if client is not None and client.startswith(SESSION_PREFIX) else None
        sticky = self._sticky.get(session) if session is not None else None
        prefix = hash(tuple(prompt_ids[:PREFIX_AFFINITY_TOKENS])) if len(prompt_ids) >= PREFIX_AFFINITY_TOKENS else None
        home = self._prefix_home.get(prefix) if prefix is not None else None
        in_flight = Counter(self._owner.values())  # one walk over the requests in flight, not one per replica
        # Ties on load go to the replica that has served fewest: short requests that each finish before the next
        # arrives leave every replica idle, and "the lowest index" would send them all to replica 0.
        least = min(live, key=lambda r: (in_flight[r], self.served[self.replicas.index(r)]))
        if sticky is not None and sticky.alive:
            choice = sticky
        elif home is not None and home.alive and in_flight[home] <= in_flight[least] + PREFIX_AFFINITY_SLACK:
            choice = home
        else:
            choice = least
        _remember(self._sticky, session, choice, _MAX_STICKY_CLIENTS)
        _remember(self._prefix_home, prefix, choice, _MAX_PREFIXES)
        return choice


def _remember(table: OrderedDict, key, replica, limit: int) -> None:
    """key -> replica, most recent last, the oldest dropped past `limit` (nothing for a None key)."""
    if key is None:
        return
    table[key] = replica
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
