"""One rank's ``prepare()``, timed in a process of its own: seconds and peak RSS.

The dry run (:mod:`megatron_refit.tools.dryrun`) writes what a refit group's gather hands
every rank (each distinct part in its wire form, once) to a file, and runs
``python -m megatron_refit.tools.prepare_rank FILE --side gen --rank 0`` for each rank it
times. The child does what that rank's ``prepare()`` does after the gather, and nothing else:
decode every distinct part, :func:`~megatron_refit.plan.refit_plan.build_local_plan` (the
whole plan validated, the rank's own transfers and buckets expanded), its route fingerprints,
and every rank's agreement summary (16 numbers a rank) checked. Its peak RSS (``VmHWM``) is that of a
rank's prepare, not the dry run's (which also builds the whole plan), holding the gathered
bytes as a rank does. It imports neither Megatron nor torch.

The file: each distinct blob as an 8-byte little-endian length and its bytes, then a JSON
header ``{"parts": [[names blob, layout blob] per refit rank], "num_train", "bucket_bytes",
"direct_bytes", "optional"}`` as the last blob.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

from megatron_refit import wire
from megatron_refit.plan.checks import gc_paused
from megatron_refit.plan.agreement import agreement, in_agreement
from megatron_refit.plan.refit_plan import build_local_plan


def write_gathered(path: str, parts: list[tuple], *, num_train: int, bucket_bytes: int, direct_bytes: int | None,
                   optional: frozenset[str]) -> None:
    """``parts``: each refit rank's ``(names, layout)`` as :func:`~megatron_refit.plan.pieces.pack`
    gives it; equal parts are written once and read back as one object, as the gather returns them."""
    index: dict[int, int] = {}
    by_value: dict[bytes, int] = {}  # equal parts as one blob, as the gather moves them (by digest)
    with open(path, "wb") as f:
        for part in (p for rank_parts in parts for p in rank_parts):
            if id(part) not in index:
                blob = wire.dumps(part)
                if blob not in by_value:
                    f.write(struct.pack("<Q", len(blob)))
                    f.write(blob)
                    by_value[blob] = len(by_value)
                index[id(part)] = by_value[blob]
        header = json.dumps({"parts": [[index[id(names)], index[id(layout)]] for names, layout in parts],
                             "num_train": num_train, "bucket_bytes": bucket_bytes, "direct_bytes": direct_bytes,
                             "optional": sorted(optional)}).encode()
        f.write(struct.pack("<Q", len(header)))
        f.write(header)


def read_gathered(path: str) -> tuple[list[bytes], dict]:
    blobs = []
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at < len(data):
        (size,), at = struct.unpack_from("<Q", data, at), at + 8
        blobs.append(data[at:at + size])
        at += size
    return blobs[:-1], json.loads(blobs[-1])


def prepare_once(path: str, side: str, rank: int) -> dict:
    """What the rank's ``prepare()`` does after the gather: ``{"seconds", "transfers", "peak_rss_mb",
    "rejoin_seconds"}``, the last what it does again when a replica of a layout it planned (re)joins."""
    blobs, header = read_gathered(path)
    start = time.perf_counter()
    with gc_paused():  # as prepare() builds its plan
        decoded = [wire.loads(blob) for blob in blobs]
        gathered = [(decoded[n], decoded[lay]) for n, lay in header["parts"]]
        plan = build_local_plan(gathered, header["num_train"], bucket_bytes=header["bucket_bytes"],
                                direct_bytes=header["direct_bytes"], local=(side, rank),
                                optional=frozenset(header["optional"]))
        prints = plan.fingerprints()
        summary = agreement(prints)
        # every rank's summary as the control header's rows come back (each taken as this rank's:
        # the time is the same, the answer is not)
        in_agreement(plan, [list(summary) for _ in gathered])
    seconds = time.perf_counter() - start
    # a replica of this layout (re)joins: the peers announce the digests of what they hold, the
    # rank finds each decoded part and the plan it built by them (Endpoint.plans), and checks
    # the agreement; the collectives themselves are not in this figure
    digests = [hashlib.sha256(blob).hexdigest() for blob in blobs]
    decoded_by_digest = dict(zip(digests, decoded))
    key = (tuple(digests[n] for n, _ in header["parts"]), tuple(digests[lay] for _, lay in header["parts"]),
           (side, rank))
    plans = {key: (plan, prints)}
    start = time.perf_counter()
    again = [(decoded_by_digest[digests[n]], decoded_by_digest[digests[lay]]) for n, lay in header["parts"]]
    cached, _ = plans[(tuple(digests[n] for n, _ in header["parts"]), tuple(digests[lay] for _, lay in header["parts"]),
                       (side, rank))]
    in_agreement(cached, [list(summary) for _ in again])
    rejoin = time.perf_counter() - start
    return {"side": side, "rank": rank, "seconds": seconds, "transfers": len(plan.transfers),
            "peak_rss_mb": peak_rss_mb(), "rejoin_seconds": rejoin}


def time_ranks(parts: list[tuple], ranks: list[tuple[str, int]], *, num_train: int, bucket_bytes: int,
               direct_bytes: int | None, optional: frozenset[str], timeout_s: float = 600.0,
               repeat: int = 1) -> list[dict]:
    """:func:`prepare_once` of each of ``ranks``, each in a fresh child process (``repeat``
    times: :func:`run_child`)."""
    with tempfile.TemporaryDirectory(prefix="refit-prepare-") as tmp:
        path = os.path.join(tmp, "gathered.bin")
        write_gathered(path, parts, num_train=num_train, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes,
                       optional=optional)
        return [run_child("megatron_refit.tools.prepare_rank", [path, "--side", side, "--rank", str(rank)],
                          f"{side} rank {rank}'s prepare", timeout_s, repeat) for side, rank in ranks]


def run_child(module: str, args: list[str], what: str, timeout_s: float, repeat: int = 1) -> dict:
    """The JSON last line of ``python -m module *args`` (a rank timed in a process of its own);
    ``RuntimeError`` naming ``what`` with the child's error where it fails. ``repeat`` > 1: that
    many fresh processes, one after the other, and each of their timings (the keys ending in
    ``seconds``) their median, with every run's in ``runs_seconds``; the peak RSS the largest."""
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive int, got {repeat!r}")
    runs = []
    for _ in range(repeat):
        done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                              timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"timing {what} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if repeat == 1:
        return runs[0]
    out = dict(runs[0], runs_seconds=[run["seconds"] for run in runs])
    for key in (k for k in out if k.endswith("seconds") and k != "runs_seconds"):
        out[key] = statistics.median(run[key] for run in runs)
    if "peak_rss_mb" in out:
        out["peak_rss_mb"] = max(run["peak_rss_mb"] for run in runs)
    return out


def peak_rss_mb() -> float:
    """Peak RSS of this process's own address space (Linux ``VmHWM``)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass  # not Linux: fall back to getrusage
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_refit.tools.prepare_rank", description=__doc__.split("\n")[0])
    p.add_argument("path", help="the gathered parts, as write_gathered writes them")
    p.add_argument("--side", choices=("train", "gen"), required=True)
    p.add_argument("--rank", type=int, required=True)
    args = p.parse_args(argv)
    print(json.dumps(prepare_once(args.path, args.side, args.rank)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
