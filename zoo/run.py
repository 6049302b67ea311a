"""``python -m zoo.run``: the Hydra command line over ``conf/``.

    python -m zoo.run prompt="Hello"
    python -m zoo.run model=gpt2 model.path=/ckpt input.file=requests.jsonl output.format=jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from zoo.config import cli_main
from zoo.errors import ZooError
from zoo.llm import LLM


def read_jsonl(path: Path, key: str) -> list[dict]:
    """Each non-blank line's JSON object; a line that is not one becomes ``{"_error": message}``."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ZooError(f"cannot read {key}={path}: {exc.strerror}") from None
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
        records.append(record)
    return records


def read_requests(cfg: DictConfig) -> list:
    if cfg.input.file:
        path = Path(cfg.input.file)
        records = read_jsonl(path, "input.file")
        if not records:
            raise ZooError(f"input.file={path} holds no requests")
        return records
    if cfg.prompt is not None:
        return [{"prompt": str(cfg.prompt)}]
    return [{"prompt": "Once upon a time"}]


def run(cfg: DictConfig) -> int:
    try:
        if cfg.output.format not in ("text", "jsonl"):
            raise ZooError(f"output.format={cfg.output.format!r} must be text or jsonl")
        llm = LLM(config=cfg)
        records = read_requests(cfg)
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = llm.engine
    print(f"model: {engine.checkpoint.source}", file=sys.stderr)
    requests = [engine.reject(record["_error"], output_id=index) if "_error" in record else llm._add(record, None, index)
                for index, record in enumerate(records)]
    engine.run_until_done()
    for request in requests:
        out = llm.output_of(request)
        if cfg.output.format == "jsonl":
            print(json.dumps(out.to_json()), flush=True)
        elif out.error:
            print(f"[{out.id}] error: {out.error}")
        else:
            print(f"[{out.id}] {out.text}")
    print(engine.summary(), file=sys.stderr)
    return 0


@hydra.main(config_path="pkg://zoo_conf", config_name="config", version_base=None)
def _main(cfg: DictConfig) -> None:
    OmegaConf.set_struct(cfg, True)
    status = run(cfg)
    if status:  # returning normally on success lets a Hydra sweep (-m) go on to its next job
        sys.exit(status)


def main() -> None:
    cli_main(_main)


if __name__ == "__main__":
    main()
