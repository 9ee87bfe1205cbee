"""The worker's command line.

    python -m conveyor.batch                          run a worker (Celery, Redis broker)
    python -m conveyor.batch status BATCH_ID          one batch's status and counts
    python -m conveyor.batch run INPUT.jsonl -o OUTPUT.jsonl
        upload, create the batch, follow it with a progress bar, download the output
        (and the error file next to it, OUTPUT.errors.jsonl, when lines failed)

`status` and `run` use the gateway's Batch API (CONVEYOR_BATCH_GATEWAY_URL) with
the API key CONVEYOR_BATCH_API_KEY (else OPENAI_API_KEY) of the tenant they act as.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from conveyor.batch.settings import BatchSettings

_TERMINAL = {"completed", "failed", "expired", "cancelled"}


def main(argv: list[str]) -> int:
    settings = BatchSettings()
    if not argv:
        from conveyor.batch.worker import run_worker

        return run_worker(settings)
    args = _parser().parse_args(argv)
    key = settings.api_key or os.environ.get("OPENAI_API_KEY", "unused")
    with httpx.Client(base_url=settings.gateway_url, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as client:
        try:
            return args.command(client, args)
        except httpx.HTTPStatusError as error:
            print(f"{error.response.status_code}: {error.response.text}", file=sys.stderr)
            return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m conveyor.batch")
    sub = parser.add_subparsers(required=True)
    status = sub.add_parser("status", help="print a batch's status and counts")
    status.add_argument("batch_id")
    status.set_defaults(command=_status)
    run = sub.add_parser("run", help="submit a JSONL file, follow it, download the output")
    run.add_argument("input", type=Path)
    run.add_argument("-o", "--output", type=Path, required=True)
    run.add_argument("--poll-s", type=float, default=1.0, help="seconds between status reads")
    run.set_defaults(command=_run)
    return parser


def _status(client: httpx.Client, args: argparse.Namespace) -> int:
    batch = _get(client, f"/v1/batches/{args.batch_id}")
    print(json.dumps({k: batch[k] for k in ("id", "status", "request_counts", "output_file_id",
                                             "error_file_id", "errors")}, indent=2))
    return 0


def _run(client: httpx.Client, args: argparse.Namespace) -> int:
    endpoint = json.loads(args.input.read_text().splitlines()[0])["url"]
    with args.input.open("rb") as file:
        upload = client.post("/v1/files", data={"purpose": "batch"},
                             files={"file": (args.input.name, file, "application/jsonl")})
    upload.raise_for_status()
    created = client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                               "endpoint": endpoint, "completion_window": "24h"})
    created.raise_for_status()
    batch = _follow(client, created.json()["id"], args.poll_s)
    print(f"{batch['id']}: {batch['status']} {json.dumps(batch['request_counts'])}")
    if batch.get("output_file_id"):
        _download(client, batch["output_file_id"], args.output)
    if batch.get("error_file_id"):
        _download(client, batch["error_file_id"], args.output.with_suffix(".errors.jsonl"))
    return 0 if batch["status"] == "completed" else 1


def _follow(client: httpx.Client, batch_id: str, poll_s: float) -> dict:
    """Poll the batch until it ends, drawing its progress."""
    with tqdm(desc=batch_id, unit="line") as bar:
        while True:
            batch = _get(client, f"/v1/batches/{batch_id}")
            counts = batch["request_counts"]
            bar.total = counts["total"] or None
            bar.n = counts["completed"] + counts["failed"]
            bar.set_postfix_str(batch["status"])
            bar.refresh()
            if batch["status"] in _TERMINAL:
                return batch
            time.sleep(poll_s)


def _download(client: httpx.Client, file_id: str, path: Path) -> None:
    with client.stream("GET", f"/v1/files/{file_id}/content") as response:
        response.raise_for_status()
        with path.open("wb") as out:
            for data in response.iter_bytes():
                out.write(data)
    print(f"wrote {path}")


def _get(client: httpx.Client, path: str) -> dict:
    response = client.get(path)
    response.raise_for_status()
    return response.json()
