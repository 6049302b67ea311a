"""The server's overhead: time to first token, inter-token latency and throughput of ``python -m zoo.serve`` at
concurrency 1, 16 and 64 (the figures of vLLM's ``benchmark_serving``), beside the same workload through
``LLM.generate`` in this process; the ratio of the two throughputs is the server's cost.

    python bench/serve.py                         # the embedded default model, on this machine's device
    python bench/serve.py --model DIR --rounds 8 --out bench/results/serve.json

ITL is the mean gap between the chunks a client receives; TPOT the time per output token after the first, which
differs from it when chunks carry several tokens (``server.stream_interval``, or a handler merging steps under load).
Each request streams (``stream_options.include_usage`` gives its token count); prompts are code snippets of
mixed lengths and every request asks for ``--max-tokens`` greedy tokens with EOS ignored (the OpenAI API has no such
field: the server is started with ``sampling.ignore_eos=true``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request


def json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def start_server(args, port):
    cmd = [sys.executable, "-m", "zoo.serve", f"server.port={port}", "sampling.ignore_eos=true",
           f"runtime.max_num_seqs={max(args.concurrency)}", *[f"runtime.{kv}" for kv in args.runtime],
           *args.server_overrides] + (
               [f"server.engine_threads={max(1, len(args.engine_cpus) // args.engines)}"]
               if args.engine_cpus else []) + (
               [f"model.path={args.model}"] if args.model else [])
    log = open(args.server_log, "w")  # a file, not a pipe: a pipe nobody reads would stall a chatty server
    pin = (lambda: os.sched_setaffinity(0, args.server_cpus)) if args.server_cpus else None  # its engine inherits it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, preexec_fn=pin,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    base_url = f"http://127.0.0.1:{port}/v1/"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {server_log_tail(args)}")
        try:
            with urllib.request.urlopen(base_url + "models", timeout=5) as reply:
                return proc, base_url, json.load(reply)["data"][0]["id"]
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.3)
    raise SystemExit("the server did not start")


WORDS = ["def", "class", "import", "return", "for", "while", "if", "self", "print", "yield", "lambda", "(", ")"]


def write_word_tokenizer(path, vocab_size: int) -> None:
    """A tokenizer.json for a random-init checkpoint: the prompts' words, then one word per remaining id, split on
    whitespace (the server needs some tokenizer to take text and stream it back)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w13"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(path))


def server_log_tail(args, lines=40) -> str:
    with open(args.server_log) as f:
        return "".join(f.readlines()[-lines:])


async def one_request(session, base_url, model, prompt, max_tokens, record) -> None:
    """One streamed completion over raw HTTP (the openai client's parsing would load the client side, which shares
    this machine's cores with the server)."""
    start = time.perf_counter()
    stamps, tokens = [], 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with session.post(base_url + "completions", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:300]}")
        async for line in reply.content:  # one server-sent event's line at a time
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the stream's error event: the request failed, and the level with it
                raise RuntimeError(f"the server's stream ended in an error: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    record.append({"ttft": stamps[0] - start if stamps else float("nan"),
                   "itl": statistics.mean(b - a for a, b in zip(stamps, stamps[1:])) if len(stamps) > 1 else 0.0,
                   # time per output token after the first, however many a chunk carries (server.stream_interval)
                   "tpot": (stamps[-1] - stamps[0]) / (tokens - 1) if len(stamps) > 1 and tokens > 1 else 0.0,
                   "tokens": tokens})


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU time of these processes so far (Linux /proc; NaN elsewhere)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return float("nan")
    return total


def process_group(server_pid: int, engines: int = 1) -> dict[str, list[int]]:
    """The server's HTTP processes (the server and, with server.http_processes, the children it starts after the
    engines), its ``engines`` engine processes (its first children: server.data_parallel_size) and this client
    process."""
    pids = {"client": [os.getpid()], "http": [server_pid]}
    try:
        with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
            children = f.read().split()
        spawned = []
        for child in children:  # spawn's resource tracker is a child too
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"resource_tracker" not in f.read():
                    spawned.append(int(child))
        if spawned:
            pids["engine"] = spawned[:engines]
            pids["http"] += spawned[engines:]
    except OSError:
        pass
    return pids


def set_affinity(pid: int, cpus) -> None:
    """Every thread of process ``pid`` onto ``cpus``: a thread's affinity is its own."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread has ended since the listing
            pass


def engine_processes(args) -> int:
    """The server's engine processes: one per replica (``server.data_parallel_size`` among the overrides)."""
    sizes = [int(kv.split("=", 1)[1]) for kv in args.server_overrides if kv.startswith("server.data_parallel_size=")]
    return sizes[-1] if sizes else 1


def pin_server(pids: dict[str, list[int]], engine_cpus: list[int], http_cpus: list[int]) -> None:
    """Every thread of the engine process (its compute threads included) onto ``engine_cpus``, of the HTTP processes
    onto ``http_cpus``."""
    for role, cpus in (("engine", engine_cpus), ("http", http_cpus)):
        for pid in pids.get(role, []):
            set_affinity(pid, cpus)
    engines = "the engine process" if len(pids.get("engine", [])) < 2 else "the engine processes"
    print(f"pinned: {engines} on cores {engine_cpus}, the HTTP process on {http_cpus}", flush=True)


def clients(base_url, model, prompts, max_tokens, concurrency) -> tuple[list[dict], list[str]]:
    """``concurrency`` clients taking the prompts in turn, each streaming one request at a time: coroutines on one
    event loop over aiohttp, as vLLM's ``benchmark_serving`` drives a server. Threads over httpx cost the client 85-120
    us of CPU per token against 28-38 here, taken from the cores the server shares with it
    (bench/results/serve/cpu_client_ab.txt). Returns the records and the errors of requests that failed."""
    import aiohttp

    async def level():
        records, errors, queue = [], [], iter(prompts)
        # no cap on connections (aiohttp's default is 100); a session per level, so no level reuses a connection
        # the server may have closed while idle
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def client():
                for prompt in queue:
                    try:
                        await one_request(session, base_url, model, prompt, max_tokens, records)
                    except Exception as exc:  # noqa: BLE001 - the level fails with the first error, not a traceback
                        errors.append(f"{type(exc).__name__}: {exc}")
                        return
            await asyncio.gather(*(client() for _ in range(concurrency)))
        return records, errors

    try:
        import uvloop  # the serve extra's event loop, which the server runs on too

        return uvloop.run(level())
    except ImportError:
        return asyncio.run(level())


def client_process(base_url, model, prompts, max_tokens, concurrency, ready, go, results) -> None:
    ready.put(1)
    go.wait()
    cpu = time.process_time()
    records, errors = clients(base_url, model, prompts, max_tokens, concurrency)
    results.put((records, errors, time.process_time() - cpu))  # its busy time during the level, not its start-up


class LevelFailed(RuntimeError):
    """Requests of a level failed: the benchmark stops with the first error and the server's last lines."""


def run_level(base_url, model, prompts, max_tokens, concurrency, pids=None, processes=1):
    """One level: ``concurrency`` clients spread over ``processes`` client processes. On the 2-core CPU at 7-8k
    tokens/s one process over aiohttp kept 0.2 of a core busy (threads over httpx, before it, 0.5); at a GPU
    server's rates one process could measure itself instead of the server."""
    processes = max(1, min(processes, concurrency))
    cpu_before = {name: cpu_seconds(pid) for name, pid in (pids or {}).items()}
    if processes == 1:
        start = time.perf_counter()
        records, errors = clients(base_url, model, prompts, max_tokens, concurrency)
        wall = time.perf_counter() - start
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh connection pool in each
        ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=client_process, args=(base_url, model, prompts[k::processes], max_tokens,
                                                          len(range(k, concurrency, processes)), ready, go, results))
                 for k in range(processes)]
        for proc in procs:
            proc.start()
        for _ in procs:
            ready.get(timeout=120)  # started and imported: that time is not the level's
        start = time.perf_counter()
        go.set()
        finished = [results.get(timeout=1200) for _ in procs]
        wall = time.perf_counter() - start
        records = [r for part, _, _ in finished for r in part]
        errors = [e for _, part, _ in finished for e in part]
        children_cpu = sum(cpu for _, _, cpu in finished)
        for proc in procs:
            proc.join()
    if errors or len(records) < len(prompts):
        raise LevelFailed(f"{len(prompts) - len(records)} of {len(prompts)} requests failed at concurrency "
                          f"{concurrency}" + (f"; the first: {errors[0]}" if errors else ""))
    ttft = sorted(r["ttft"] for r in records)
    # how busy each process kept its cores: on a small machine the client takes cores the engine would use
    cpu = {name: (cpu_seconds(pid) - cpu_before[name]) / wall for name, pid in (pids or {}).items()}
    if pids and processes > 1:
        cpu["client"] += children_cpu / wall
    return {"concurrency": concurrency, "client_processes": processes, "requests": len(records), "seconds": wall,
            "cpu_cores_busy": cpu, "output_tok_s": sum(r["tokens"] for r in records) / wall,
            "ttft_median_ms": 1000 * statistics.median(ttft), "ttft_p99_ms": 1000 * ttft[int(0.99 * (len(ttft) - 1))],
            "itl_mean_ms": 1000 * statistics.mean(r["itl"] for r in records),
            "tpot_mean_ms": 1000 * statistics.mean(r["tpot"] for r in records)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--llama-1b", action="store_true",
                   help="write bench/gpu.py's random-init Llama-3.2-1B-shaped bf16 checkpoint (CUDA) and serve it")
    p.add_argument("--rounds", type=int, default=4,
                   help="each level sends this many requests per client (at least 8 in all), so most of its time "
                        "is the steady state rather than the ramp up and down")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    p.add_argument("--server-overrides", nargs="*", default=[], help="more `python -m zoo.serve` overrides")
    p.add_argument("--runtime", nargs="*", default=[], metavar="KEY=VALUE",
                   help="runtime settings for the server and LLM.generate alike (VALUE read as JSON, else text)")
    p.add_argument("--skip-offline", action="store_true", help="measure the server only")
    p.add_argument("--offline-rounds", type=int, default=3,
                   help="LLM.generate runs of the workload; the ratio is to their median (one run of 16k tokens "
                        "varied by 1.6x between device calls)")
    p.add_argument("--offline-threads", type=int, default=None,
                   help="compute threads of LLM.generate (default: torch's, all the cores); the server's engine "
                        "computes on the cores less one (server.engine_threads)")
    p.add_argument("--server-log", default=None, help="the server's output (default: a temporary file)")
    p.add_argument("--py-spy", default=None, metavar="FILE",
                   help="sample a server process with py-spy during the widest level; collapsed stacks to FILE")
    p.add_argument("--py-spy-process", choices=("engine", "http"), default="engine", help="the process --py-spy samples")
    p.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 4)),
                   help="spread each level's clients over this many processes (default: a quarter of the cores)")
    p.add_argument("--server-cpus", type=int, nargs="+", default=None, metavar="CPU",
                   help="run the server (HTTP and engine processes) and LLM.generate on these cores and the clients on "
                        "the others, so that the load generator takes nothing from the system under test and both "
                        "engines get the same cores (e.g. --server-cpus 1 on a 2-core machine)")
    p.add_argument("--engine-cpus", type=int, nargs="+", default=None, metavar="CPU",
                   help="with --server-cpus: after the warm-up, pin the engine process's threads to these of them and "
                        "the HTTP processes to the rest, and run LLM.generate on these alone with one thread each, so "
                        "that both engines compute on the same cores and the HTTP side on its own")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="then N pairs, each the widest level and one LLM.generate run (built beside the idle server), "
                        "and the median of their ratios: on a machine whose speed drifts, the fair comparison. On "
                        "CUDA both take 0.4 of the GPU's memory unless --runtime gpu_memory_utilization=F says")
    args = p.parse_args()
    if args.interleave and not any(kv.startswith("gpu_memory_utilization=") for kv in args.runtime):
        import torch

        if torch.cuda.is_available():  # the idle server keeps its KV cache while LLM.generate builds its own beside it
            args.runtime.append("gpu_memory_utilization=0.4")
            print("--interleave on CUDA: gpu_memory_utilization=0.4 for the server and LLM.generate each", flush=True)
    if args.server_cpus:
        client_cpus = set(os.sched_getaffinity(0)) - set(args.server_cpus)
        if not client_cpus or not set(args.server_cpus) <= os.sched_getaffinity(0):
            raise SystemExit(f"--server-cpus {args.server_cpus}: name cores of {sorted(os.sched_getaffinity(0))} "
                             "and leave at least one for the clients")
    args.engines = engine_processes(args)
    if args.engine_cpus and not (args.server_cpus and set(args.engine_cpus) < set(args.server_cpus)):
        raise SystemExit(f"--engine-cpus {args.engine_cpus}: name some of --server-cpus {args.server_cpus}, not all")
    if args.llama_1b:  # the GPU benchmark's shape, written once into a temporary folder
        import tempfile
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent))
        from gpu import SHAPE, write_checkpoint  # noqa: E402 - bench/gpu.py

        args.model = tempfile.mkdtemp(prefix="zoo_serve_1b_")
        write_checkpoint(Path(args.model), 16)
        write_word_tokenizer(Path(args.model) / "tokenizer.json", SHAPE["vocab_size"])
    if args.server_log is None:
        import tempfile

        args.server_log = tempfile.mkstemp(prefix="zoo_serve_", suffix=".log")[1]
    rng = random.Random(0)
    count = max(8, args.rounds * max(args.concurrency))
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(count)]
    from zoo.engine_process import free_port

    proc, base_url, model = start_server(args, free_port())
    if args.server_cpus:
        os.sched_setaffinity(0, client_cpus)  # this process's clients and the client processes it spawns
    pairs = []
    try:
        run_level(base_url, model, prompts[:1], 4, 1)
        print(f"first request done; the server's log so far:\n{server_log_tail(args)}", flush=True)
        # Warm-up: a full round at the widest concurrency: the step shapes it brings compile their kernel variants
        # now (Triton caches them on disk, so LLM.generate below starts warm too), not inside the measured levels.
        run_level(base_url, model, prompts[:max(args.concurrency)], args.max_tokens, max(args.concurrency),
                  processes=args.client_processes)
        if args.engine_cpus:
            pin_server(process_group(proc.pid, args.engines), args.engine_cpus,
                       sorted(set(args.server_cpus) - set(args.engine_cpus)))
        levels = []
        for concurrency in args.concurrency:
            spy, pids = None, process_group(proc.pid, args.engines)
            if args.py_spy and concurrency == max(args.concurrency) and args.py_spy_process in pids:
                spy_binary = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
                spy = subprocess.Popen([spy_binary, "record", "--pid", str(pids[args.py_spy_process][0]),
                                        "--rate", "250", "--format", "raw", "--output", args.py_spy,
                                        "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                time.sleep(1)  # attached before the level starts
            levels.append(measured_level(args, proc, base_url, model, prompts, concurrency))
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled on SIGINT
                spy.wait(timeout=60)
        if args.interleave:
            # The widest level and LLM.generate taking turns while the server idles, so that a machine whose speed
            # drifts compares them within minutes; LLM.generate computes on the server's cores.
            offline = OfflineEngine(args, prompts)
            for _ in range(args.interleave):
                served = measured_level(args, proc, base_url, model, prompts, max(args.concurrency))
                alone = offline.run()
                pairs.append({"serve_output_tok_s": served["output_tok_s"], "offline_output_tok_s": alone,
                              "ratio": served["output_tok_s"] / alone, "cpu_cores_busy": served["cpu_cores_busy"]})
                print(f"  pair {len(pairs)}: LLM.generate {alone:.0f} output tok/s, serve / offline = "
                      f"{pairs[-1]['ratio']:.2f}", flush=True)
    except LevelFailed as exc:
        raise SystemExit(f"{exc}; the server's last lines:\n{server_log_tail(args)}") from None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    if args.skip_offline and not pairs:
        return 0
    if pairs:
        runs = [pair["offline_output_tok_s"] for pair in pairs]
    else:
        offline = OfflineEngine(args, prompts)
        runs = [offline.run() for _ in range(max(1, args.offline_rounds))]
    median_offline = statistics.median(runs)
    import torch

    print(f"LLM.generate, the {len(prompts)} requests of the widest level at once (max_num_seqs "
          f"{max(args.concurrency)}, {torch.get_num_threads()} compute threads): {median_offline:.0f} output tok/s, "
          "the median of " + ", ".join(f"{r:.0f}" for r in runs))
    for r in levels:
        r["ratio_to_offline"] = r["output_tok_s"] / median_offline
        print(f"  concurrency {r['concurrency']}: serve / offline = {r['ratio_to_offline']:.2f}")
    if pairs:
        ratios = sorted(pair["ratio"] for pair in pairs)
        print(f"  concurrency {max(args.concurrency)}, {len(pairs)} interleaved pairs: serve / offline median "
              f"{statistics.median(ratios):.2f} (" + ", ".join(f"{r:.2f}" for r in ratios) + ")")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "levels": levels, "offline_output_tok_s": median_offline,
                       "offline_threads": torch.get_num_threads(), "server_cpus": args.server_cpus,
                       "engine_cpus": args.engine_cpus,
                       "offline_runs_tok_s": runs, "interleaved_pairs": pairs}, f, indent=1)
    return 0


def measured_level(args, proc, base_url, model, prompts, concurrency) -> dict:
    r = run_level(base_url, model, prompts[:max(8, args.rounds * concurrency)], args.max_tokens, concurrency,
                  process_group(proc.pid, args.engines), args.client_processes)
    print(f"serve, concurrency {concurrency}: {r['output_tok_s']:.0f} output tok/s, TTFT median "
          f"{r['ttft_median_ms']:.1f} ms (p99 {r['ttft_p99_ms']:.1f}), ITL mean {r['itl_mean_ms']:.2f} ms, "
          f"TPOT mean {r['tpot_mean_ms']:.2f} ms; cores busy: "
          + ", ".join(f"{name} {busy:.2f}" for name, busy in r["cpu_cores_busy"].items())
          # CPU per token: on a machine whose speed drifts, steadier than tokens/s for comparing server changes
          + "; CPU per output token: "
          + ", ".join(f"{name} {1e6 * busy / r['output_tok_s']:.1f} us" for name, busy in r["cpu_cores_busy"].items()
                      if name != "client"), flush=True)
    return r


class OfflineEngine:
    """The widest level's requests through ``LLM.generate`` in this process, on the server's cores when
    ``--server-cpus`` pins them (the clients' cores otherwise stay this process's between runs)."""

    def __init__(self, args, prompts):
        import torch

        from zoo import LLM, SamplingParams

        self.args, self.prompts = args, prompts
        if args.offline_threads or args.server_cpus:
            torch.set_num_threads(args.offline_threads or len(args.engine_cpus or args.server_cpus))
        runtime = {key: json_or_text(value) for key, value in (kv.split("=", 1) for kv in args.runtime)}
        self.llm = LLM(args.model, max_num_seqs=max(args.concurrency), **runtime)
        self.params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
        # the server's warm-up, the widest level's first round: the same kernel variants compiled and the same
        # prompts in the prefix cache (on the H200 runs without it gave 10055, then 18129, then 21754 tok/s)
        self.run(prompts[:max(args.concurrency)])

    def run(self, prompts=None) -> float:
        """One run; output tokens per second."""
        pinned = bool(self.args.server_cpus)
        if pinned:  # every thread: torch's compute threads may have started before, on the clients' cores
            before = os.sched_getaffinity(0)
            set_affinity(os.getpid(), self.args.engine_cpus or self.args.server_cpus)
        try:
            start = time.perf_counter()
            outs = self.llm.generate(prompts or self.prompts, self.params)
            return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
        finally:
            if pinned:
                set_affinity(os.getpid(), before)


if __name__ == "__main__":
    sys.exit(main())
