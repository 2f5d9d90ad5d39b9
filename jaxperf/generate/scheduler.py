"""Continuous batching over replicas: each replica owns a Generator and a decode state of `slots` rows on its devices.

    sched = Scheduler([gen0, gen1], slots=8, chunk=8)          # one replica per Generator (per device or sub-mesh)
    sched.start()
    sched.submit(Request(prompt_ids, max_tokens=64, ..., deliver=callback))   # least loaded replica takes it
    sched.metrics()                                             # totals and per-replica counters

A replica is one worker thread that loops over chunk boundaries:

1. Requests that were cancelled (the client went away) or passed their deadline are answered and leave: a waiting
   one at once, a running one by freeing its slot (the row is marked done in the next decode call).
2. Admission (continuous batching): waiting requests take free slots, oldest first. Their prompts are prefilled
   together in one `Generator.insert` call, padded to one (rows, prompt) bucket and capped at `prefill_budget`
   padded tokens, so a burst of long prompts cannot stall the running rows for long; the rest wait for the next
   boundary. Prefill thus interleaves with decode at chunk boundaries: running rows pause for one insert call.
3. One `Generator.decode` call of up to `chunk` steps over every slot. When requests are waiting it returns as soon
   as some row finishes (`exit_on_finish`), so a freed slot is refilled at the next step, not at the end of the
   chunk: a long request never holds back a short one that arrived later while a slot is free.
4. Each running request gets its new tokens (and text); one that finished (stop token, budget, cache full, or a stop
   string) gets its final answer and its slot is free for the next admission.

With `batching="static"` the same worker behaves like the server before continuous batching: it waits up to
`batch_window_s` to fill the slots, then decodes that batch until every request in it is done before admitting
anyone else (kept as the baseline the benchmarks compare against).

Determinism: a request's t-th token is drawn with fold_in(fold_in(key(seed), 0), t), whatever its slot, replica or
neighbours, so its tokens equal `Generator.generate([prompt], ..., seed=[seed])` run alone.

Failures stay with their request where they can: an insert that fails is retried one request at a time and only the
request that fails again gets the error; a decode call that fails (it serves every running request) fails those
requests and the replica starts over with a fresh state. Every failure is counted in the metrics.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxperf import _compat
from jaxperf.generate.cache import bucket
from jaxperf.generate.engine import Generator, TextStream


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request as a replica sees it (its settings already validated by the server).

    `deliver(event)` is called from the replica's thread with every event: {"tokens": [...], "text": piece} as tokens
    arrive, then one final {"done": True, ...} or {"error": message, "status": code, "done": True}.
    """

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    deliver: Callable[[dict], None]
    stop: tuple[str, ...] = ()  # text that ends the answer (not included), checked on the host
    timeout_s: float | None = None
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:16])
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    # Filled in by the replica.
    replica: int = -1
    slot: int = -1
    started: float | None = None
    first_token: float | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Ask the replica to drop this request (the client went away); its slot is freed at the next boundary."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self, now: float) -> bool:
        return self.timeout_s is not None and now - self.arrived > self.timeout_s


class _Output:
    """A request's text as it grows: pieces to send (holding back what could be the start of a stop string) and
    whether a stop string was reached (the text is cut before it)."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.stream, self.stop = TextStream(tokenizer), stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending, self.sent, self.stopped = "", "", False

    def _release(self, final: bool) -> str:
        cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            piece, self.stopped, self.pending = self.pending[:cut], True, ""
        elif final or not self.hold:
            piece, self.pending = self.pending, ""
        else:
            keep = len(self.pending) - self.hold
            piece, self.pending = (self.pending[:keep], self.pending[keep:]) if keep > 0 else ("", self.pending)
        self.sent += piece
        return piece

    def push(self, ids: list[int]) -> str:
        self.pending += self.stream.push(ids)
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self.pending += self.stream.finish()
        return self._release(final=True)


class _Counters:
    # received: routed here; requests: admitted into a slot (prefilled); completed: answered in full.
    FIELDS = ("received", "requests", "completed", "failed", "timeouts", "cancelled", "tokens_generated",
              "prompt_tokens", "decode_calls", "decode_steps", "prefill_calls", "rows_decoded")

    def __init__(self, slots: int):
        self.lock = threading.Lock()
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.decode_s = 0.0
        self.prefill_s = 0.0
        self.slot_uses = [0] * slots

    def add(self, **counts):
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)


class Replica:
    """One worker thread owning a Generator and `slots` decode rows (see the module docstring)."""

    def __init__(self, index: int, generator: Generator, *, slots: int = 8, max_len: int | None = None,
                 chunk: int = 8, batching: str = "continuous", batch_window_s: float = 0.01,
                 prefill_budget: int = 2048):
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching={batching!r}: choose 'continuous' or 'static'")
        if not 1 <= chunk <= generator.max_chunk:
            raise ValueError(f"chunk={chunk} must lie in [1, {generator.max_chunk}] (the Generator's max_chunk)")
        if slots < 1 or batch_window_s < 0 or prefill_budget < 1:
            raise ValueError(f"slots={slots} and prefill_budget={prefill_budget} must be >= 1, "
                             f"batch_window_s={batch_window_s} >= 0")
        self.index, self.gen = index, generator
        self.slots = generator.rows_for(slots)
        self.max_len = int(max_len or generator.cfg.max_seq_len)
        if not 2 <= self.max_len <= generator.cfg.max_seq_len:
            raise ValueError(f"max_len={self.max_len} must lie in [2, {generator.cfg.max_seq_len}] "
                             f"(model.max_seq_len)")
        self.chunk, self.batching, self.window, self.prefill_budget = chunk, batching, batch_window_s, prefill_budget
        self.counters = _Counters(self.slots)
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: dict[int, Request] = {}
        self._texts: dict[int, _Output] = {}
        self._to_cancel: set[int] = set()
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._state = None

    # ------------------------------------------------------------------------------------------------------------
    @property
    def load(self) -> int:
        """Requests held: running plus waiting (what the scheduler balances)."""
        with self._cond:
            return len(self._active) + len(self._waiting)

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    def submit(self, request: Request) -> None:
        request.replica = self.index
        self.counters.add(received=1)
        with self._cond:
            self._waiting.append(request)
            self._cond.notify()

    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name=f"jaxperf-replica-{self.index}", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 60) -> None:
        if self._thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify()
            self._thread.join(timeout=timeout)
            self._thread = None
        for r in list(self._active.values()) + list(self._waiting):
            self._fail(r, "the server is shutting down", 503)
        self._active.clear()
        self._waiting.clear()

    def warmup(self, prompt_lengths: Sequence[int] = (8,)) -> float:
        """Compile this replica's programs before serving; returns the seconds spent compiling.

        An empty state, an insert for every admission size (1, 2, 4, ... up to the slots) of each prompt length's
        bucket, and decode. Call before `start`, or while no request is in flight.
        """
        before = self.gen.compile_s
        state = self.gen.new_state(self.slots, self.max_len)
        for length in sorted({min(bucket(n, 8), self.max_len - 1) for n in prompt_lengths}):
            n = 1
            while True:
                rows = min(n, self.slots)
                state = self.gen.insert(state, [[1] * length] * rows, list(range(rows)), seeds=[0] * rows,
                                        temperature=[0.0] * rows, top_k=[0] * rows, top_p=[1.0] * rows,
                                        max_tokens=[2] * rows)
                if rows == self.slots:
                    break
                n *= 2
        self.gen.decode(state, self.chunk)
        return self.gen.compile_s - before

    def metrics(self) -> dict[str, Any]:
        c = self.counters
        with c.lock:
            out = {f: getattr(c, f) for f in c.FIELDS}
            out.update(decode_s=c.decode_s, prefill_s=c.prefill_s, slot_uses=list(c.slot_uses))
        with self._cond:
            out.update(active=len(self._active), queue_depth=len(self._waiting))
        out.update(replica=self.index, slots=self.slots, max_len=self.max_len, batching=self.batching,
                   devices=[str(d) for d in self.gen.mesh.devices.flat], compile_s=self.gen.compile_s,
                   mean_rows_per_step=c.rows_decoded / c.decode_steps if c.decode_steps else 0.0,
                   decode_tokens_per_s=c.tokens_generated / c.decode_s if c.decode_s else 0.0)
        return out

    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _send(r: Request, event: dict) -> bool:
        try:
            r.deliver(event)
            return True
        except Exception:  # noqa: BLE001 - the client's side is gone (its event loop closed): drop the request
            r.cancel()
            return False

    def _fail(self, r: Request, message: str, status: int) -> None:
        self._send(r, {"error": message, "status": status, "done": True})

    def _finish(self, slot: int, reason: str) -> None:
        r = self._active.pop(slot)
        out = self._texts.pop(slot)
        tail = out.finish()
        if tail:
            self._send(r, {"tokens": [], "text": tail})
        tokens = r.tokens
        if out.stopped:  # a stop string: the answer ends before it, and so do its tokens
            reason = "stop"
            while tokens and len(self.gen.tokenizer.decode(np.asarray(tokens, np.int64))) > len(out.sent):
                tokens = tokens[:-1]
        text = out.sent if self.gen.tokenizer is not None else None
        now = time.perf_counter()
        self._send(r, {
            "done": True, "text": text, "tokens": tokens, "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": len(tokens), "finish_reason": reason, "replica": self.index, "slot": slot,
            "queue_s": (r.started or now) - r.arrived, "ttft_s": (r.first_token or now) - r.arrived,
            "latency_s": now - r.arrived, "batch_size": len(self._active) + 1,
        })
        self.counters.add(completed=1)

    def _drop(self, slot: int, message: str, status: int, counter: str) -> None:
        r = self._active.pop(slot)
        self._texts.pop(slot, None)
        self._to_cancel.add(slot)
        self._fail(r, message, status)
        self.counters.add(**{counter: 1})

    def _timeout_message(self, r: Request) -> str:
        return (f"the request did not finish within {r.timeout_s:g} s (the server's request timeout): "
                f"{len(r.tokens)} of {r.max_tokens} tokens were generated; ask for fewer tokens or retry later")

    def _sweep(self) -> None:
        """Answer and remove cancelled and timed-out requests, waiting or running."""
        now = time.perf_counter()
        with self._cond:
            keep = collections.deque()
            gone = []
            for r in self._waiting:
                (gone if r.cancelled or r.expired(now) else keep).append(r)
            self._waiting = keep
        for r in gone:
            if r.cancelled:
                self.counters.add(cancelled=1)
            else:
                self._fail(r, self._timeout_message(r), 504)
                self.counters.add(timeouts=1)
        for slot, r in list(self._active.items()):
            if r.cancelled:
                self._drop(slot, "cancelled", 499, "cancelled")
            elif r.expired(now):
                self._drop(slot, self._timeout_message(r), 504, "timeouts")

    def _admit(self) -> list[tuple[int, Request]]:
        free = [s for s in range(self.slots) if s not in self._active]
        if not free:
            return []
        if self.batching == "static":
            if self._active:
                return []
            deadline = time.perf_counter() + self.window
            with self._cond:
                while len(self._waiting) < len(free) and not self._stop:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._cond.wait(left)
        taken: list[tuple[int, Request]] = []
        with self._cond:
            longest = 0
            while self._waiting and len(taken) < len(free):
                r = self._waiting[0]
                longest_next = max(longest, len(r.prompt_ids))
                padded = bucket(len(taken) + 1) * bucket(longest_next, 8)
                if taken and self.batching == "continuous" and padded > self.prefill_budget:
                    break
                self._waiting.popleft()
                taken.append((free[len(taken)], r))
                longest = longest_next
        return taken

    def _insert(self, group: list[tuple[int, Request]]) -> None:
        slots = [s for s, _ in group]
        reqs = [r for _, r in group]
        compiled, t0 = self.gen.compile_s, time.perf_counter()
        self._state = jax.block_until_ready(self.gen.insert(
            self._state, [r.prompt_ids for r in reqs], slots, seeds=[r.seed for r in reqs],
            temperature=[r.temperature for r in reqs], top_k=[r.top_k for r in reqs], top_p=[r.top_p for r in reqs],
            max_tokens=[r.max_tokens for r in reqs]))
        now = time.perf_counter()
        with self.counters.lock:
            self.counters.prefill_calls += 1
            self.counters.prefill_s += now - t0 - (self.gen.compile_s - compiled)
            self.counters.prompt_tokens += sum(len(r.prompt_ids) for r in reqs)
            self.counters.requests += len(reqs)
            for s in slots:
                self.counters.slot_uses[s] += 1
        for s, r in group:
            r.slot, r.started = s, now
            self._active[s] = r
            self._texts[s] = _Output(self.gen.tokenizer, r.stop)
            self._to_cancel.discard(s)

    def _state_lost(self) -> bool:
        return self._state is None or any(x.is_deleted() for x in jax.tree.leaves(self._state))

    def _reset(self, why: str) -> None:
        """A fresh state after a failure that may have consumed it; every running request fails with the reason."""
        for slot in list(self._active):
            self._drop(slot, f"generation failed: {why}", 500, "failed")
        self._to_cancel.clear()
        self._state = self.gen.new_state(self.slots, self.max_len)

    def _admit_and_insert(self) -> None:
        group = self._admit()
        if not group:
            return
        try:
            self._insert(group)
            return
        except Exception as e:  # noqa: BLE001 - isolate: retry one request at a time below
            first = f"{type(e).__name__}: {e}"
        if self._state_lost():
            self._reset(first)
        for s, r in group:
            try:
                self._insert([(s, r)])
            except Exception as e:  # noqa: BLE001 - this request is the one that fails
                self._fail(r, f"generation failed: {type(e).__name__}: {str(e)[:300]}", 500)
                self.counters.add(failed=1)
                if self._state_lost():
                    self._reset(f"{type(e).__name__}: {e}")

    def _decode(self) -> None:
        with self._cond:
            waiting = bool(self._waiting)
        rows = len(self._active)
        try:
            self._state, out = self.gen.decode(self._state, self.chunk, exit_on_finish=waiting,
                                               cancel=sorted(self._to_cancel))
        except Exception as e:  # noqa: BLE001 - one program serves every running request: they all fail
            self._reset(f"{type(e).__name__}: {str(e)[:300]}")
            return
        self._to_cancel.clear()
        now = time.perf_counter()
        produced = 0
        for slot, r in list(self._active.items()):
            new = out.tokens[slot]
            if new:
                produced += len(new)
                r.first_token = r.first_token or now
                r.tokens.extend(new)
                piece = self._texts[slot].push(new)
                if not self._send(r, {"tokens": new, "text": piece}):
                    self._drop(slot, "cancelled", 499, "cancelled")
                    continue
                if self._texts[slot].stopped:  # a stop string: done here, the row stops at the next call
                    self._finish(slot, "stop")
                    self._to_cancel.add(slot)
                    continue
            if out.done[slot]:
                self._finish(slot, "stop" if out.stopped[slot] else "length")
        with self.counters.lock:
            self.counters.decode_calls += 1
            self.counters.decode_steps += out.steps
            self.counters.rows_decoded += rows * out.steps
            self.counters.decode_s += out.seconds
            self.counters.tokens_generated += produced

    def _run(self) -> None:
        self._state = self.gen.new_state(self.slots, self.max_len)
        while True:
            with self._cond:
                while not self._stop and not self._active and not self._waiting:
                    self._cond.wait(0.5)
                if self._stop:
                    return
            try:
                self._sweep()
                self._admit_and_insert()
                if self._active:
                    self._decode()
            except Exception as e:  # noqa: BLE001 - a bug in the loop itself: fail what runs, keep serving
                self._reset(f"{type(e).__name__}: {str(e)[:300]}")


class Scheduler:
    """Replicas behind one queue-less router: each request goes to the replica holding the fewest requests."""

    def __init__(self, generators: Sequence[Generator], **replica_kwargs):
        if not generators:
            raise ValueError("no Generator given: a scheduler needs at least one replica")
        self.replicas = [Replica(i, g, **replica_kwargs) for i, g in enumerate(generators)]
        self._lock = threading.Lock()

    def submit(self, request: Request) -> int:
        """Route to the least loaded replica (ties: the lowest index); returns its index."""
        with self._lock:
            replica = min(self.replicas, key=lambda r: (r.load, r.index))
            replica.submit(request)
        return replica.index

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def warmup(self, prompt_lengths: Sequence[int] = (8,)) -> float:
        """Compile every replica's programs for these prompt lengths (see `Replica.warmup`); returns seconds."""
        return sum(r.warmup(prompt_lengths) for r in self.replicas)

    def metrics(self) -> dict[str, Any]:
        per = [r.metrics() for r in self.replicas]
        total = {f: sum(m[f] for m in per) for f in _Counters.FIELDS + ("active", "queue_depth")}
        decode_s = sum(m["decode_s"] for m in per)
        total["decode_tokens_per_s"] = total["tokens_generated"] / decode_s if decode_s else 0.0
        return {**total, "replicas": per}


def replica_meshes(n: int, devices_per_replica: int = 1, devices: Sequence[Any] | None = None, *,
                   axis: str = "tensor") -> list:
    """n meshes over disjoint groups of k devices, in device order: one per replica.

    `axis="tensor"` (data 1, fsdp 1, tensor k): a replica's weights and KV heads are split over its devices and one
    decode loop spans them. `axis="data"` (data k, tensor 1): its rows are split, every device holds all weights and
    decodes its rows in a loop of its own (Generator.decode); the replica's batch must then be a multiple of k.
    """
    devices = list(devices if devices is not None else jax.devices())
    k = devices_per_replica
    if n < 1 or k < 1:
        raise ValueError(f"replicas={n} and devices_per_replica={k} must be >= 1")
    if axis not in ("tensor", "data"):
        raise ValueError(f"axis={axis!r}: a replica's devices split its weights ('tensor') or its rows ('data')")
    if n * k > len(devices):
        raise ValueError(f"{n} replica(s) of {k} device(s) need {n * k} devices, found {len(devices)}: use fewer "
                         f"replicas, or on a CPU host set XLA_FLAGS=--xla_force_host_platform_device_count={n * k}")
    shape = (1, 1, k) if axis == "tensor" else (k, 1, 1)
    return [_compat.make_mesh(shape, ("data", "fsdp", "tensor"), devices=devices[i * k:(i + 1) * k]) for i in range(n)]
