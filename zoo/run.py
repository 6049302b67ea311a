"""``python -m zoo.run``: the Hydra command line over ``conf/``.

    python -m zoo.run prompt="Hello"
    python -m zoo.run model=gpt2 model.path=/ckpt input.file=requests.jsonl output.format=jsonl
    python -m zoo.run input.file=big.jsonl output.file=out.jsonl output.format=jsonl input.resume=true

Settings are checked before anything loads. Each record is written as its
request finishes (flushed; a request's id is its ``id`` field, else its line
number in ``input.file``), a progress bar runs on a terminal, and Ctrl-C or
SIGTERM stops with every finished record written.

Exit status: 0 every request succeeded; 2 a setting, the input or the model
is bad (nothing ran); 3 the run finished but some requests failed (their
records say why); 130 stopped by Ctrl-C, 143 by SIGTERM. A sweep (``-m``)
labels each job's output with its overrides, goes on past a failing job,
prints a table of the jobs (``output.sweep_table=PATH`` also writes PATH.csv
and PATH.md) and exits 3 when any job did not succeed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from zoo.config import cli_main
from zoo.errors import EXIT_BAD_SETTING, ZooError
from zoo.settings import check_settings

EXIT_FAILED_REQUESTS, EXIT_SIGINT, EXIT_SIGTERM = 3, 130, 143


def read_jsonl(path: Path, key: str) -> list[dict]:
    """Each non-blank line's JSON object, with ``_line`` (1-based); a bad line becomes ``{"_error": ...}``."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ZooError(f"cannot read {key}={path}: {getattr(exc, 'strerror', None) or exc}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            record = {"_error": f"line {number} of {path} is not valid JSON: {exc.msg}"}
        if not isinstance(record, dict):
            record = {"_error": f"line {number} of {path} must be a JSON object"}
        elif "prompt" in record and "prompt_ids" in record:
            record = {"_error": f"line {number} of {path} has both prompt and prompt_ids; give one", "id": record.get("id")}
        record["_line"] = number
        records.append(record)
    return records


def read_requests(cfg: DictConfig) -> list[dict]:
    """The run's requests, each with its output id (``id``, else its line number; 1 for a single prompt)."""
    if cfg.input.file:
        path = Path(cfg.input.file)
        records = read_jsonl(path, "input.file")
        if not records:
            raise ZooError(f"input.file={path} holds no requests")
    else:
        records = [{"prompt": str(cfg.prompt) if cfg.prompt is not None else "Once upon a time", "_line": 1}]
    for record in records:
        if record.get("id") is None:
            record["id"] = record["_line"]
    return records


def done_ids(path: Path) -> set:
    """Ids of the records already in an output file; a last line cut short by a kill is dropped from it."""
    if not path.exists():
        return set()
    text = path.read_text()
    complete, _, partial = text.rpartition("\n")
    if partial:  # the run was stopped mid-record: keep only whole lines
        path.write_text(complete + "\n" if complete else "")
    ids = set()
    for line in complete.splitlines():
        try:
            record = json.loads(line)
            if "event" not in record:  # output.stream's token lines: the request is done only at its record
                ids.add(json.dumps(record["id"]))
        except (ValueError, KeyError, TypeError):
            raise ZooError(f"input.resume: {path} holds a line that is not a zoo JSONL record; resume needs "
                           "output.format=jsonl output") from None
    return ids


def printable(text: str) -> str:
    """Text with control characters (a random model's terminal escapes) shown as escapes; newlines and tabs kept."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else repr(c)[1:-1] for c in text)


class Writer:
    """Records to stdout or ``output.file``, one whole line per write, flushed as each request finishes."""

    def __init__(self, cfg: DictConfig, resume: bool):
        self.jsonl = cfg.output.format == "jsonl"
        path = cfg.output.file
        self.stream = open(path, "a" if resume else "w", encoding="utf-8") if path else sys.stdout
        self.written = self.failed = 0

    def write(self, out) -> None:
        if self.jsonl:
            line = json.dumps(out.to_json())
        elif out.error:
            line = f"[{out.id}] error: {printable(out.error)}"
        else:
            line = f"[{out.id}] {printable(out.text)}"
        self.stream.write(line + "\n")
        self.stream.flush()
        self.written += 1
        self.failed += out.finish_reason == "error"

    def write_event(self, output_id, token_ids: list[int], text: str, sample: int | None,
                    logprobs: list[dict] | None) -> None:
        """``output.stream``: one request's new tokens of one step (the record follows when it finishes);
        ``sample``: which completion, for a request with sampling n > 1; ``logprobs``: the tokens' entries of
        the record's, where asked for."""
        event = {"id": output_id, "event": "token", "token_ids": token_ids, "text": text}
        if sample is not None:
            event["sample"] = sample
        if logprobs is not None:
            event["logprobs"] = logprobs
        self.stream.write(json.dumps(event) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not sys.stdout:
            os.fsync(self.stream.fileno())
            self.stream.close()


class Progress:
    """requests done / total, tokens/s and ETA on stderr, when it is a terminal (or output.progress=on)."""

    def __init__(self, cfg: DictConfig, total: int):
        setting = cfg.output.progress
        show = setting == "on" or (setting == "auto" and sys.stderr.isatty())
        self.bar = None
        if show:
            from tqdm import tqdm  # through huggingface-hub, a runtime dependency

            self.bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
        self.start = time.perf_counter()

    def update(self, done: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(done)
            self.bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - self.start, 1e-9):.0f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Stopped(Exception):
    def __init__(self, status: int):
        self.status = status


def _on_sigterm(signum, frame):
    raise Stopped(EXIT_SIGTERM)


def launch_ranks(size: int) -> int:
    """``runtime.tensor_parallel_size`` > 1 without a launcher: this same command under torchrun, one process per
    rank on this machine; torchrun's exit status (non-zero when any rank failed: it stops the others)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc-per-node={size}", "-m", "zoo.run", *sys.argv[1:]]
    print(f"starting {size} tensor-parallel ranks: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    return subprocess.run(command).returncode


def run(cfg: DictConfig) -> int:
    if int(cfg.runtime.tensor_parallel_size) > 1 and "WORLD_SIZE" not in os.environ:
        try:
            check_settings(cfg, run=True)
            if _job_label() is not None:  # re-running the command would run the whole sweep in every rank
                raise ZooError("a sweep (-m) with runtime.tensor_parallel_size > 1 runs under torchrun: "
                               "torchrun --nproc-per-node N -m zoo.run -m ...")
        except ZooError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_SETTING
        return launch_ranks(int(cfg.runtime.tensor_parallel_size))
    # Under tensor parallelism rank 0 alone reads the input (it may be a pipe, or on rank 0's machine only) and
    # hands every rank the same requests; rank 0 alone writes records and reports.
    main_rank = int(os.environ.get("RANK", 0)) == 0
    try:
        check_settings(cfg, run=True)
        if cfg.input.resume and not cfg.output.file:
            raise ZooError("input.resume=true needs output.file (the records to continue from)")
        if cfg.output.stream and cfg.output.format != "jsonl":
            raise ZooError("output.stream=true writes JSONL token events: it needs output.format=jsonl")
        # before the model loads: a bad input costs no loading time
        records = read_requests(cfg) if main_rank else []
        skip = done_ids(Path(cfg.output.file)) if cfg.input.resume and main_rank else set()
        from zoo.llm import LLM, TextDeltas

        llm = LLM(config=cfg)
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTING
    except KeyboardInterrupt:
        print("stopped before any request ran", file=sys.stderr)
        return EXIT_SIGINT
    engine = llm.engine
    if not main_rank:
        cfg = OmegaConf.merge(cfg, {"output": {"file": None, "progress": "off"}})
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the life of this rank's process
    print(f"model: {engine.checkpoint.source}", file=sys.stderr)
    todo = [r for r in records if json.dumps(r["id"]) not in skip]
    if engine.parallel is not None:
        try:
            todo = engine.parallel.from_rank0(todo)
        except ZooError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if skip:
        print(f"resuming: {len(records) - len(todo)} of {len(records)} requests are already in {cfg.output.file}",
              file=sys.stderr)
    writer, progress = Writer(cfg, bool(cfg.input.resume)), Progress(cfg, len(todo))
    # Ctrl-C raises KeyboardInterrupt even where the shell started us with SIGINT ignored (a background job).
    previous = signal.signal(signal.SIGTERM, _on_sigterm), signal.signal(signal.SIGINT, signal.default_int_handler)
    status = 0
    try:
        pending = {}  # request id -> request, until its record is written
        source_dir = Path(cfg.input.file).resolve().parent if cfg.input.file else None  # image paths start here
        for record in todo:
            request = (engine.reject(record["_error"], output_id=record["id"]) if "_error" in record
                       else llm._add({k: v for k, v in record.items() if k != "_line"}, None, record["id"],
                                     source_dir))
            if request.is_finished:
                writer.write(llm.output_of(request))
                progress.update(1, engine.stats.generated_tokens)
            else:
                pending[request.request_id] = request
        deltas = TextDeltas(llm.tokenizer) if cfg.output.stream else None
        while pending:
            # A request finishes in the step that gives its last token; once the engine is idle, any left.
            stepped = engine.step() if engine.has_work() else [(r, []) for r in pending.values()]
            advanced = [r for r, _ in stepped]
            if deltas is not None:
                for request, tokens in stepped:
                    if request.group.request_id in pending and tokens and not request.error:
                        final = llm.text_of(request) if request.is_finished else None
                        writer.write_event(request.group.output_id, tokens, deltas.delta(request, final),
                                           request.sample_index if request.group.samples else None,
                                           request.last_logprobs(len(tokens)))
            groups = {r.group.request_id: r.group for r in advanced}.values()
            finished = [r for r in groups if r.group_finished and r.request_id in pending]
            for request in finished:
                del pending[request.request_id]
                writer.write(llm.output_of(request))
            progress.update(len(finished), engine.stats.generated_tokens)
            if not engine.has_work() and not finished and pending:
                raise RuntimeError(f"{len(pending)} requests neither run nor finished; this is a bug")
    except KeyboardInterrupt:
        status = EXIT_SIGINT
    except Stopped as stop:
        status = stop.status
    except ZooError as exc:  # another tensor-parallel rank stopped: its collective failed here
        print(f"error: {exc}", file=sys.stderr)
        status = 2
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
        progress.close()
        writer.close()
    if status:
        print(f"stopped: {writer.written} of {len(todo)} requests done, their records written"
              + (f" to {cfg.output.file}; input.resume=true continues" if cfg.output.file else ""), file=sys.stderr)
        return status
    print(engine.summary(), file=sys.stderr)
    print(f"failed requests: {writer.failed} of {len(todo)}", file=sys.stderr)
    stats = engine.stats
    LAST_RUN.update(requests=len(todo), failed=writer.failed, generated_tokens=stats.generated_tokens,
                    decode_tok_s=round(stats.decode_tokens / stats.decode_seconds, 1) if stats.decode_seconds else 0.0)
    return EXIT_FAILED_REQUESTS if writer.failed else 0


LAST_RUN: dict = {}  # what the last run did, for a sweep's table
SWEEP_JOBS: list[dict] = []  # one row per job of a sweep (-m), in order


def _job_label() -> str | None:
    """The job's overrides when this run is one job of a sweep, else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return " ".join(HydraConfig.get().overrides.task)


@hydra.main(config_path="pkg://zoo_conf", config_name="config", version_base=None)
def _main(cfg: DictConfig) -> None:
    OmegaConf.set_struct(cfg, True)
    label = _job_label()
    if label is None:
        status = run(cfg)
        if status:
            sys.exit(status)
        return
    # One job of a sweep: labelled, and never ending the sweep; cli_main reports every job at the end.
    print(f"=== job {len(SWEEP_JOBS)}: {label}", flush=True)
    print(f"=== job {len(SWEEP_JOBS)}: {label}", file=sys.stderr, flush=True)
    LAST_RUN.clear()
    status = run(cfg)
    SWEEP_JOBS.append({"job": len(SWEEP_JOBS), "overrides": label, "status": status, **LAST_RUN,
                       "table": cfg.output.sweep_table})


def sweep_report() -> int:
    """A finished sweep's table on stderr (and in ``output.sweep_table``.csv/.md); 3 if any job did not succeed."""
    if not SWEEP_JOBS:
        return 0
    columns = ["job", "overrides", "status", "requests", "failed", "generated_tokens", "decode_tok_s"]
    rows = [[str(job.get(c, "")) for c in columns] for job in SWEEP_JOBS]
    markdown = "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                          + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
    print("sweep:\n" + markdown, file=sys.stderr)
    table = SWEEP_JOBS[0].get("table")
    if table:
        import csv

        with open(f"{table}.csv", "w", newline="") as f:
            csv.writer(f).writerows([columns] + rows)
        Path(f"{table}.md").write_text(markdown)
    failed = [job["job"] for job in SWEEP_JOBS if job["status"]]
    if failed:
        print(f"sweep: job(s) {', '.join(map(str, failed))} did not succeed", file=sys.stderr)
    return EXIT_FAILED_REQUESTS if failed else 0


def main() -> None:
    if any(a in ("--help", "-h") for a in sys.argv[1:]):  # zoo's settings; --hydra-help gives Hydra's own
        from zoo.config import compose_config, exit_on_error
        from zoo.settings import settings_help

        print(settings_help(exit_on_error(lambda: compose_config([a for a in sys.argv[1:] if not a.startswith("-")]))))
        return
    try:
        cli_main(_main)
        status = sweep_report()
    except SystemExit as exc:  # a failed run's status, kept for a rank's end below; a message printed as Python would
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    if "torch.distributed" in sys.modules:  # a tensor-parallel rank ends without the interpreter's teardown
        from zoo.parallel import end_rank

        end_rank(status)
    sys.exit(status)


if __name__ == "__main__":
    main()
