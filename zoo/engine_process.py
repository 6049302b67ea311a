"""The engine's side of ``python -m zoo.serve``: the process that steps the engine, and the HTTP process's end of
the pipe to it.

The engine runs in a process of its own, so that stepping it never waits for Python's lock while the HTTP process
writes streams (at concurrency 64 on the H200, one process for both spent about 7 ms per token on steps of 1.5 ms).
Handlers hand it requests and aborts through a pipe (:class:`EngineClient`); its loop (:class:`EngineLoop`) adds
what came, steps, and sends each step's events back in one message, which a reader thread hands to the handlers'
event loops. Under tensor parallelism there is one such process per rank; rank 0 talks to the HTTP process and
hands the others the same messages. With ``server.http_processes`` N, N HTTP processes share the port,
each with a pipe of its own to the one engine loop, which sends each its own requests' events. With
``server.data_parallel_size`` N there are N such engines, each a whole copy of the model (:class:`EngineReplicas`),
and each HTTP process hands a new request to the one with the fewest unfinished.
"""

import asyncio
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait

from omegaconf import DictConfig

from zoo.errors import EXIT_BAD_SETTING, ZooError


class EngineStopped(ZooError):
    """The engine process has stopped: no request can be served until the server restarts."""

@dataclass
class Submission:
    """One HTTP request's zoo requests and where their events go (the handler's event loop and queue)."""

    items: list[tuple[dict, dict]]  # (request dict for LLM._add, sampling overrides) per prompt
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    ident: int = 0  # its number between the server and the engine process
    unfinished: int = 0  # prompts the engine has not finished
    stream: bool = True  # whether its handler writes text as it comes (else the engine sends only the outputs)
    replica: int = 0  # which of the server.data_parallel_size engines runs it


class EngineLoop:
    """The engine process's loop: requests and aborts come in through ``conns``, one pipe per HTTP process; each
    step's events go back to each in one message, with the engine's state (for ``/metrics`` and the waiting-queue
    cap). HTTP process ``i`` of ``n`` numbers its requests ``i, i + n, i + 2n, ...``, so a request's number says
    which pipe its events go to."""

    def __init__(self, llm, conns: list, control=None, stream_interval: int = 1):
        # conns: the pipes to the HTTP processes (tensor-parallel rank 0 only; None where one has closed); control:
        # under tensor parallelism, the group over which rank 0 hands every rank the same messages at the same point
        # of the loop
        self.llm, self.engine, self.conns, self.control = llm, llm.engine, list(conns), control
        self.stream_interval = stream_interval  # server.stream_interval
        # submission -> (prompt index, sample) -> tokens held back until stream_interval are due
        self.held: dict[int, dict[tuple[int, int], list[int]]] = {}
        self.owner: dict[int, tuple[int, int]] = {}  # group request id -> (submission, prompt index)
        self.requests_of: dict[int, list] = {}  # submission -> its zoo requests
        self.streamed: set[int] = set()  # submissions whose handlers stream: only theirs get each step's tokens
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last 10 s of steps, for tokens/s
        self.recent_tokens = 0  # their sum
        self.outbox: list[tuple[int, tuple]] = []  # (submission, event) of this step, sent together

    def run(self) -> None:
        while True:
            for message in self._messages():
                if message[0] == "stop":  # the last HTTP process has gone
                    for ident in list(self.requests_of):
                        self._abort(ident)
                    return
                self._handle(message)
            if self.engine.has_work():
                self._step()
            if not self.conns:  # another rank: rank 0 reports
                self.outbox.clear()
                continue
            self._send()

    def _messages(self) -> list:
        """What arrived since the last step; waits only when there is nothing to step. An HTTP process that stops
        or goes away becomes ``("closed", its index, their count)``, and the last one ``("stop", None)``. Under tensor
        parallelism rank 0 reads the pipes and broadcasts what it read, so every rank adds, aborts and steps
        alike."""
        messages = []
        if self.conns:
            for index in self._readable(block=not self.engine.has_work()):
                conn = self.conns[index]
                try:
                    while conn.poll(0):
                        message = conn.recv()
                        if message[0] == "stop":
                            raise EOFError
                        messages.append(message)
                except (EOFError, OSError):  # this HTTP process stops or is gone
                    messages.append(("closed", index, len(self.conns)))
                    self.conns[index] = None
            if all(conn is None for conn in self.conns):
                messages.append(("stop", None))
        if self.control is not None:
            import torch.distributed as dist

            box = [messages]
            dist.broadcast_object_list(box, src=0, group=self.control)
            messages = box[0]
        return messages

    def _readable(self, block: bool) -> list[int]:
        """The indices of the open pipes with something to read; waits for one when ``block``."""
        open_ = [index for index, conn in enumerate(self.conns) if conn is not None]
        if len(open_) == 1:  # one HTTP process: its pipe's own poll (bench/engine_loop_host.py's stand-in has no fd)
            return open_ if self.conns[open_[0]].poll(None if block else 0) else []
        ready = wait([self.conns[index] for index in open_], None if block else 0)
        return [index for index in open_ if self.conns[index] in ready]

    def _handle(self, message) -> None:
        kind, ident = message[0], message[1]
        if kind == "abort":
            self._abort(ident)
            return
        if kind == "closed":  # HTTP process ``ident`` of ``message[2]``: nobody reads its requests' events any more
            for number in [number for number in self.requests_of if number % message[2] == ident]:
                self._abort(number)
            return
        try:
            self._add(ident, message[2], message[3])
        except Exception as exc:  # noqa: BLE001 - one request's failure, never the engine's
            self.outbox.append((ident, ("error", f"{type(exc).__name__}: {exc}")))

    def _step(self) -> None:
        try:
            stepped = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failing step fails its requests, not the server
            if self.control is not None:  # ranks that may have parted ways: the engine process group ends
                raise
            for ident in list(self.requests_of):
                self.outbox.append((ident, ("error", f"the engine failed: {type(exc).__name__}: {exc}")))
                self._abort(ident)
            return
        now, count, finished = time.monotonic(), 0, {}
        streams = self.streamed if self.conns else ()
        for request, tokens in stepped:
            count += len(tokens)
            group = request.group
            owner = self.owner.get(group.request_id)
            if owner is None:
                continue
            ident, index = owner
            done = request.is_finished
            if ident in streams and not request.error and not request.beam_hypotheses:
                if self.stream_interval > 1:
                    tokens = self._due(ident, (index, request.sample_index), tokens, done)
                if tokens:
                    # tokens, and the text only once it is final (cut at a stop string): the HTTP process decodes
                    # the rest, so that detokenizing (15% of this process at concurrency 64 on the H200,
                    # h200_round4/engine_spy_call6.txt) runs beside the steps
                    self.outbox.append((ident, ("delta", index, request.sample_index, tokens,
                                                request.output_text if done else None,
                                                request.last_logprobs(len(tokens)))))
            if done and request.group_finished:  # after every sample's last delta of this step (n > 1 together)
                finished[group.request_id] = group
        for group in finished.values():
            self._finish(group)
        self.recent.append((now, count))
        self.recent_tokens += count
        while now - self.recent[0][0] >= 10:
            self.recent_tokens -= self.recent.popleft()[1]

    def _due(self, ident: int, choice: tuple[int, int], tokens: list[int], done: bool) -> list[int]:
        """``server.stream_interval``: a stream's tokens go out once that many have come, and at its end; its first
        ones at once, so that the time to the first token is not held back."""
        streams = self.held.setdefault(ident, {})
        held = streams.get(choice)
        if held is None:  # the stream's first tokens
            streams[choice] = []
            return tokens
        held += tokens
        if done or len(held) >= self.stream_interval:
            streams[choice] = []
            return held
        return []

    def _send(self) -> None:
        count, state = len(self.conns), self.state()
        if count == 1:  # one HTTP process: the whole outbox, without sorting it
            outboxes = [self.outbox]
        else:
            outboxes = [[] for _ in range(count)]
            for ident, event in self.outbox:
                outboxes[ident % count].append((ident, event))
        for conn, events in zip(self.conns, outboxes):
            if conn is not None:
                try:
                    conn.send(("events", events, state))
                except OSError:  # that HTTP process is gone: the next read says so
                    pass
        self.outbox = []

    def _add(self, ident: int, items, stream: bool) -> None:
        requests = self.requests_of[ident] = []
        if stream:
            self.streamed.add(ident)
        for index, (item, overrides) in enumerate(items):
            request = self.llm._add(item, overrides, index)
            requests.append(request)
            self.owner[request.request_id] = (ident, index)
            if request.is_finished:  # refused at intake: the whole HTTP request answers with its error
                self._finish(request)

    def _finish(self, request) -> None:
        ident, index = self.owner.pop(request.request_id)
        self.outbox.append((ident, ("finished", index, self.llm.output_of(request))))
        if not any(self.owner.get(r.request_id, (None,))[0] == ident for r in self.requests_of.get(ident, ())):
            self.requests_of.pop(ident, None)
            self.streamed.discard(ident)
            self.held.pop(ident, None)

    def _abort(self, ident: int) -> None:
        self.streamed.discard(ident)
        self.held.pop(ident, None)
        for request in self.requests_of.pop(ident, ()):
            if request.request_id in self.owner and not request.group_finished:
                self.engine.abort(request)
                self.owner.pop(request.request_id, None)

    def state(self) -> dict:
        engine, steps = self.engine, self.engine.stats.token_steps
        span = self.recent[-1][0] - self.recent[0][0] if len(self.recent) > 1 else 0.0
        return {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                "kv_blocks_used": engine.blocks.num_used_blocks, "kv_blocks_total": engine.num_blocks,
                "generated_tokens": engine.stats.generated_tokens,
                "tokens_per_second": (self.recent_tokens - self.recent[0][1]) / span if span > 0 else 0.0,
                "tokens_per_request_step": engine.stats.generated_tokens / steps if steps else 0.0}


def engine_threads(setting: int | None, world: int, cores: int, http_processes: int = 1, replicas: int = 1) -> int:
    """Compute threads of each engine process: ``server.engine_threads``, else the ``cores`` it may use
    (`usable_cores`) less one for each HTTP process, shared by the ``world`` ranks of each of the ``replicas``, at
    least one. On a 2-core CPU
    at 64 streaming clients, an engine computing on both cores kept 1.3-1.4 of them busy for 4575 tok/s (the median
    of three) against 5148 on 0.9-1.0 with one thread, and at 16 clients 4282 against 5346: its threads waited on
    each other while the HTTP process and the clients held a core (bench/results/serve/cpu_engine_threads_ab.txt)."""
    return setting if setting is not None else max(1, (cores - http_processes) // (world * replicas))


def usable_cores() -> int:
    """The cores this process may run on (``taskset``, a container's cpuset), not all the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def engine_process(config: dict, conns: list, rank: int = 0, world: int = 1, port: int = 0) -> None:
    """One engine process (one tensor-parallel rank of ``world``): builds the LLM, tells the HTTP processes what it
    serves (rank 0, the one with their ``conns``), then runs :class:`EngineLoop`."""
    import traceback

    from omegaconf import OmegaConf

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the HTTP process, which stops this one in turn
    if world > 1:  # what torchrun would give each rank
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))

    def report(*message) -> None:
        for conn in conns:
            conn.send(message)
        if not conns:
            print(f"error: {message[1]}", file=sys.stderr, flush=True)

    import torch

    server = config["server"]
    torch.set_num_threads(engine_threads(server.get("engine_threads"), world, usable_cores(),
                                         int(server.get("http_processes") or 1),
                                         int(server.get("data_parallel_size") or 1)))
    try:
        from zoo.llm import LLM

        llm = LLM(config=OmegaConf.create(config))
        control = None
        if world > 1:
            from datetime import timedelta

            import torch.distributed as dist

            # the ranks wait here for rank 0's next messages however long the server idles
            control = dist.new_group(backend="gloo", timeout=timedelta(days=30))
    except ZooError as exc:
        report("failed", str(exc), EXIT_BAD_SETTING)
        return
    except Exception as exc:  # noqa: BLE001 - reported by the HTTP process in one line, the trace kept here
        traceback.print_exc()
        report("failed", f"the engine did not start: {type(exc).__name__}: {exc}", 1)
        return
    if not conns:
        serve_rank(llm, [], control)
        return
    engine = llm.engine
    folder = engine.checkpoint.folder
    report("ready", {"adapters": sorted(engine.adapters.entries), "max_model_len": engine.max_model_len,
                     "vocab_size": engine.description.vocab_size, "tokenizer": llm.tokenizer,
                     "folder": None if folder is None else str(folder),
                     "takes_images": "images" in engine.intake.fields})
    serve_rank(llm, conns, control, int(server.get("stream_interval") or 1))


def serve_rank(llm, conns: list, control, stream_interval: int = 1) -> None:
    """Runs the loop until every HTTP process has stopped it or gone away. Under tensor parallelism, a failed
    collective (another rank died) ends this rank with one line, and the process group is left cleanly otherwise."""
    from zoo import parallel

    try:
        EngineLoop(llm, conns, control, stream_interval).run()
    except Exception as exc:  # noqa: BLE001 - only under tensor parallelism: the ranks can no longer agree
        print(f"error: zoo.serve engine rank stopped: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # the process group's teardown would wait on the rank that failed
    parallel.end_rank(0)


class EngineClient:
    """An HTTP process's side of the engine process: sends requests and aborts through its pipe (``conn``), and a
    reader thread hands each step's events to the handlers' event loop, one wake-up of each loop per step. HTTP
    process ``index`` of ``count``; ``ranks``: the engine processes, where this process started them
    (:meth:`start`)."""

    replicas = 1  # engines behind this process (EngineReplicas: server.data_parallel_size)

    def __init__(self, conn, index: int = 0, count: int = 1, ranks: list | None = None):
        self.conn, self.index, self.count = conn, index, count
        self.ranks = ranks or []
        self.process = self.ranks[0] if self.ranks else None
        self.info, self.failure = None, None
        try:
            message = self.conn.recv()
        except EOFError:
            status = self._engine_exit_status()
            message = ("failed", f"the engine process exited with status "
                                 f"{status if status is not None else 'unknown'}", 1)
        if message[0] == "failed":
            self.failure = message[1:]
            return
        self.info = message[1]
        self.state = {"running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 0, "generated_tokens": 0,
                      "tokens_per_second": 0.0, "tokens_per_request_step": 0.0}
        self.submissions: dict[int, Submission] = {}
        self.next_ident = index  # this process's requests are index, index + count, ...: the engine's pipe for each
        self.send_lock = threading.Lock()
        self.stopping = False  # stop() was called: the pipe's end is expected
        self.reader = threading.Thread(target=self._read, name="zoo-engine-reader", daemon=True)
        self.reader.start()

    @classmethod
    def start(cls, cfg: DictConfig) -> tuple["EngineClient | EngineReplicas", list[list]]:
        """Starts the engine processes (``server.data_parallel_size`` replicas, each with a process per
        tensor-parallel rank), with a pipe to each replica for each of the ``server.http_processes``: this
        process's engine (a client, or :class:`EngineReplicas` over one client per replica), and for each other
        HTTP process the ends of its pipes, one per replica. Every replica loads at once; this waits for all."""
        import multiprocessing

        from omegaconf import OmegaConf

        context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads and CUDA state
        count = int(cfg.server.get("http_processes") or 1)
        replicas = int(cfg.server.get("data_parallel_size") or 1)
        config, world = OmegaConf.to_container(cfg, resolve=True), int(cfg.runtime.tensor_parallel_size)
        started = []
        for replica in range(replicas):
            pipes = [context.Pipe() for _ in range(count)]
            children = [child for _, child in pipes]
            replica_config = replica_settings(config, replica, replicas)
            port = free_port() if world > 1 else 0
            # one process per tensor-parallel rank; rank 0 talks to the HTTP processes, the others follow rank 0
            ranks = [context.Process(target=engine_process,
                                     args=(replica_config, children if rank == 0 else [], rank, world, port),
                                     name=f"zoo-engine-{rank}" if replicas == 1 else f"zoo-engine-{replica}-{rank}",
                                     daemon=True) for rank in range(world)]
            for process in ranks:
                process.start()
            for child in children:
                child.close()
            started.append(([parent for parent, _ in pipes], ranks))
        engine = engine_of([cls(parents[0], 0, count, ranks) for parents, ranks in started])
        return engine, [[parents[index] for parents, _ in started] for index in range(1, count)]

    def _engine_exit_status(self, timeout: float | None = None) -> int | None:
        """The exit status of the engine process (rank 0), reaped so that it is known; None where this HTTP process
        did not start it, or it still runs after ``timeout``."""
        if self.process is None:
            return None
        self.process.join(timeout)
        return self.process.exitcode

    @property
    def alive(self) -> bool:
        return self.reader.is_alive() and all(process.is_alive() for process in self.ranks)

    def submit(self, submission: Submission) -> None:
        if not self.alive:
            raise EngineStopped("the engine process has stopped; restart the server")
        self.next_ident += self.count
        submission.ident, submission.unfinished = self.next_ident, len(submission.items)
        self.submissions[submission.ident] = submission
        self._send(("add", submission.ident, submission.items, submission.stream))

    def abort(self, submission: Submission) -> None:
        if self.submissions.pop(submission.ident, None) is not None:
            self._send(("abort", submission.ident))

    def stop(self) -> None:
        """This HTTP process is done: the engine aborts what it still runs for it, and ends with the last one's
        stop (the processes that started the engine wait for that)."""
        self.stopping = True
        self._send(("stop", None))
        for process in self.ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()

    def _send(self, message) -> None:
        with self.send_lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # the engine process is gone: the reader fails what was waiting
                pass

    def _read(self) -> None:
        while True:
            try:
                _, events, state = self.conn.recv()
            except (EOFError, OSError) as exc:
                status = self._engine_exit_status(timeout=1)
                cause = f"exit status {status}" if status is not None else repr(exc)
                failure = f"the engine process stopped ({cause})"
                if not self.stopping:  # the server's log says why its streams ended
                    print(f"error: {failure}", file=sys.stderr, flush=True)
                break
            self.state = state
            by_loop: dict = {}
            for ident, event in events:
                submission = self.submissions.get(ident)
                if submission is None:  # aborted meanwhile
                    continue
                if event[0] == "finished":
                    submission.unfinished -= 1
                    if submission.unfinished == 0:  # its last prompt: the engine has forgotten it too
                        del self.submissions[ident]
                by_loop.setdefault(submission.loop, []).append((submission.events, event))
            for loop, batch in by_loop.items():
                loop.call_soon_threadsafe(_deliver, batch)
        for submission in list(self.submissions.values()):  # every request still waiting fails, none hangs
            submission.loop.call_soon_threadsafe(_deliver, [(submission.events, ("error", failure))])


def replica_settings(config: dict, replica: int, replicas: int) -> dict:
    """Replica ``replica``'s copy of the server's ``config``: on CUDA each replica has a device of its own
    (``check_settings`` made sure there are enough)."""
    if replicas == 1:
        return config
    import torch

    runtime = dict(config.get("runtime") or {})
    if str(runtime.get("device", "auto")) != "cpu" and torch.cuda.is_available():
        runtime["device"] = f"cuda:{replica}"
    return {**config, "runtime": runtime}


def engine_of(clients: list["EngineClient"]) -> "EngineClient | EngineReplicas":
    """An HTTP process's engine: its one client, or the replicas behind its clients."""
    return clients[0] if len(clients) == 1 else EngineReplicas(clients)


class EngineReplicas:
    """``server.data_parallel_size`` engines behind one HTTP process, with :class:`EngineClient`'s interface: each
    request goes to the replica with the fewest unfinished requests from this process, and stays there (its
    aborts follow it). On a 16-core CPU two one-thread replicas on two cores served 0.95 of ``LLM.generate`` on
    those cores with two threads, where one two-thread engine served 0.83 (bench/results/serve/device_cpu/)."""

    def __init__(self, clients: list["EngineClient"]):
        self.clients = clients
        self.index, self.count, self.info = clients[0].index, clients[0].count, clients[0].info
        # the first replica that failed to start says why; the server then exits, and the replicas with it
        self.failure = next((client.failure for client in clients if client.failure is not None), None)

    @property
    def state(self) -> dict:
        """The replicas' states summed (accepted tokens per request step: their mean, weighted by tokens)."""
        states = [client.state for client in self.clients]
        total = {key: sum(state[key] for state in states) for key in states[0]}
        tokens = total["generated_tokens"]
        total["tokens_per_request_step"] = (sum(state["tokens_per_request_step"] * state["generated_tokens"]
                                                for state in states) / tokens) if tokens else 0.0
        return total

    @property
    def replicas(self) -> int:
        return len(self.clients)

    @property
    def alive(self) -> bool:
        return all(client.alive for client in self.clients)

    def submit(self, submission: Submission) -> None:
        submission.replica = min(range(len(self.clients)), key=lambda index: len(self.clients[index].submissions))
        self.clients[submission.replica].submit(submission)

    def abort(self, submission: Submission) -> None:
        self.clients[submission.replica].abort(submission)

    def stop(self) -> None:
        for client in self.clients:
            client.stop()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _deliver(events) -> None:
    for events_queue, event in events:
        events_queue.put_nowait(event)
