"""Replica fan-out (``refit.fanout``) over real spawned ranks on gloo, through the public
``trainer_refit_from_pieces`` / ``engine_refit`` path: the train ranks send each byte once, to the
chain's head, and the replicas forward it, rank ``k`` to rank ``k``. Every replica lands every
version bit-exactly; the train ranks' bytes are one replica's; a relay killed or raising mid-refit
is routed around within that refit (its successors get the rest from the train ranks and land it);
a replica that joins takes its place in the chain; delta payloads travel along the chain; and all
of it under ``refit.overlap: on`` too."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_refit.local.launch import preload_env, run_spawned
from megatron_refit.testing.toy_fleet import NUM_TRAIN, exact, set_version, storage, train_pieces

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

TIMEOUT_S = 8.0
STALL_S = 4.0
VERSIONS = (1, 2, 3, 4)
BAD = 2
"""The version a relay dies or raises in."""
RELAY = 0
"""The relay that fails: the chain's head (its successor then forwards what the train ranks resend it)."""


def _rank(rank, world, port, scenario, tp, dp, mode, delta, overlap, flag):
    """Train ranks refit ``VERSIONS``; replicas ``0..dp-1`` start with them; under ``join`` a
    replica ``dp`` starts after refit 2 and joins at refit 3. ``kill``: replica ``RELAY``'s first
    TP rank exits while it lands refit ``BAD``; ``raise``: its storage raises then."""
    from megatron_refit.config import RefitConfig
    from megatron_refit.group.store import JOINS
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.refit import trainer_refit_from_pieces

    big = scenario == "corrupt-sampled"
    if big:  # one 2 MiB weight: each train rank's half is one bucket of 1 MiB, read 1/128 by `sampled`
        from megatron_refit.testing import toy_fleet

        toy_fleet.SHAPES = {"big.w": (2048, 256)}
    cfg = RefitConfig(enabled=True, engine="vllm", gen_tp=tp, gen_dp=dp, port=port,
                      bucket_mb=2.0 if big else 2048 / (1 << 20),
                      direct_mb=None, timeout_s=TIMEOUT_S, stall_s=STALL_S, delta=delta, fanout=mode,
                      on_replica_failure="continue", overlap=overlap)
    out = []
    if os.environ.get("FO_DUMP"):
        import faulthandler
        faulthandler.dump_traceback_later(6)
    if rank < NUM_TRAIN:
        pieces = train_pieces(rank)
        fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        for version in VERSIONS:
            if version == 3 and scenario == "join" and rank == 0:
                open(flag, "w").close()  # the standby replica may start now
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and fleet.control_group.store.get(JOINS).decode().count(",") <= dp:
                    time.sleep(0.05)
            set_version(pieces, version)
            start = time.monotonic()
            report = fleet.refit(version)
            out.append(dict(failed=report.failed_replicas, summary=report.summary, members=sorted(fleet.members),
                            seconds=time.monotonic() - start))
        fleet.close()
        if scenario == "stall" and rank == 0:  # the stopped relay never ends by itself
            os.kill(int(open(flag + ".pid").read()), signal.SIGKILL)
        return out
    gen = rank - NUM_TRAIN
    first, versions = gen, VERSIONS
    if gen >= tp * dp:  # the standby replica
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        first, versions = dp * tp + gen - tp * dp, (3, 4)
    store = storage(first % tp, tp)
    victim = 1 if scenario == "kill-middle" else RELAY
    if first == victim * tp and scenario in ("kill", "kill-middle", "raise", "stall"):
        calls = [0]

        def failing(name, call):
            if len(out) != BAD - 1:  # refit BAD's calls only
                return
            calls[0] += 1
            if calls[0] == 2:
                if scenario.startswith("kill"):
                    os._exit(17)
                if scenario == "stall":  # SIGSTOP: no heartbeat, its sockets open
                    with open(flag + ".pid", "w") as f:
                        f.write(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGSTOP)
                raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")

        store.on_buffer = failing
    if first == RELAY * tp and scenario.startswith("corrupt"):  # one bit of a bucket it forwards in refit BAD flips
        from megatron_refit.endpoint.relay import Forwarder

        forward, forwarded = Forwarder.bucket, [0]

        def corrupting(self, src, bucket, encoding, data, *, stable):
            if len(out) == BAD - 1:
                forwarded[0] += 1
                if forwarded[0] == 2:  # a copy: its own bytes stay good
                    data, stable = data.clone(), True
                    data[200_000 if big else -1] ^= 0x04  # big: a byte `sampled` does not read
            return forward(self, src, bucket, encoding, data, stable=stable)

        Forwarder.bucket = corrupting
    member = engine_refit(cfg, store, gen_index=first, num_train=NUM_TRAIN)
    for version in versions:
        start = time.monotonic()
        try:
            report = member.receive(version)
            out.append(dict(version=version, ok=True, delta=report.delta, fallback=report.relay_fallback,
                            relayed=report.bytes_relayed))
        except Exception as exc:  # noqa: BLE001 -- the test reads what the engine raised
            out.append(dict(version=version, ok=False, error=f"{type(exc).__name__}: {exc}"[:300]))
        out[-1].update(seconds=time.monotonic() - start, exact=exact(store, version), state=member.state)
    member.close()
    return out


def _run(scenario, tmp_path, *, tp=1, dp=3, mode="chain", delta="off", overlap="off"):
    standby = tp if scenario == "join" else 0
    dead = frozenset({NUM_TRAIN + RELAY * tp}) if scenario in ("kill", "stall") else frozenset()
    if scenario == "kill-middle":
        dead = frozenset({NUM_TRAIN + 1 * tp})
    out = run_spawned(_rank, NUM_TRAIN + tp * dp + standby, scenario, tp, dp, mode, delta, overlap,
                      str(tmp_path / "flag"), timeout_s=240, may_die=dead)
    return out[:NUM_TRAIN], out[NUM_TRAIN:NUM_TRAIN + tp * dp], out[NUM_TRAIN + tp * dp:]


def _landed(outcome, versions):
    assert [r["version"] for r in outcome] == list(versions), outcome
    for r in outcome:
        assert r["ok"] and r["exact"] and r["state"] == "ready" and r["seconds"] < TIMEOUT_S, r


def _one_replica_bytes(train, version, replicas):
    """The train ranks sent one replica's bytes, the replicas relayed the other ``replicas - 1``'s."""
    s = train[0][version - 1]["summary"]
    one = s["refit/bytes_minimal"] // replicas
    return s, one


@pytest.mark.parametrize("mode,tp,dp", [("chain", 1, 3), ("tree", 2, 3)])
def test_fanout_every_replica_lands_every_version_from_one_replicas_bytes(mode, tp, dp, tmp_path):
    train, gen, _ = _run("ok", tmp_path, tp=tp, dp=dp, mode=mode)
    for outcome in gen:
        _landed(outcome, VERSIONS)
        assert not any(r["fallback"] for r in outcome)
    for version in VERSIONS:
        s, one = _one_replica_bytes(train, version, dp)
        assert s["refit/ok"] == 1 and s["refit/replicas_ok"] == dp
        assert s["refit/bytes"] == one > 0  # trainer egress: one replica's, not dp of them
        assert s["refit/bytes_relayed"] == (dp - 1) * s["refit/bytes_wire"]  # every other replica's, once
        assert s["refit/relay_fallbacks"] == 0
        assert all(o[version - 1]["summary"] == s for o in train)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_fanout_relay_killed_mid_refit_its_successors_still_land_it(overlap, tmp_path):
    """The chain's head dies while it lands refit 2 (``overlap: on``: in the train ranks'
    background lane): its successor gets the rest from the train ranks and forwards it on, both
    land refit 2 bit-exactly in the usual time (no wait of refit.timeout_s), the dead relay is
    named and dropped, and the next refits form a chain of the survivors."""
    train, gen, _ = _run("kill", tmp_path, overlap=overlap)
    assert gen[RELAY] is None  # killed
    for g, outcome in enumerate(gen):
        if g != RELAY:
            _landed(outcome, VERSIONS)
    assert gen[1][BAD - 1]["fallback"]  # the head's successor: routed around
    for outcome in train:
        bad = outcome[BAD - 1]
        assert list(bad["failed"]) == [RELAY] and bad["summary"]["refit/replicas_ok"] == 2, bad
        assert bad["summary"]["refit/relay_fallbacks"] >= 1
        # The successors landed in the usual time (_landed). A train rank's own call may end at
        # refit.timeout_s once in a while: gloo sometimes leaves a pending send to a peer that died
        # unfailed (BENCHMARKS.md, seen in 3 of 57 benchmark runs); that is its bound.
        assert bad["seconds"] < TIMEOUT_S * 1.5, bad
        for i, later in enumerate(outcome[BAD:], start=BAD):
            assert later["failed"] == {} and later["summary"]["refit/bytes_relayed"] > 0  # the survivors chain again
            # overlap: a background refit reads the next one's leaves at its end (after refit 4, the survivors')
            assert later["members"] == [1, 2] or overlap == "on" and i == len(outcome) - 1, later


def test_fanout_middle_relay_killed_its_relay_drops_it_and_its_successor_lands(tmp_path):
    """Replica 1, in the middle of the chain 0 -> 1 -> 2, dies while it lands refit 2: the head's
    forwards to it fail, the head drops that link and lands its own refit; replica 2 gets the rest
    from the train ranks; the next refits chain 0 -> 2."""
    train, gen, _ = _run("kill-middle", tmp_path)
    assert gen[1] is None
    for g in (0, 2):
        _landed(gen[g], VERSIONS)
    assert not gen[0][BAD - 1]["fallback"] and gen[2][BAD - 1]["fallback"]
    for outcome in train:
        bad = outcome[BAD - 1]
        assert list(bad["failed"]) == [1] and bad["summary"]["refit/replicas_ok"] == 2, bad
        assert bad["seconds"] < TIMEOUT_S, bad
        for later in outcome[BAD:]:
            assert later["failed"] == {} and later["members"] == [0, 2]
            assert later["summary"]["refit/bytes_relayed"] > 0 and later["summary"]["refit/relay_fallbacks"] == 0


def test_fanout_relay_stalled_mid_refit_its_successors_land_it_within_the_stall_bound(tmp_path):
    """The chain's head stops (SIGSTOP: its sockets open, no heartbeat) while it lands refit 2:
    its successor gives up on the relay link after refit.stall_s, gets the rest from the train
    ranks and forwards it on; both land refit 2 bit-exactly, the train ranks drop the stalled
    head after stall_s plus a poll, and refit 2 ends within about stall_s, not refit.timeout_s."""
    train, gen, _ = _run("stall", tmp_path)
    for g, outcome in enumerate(gen):
        if g != RELAY:
            _landed(outcome, VERSIONS)
    assert gen[1][BAD - 1]["fallback"]
    for outcome in train:
        bad = outcome[BAD - 1]
        why = bad["failed"][RELAY]
        assert list(bad["failed"]) == [RELAY] and "stalled" in why, why
        assert bad["seconds"] < STALL_S * 1.75 < TIMEOUT_S, bad
        assert [o["members"] for o in outcome[BAD - 1:]] == [[1, 2]] * (len(VERSIONS) - BAD + 1)
        assert all(o["failed"] == {} for o in outcome[BAD:])


@pytest.mark.parametrize("delta", ["off", "on"])
def test_fanout_bytes_corrupted_on_a_relay_link_are_taken_again_from_the_train_ranks(delta, tmp_path):
    """One bit of a bucket the head forwards in refit 2 flips on the way: replica 1 finds it against
    the train ranks' digests and takes that train rank's buckets again from the train ranks, from
    the bad one on, within the refit; replica 2, which had the same bytes from replica 1, does the
    same. Nobody fails, every replica lands every version bit-exactly (under deltas too: the
    corrupted one is a delta payload, taken again raw)."""
    train, gen, _ = _run("corrupt", tmp_path, delta=delta)
    for outcome in gen:
        _landed(outcome, VERSIONS)
    assert [outcome[BAD - 1]["fallback"] for outcome in gen] == [False, True, True]
    for outcome in train:
        assert all(o["failed"] == {} for o in outcome)
        assert outcome[BAD - 1]["summary"]["refit/relay_fallbacks"] == 2
        assert outcome[BAD]["summary"]["refit/relay_fallbacks"] == 0  # a new epoch, the chain as before


def test_fanout_relay_link_is_checked_fully_under_the_default_sampled_verify(tmp_path):
    """``refit.verify: sampled`` (the default) reads 4 KiB of every 512 KiB of a large bucket; a
    byte flipped on a relay link outside them would land in every replica down the chain. Under
    fan-out every byte is read, so the flip in a 1 MiB bucket is found and taken again."""
    train, gen, _ = _run("corrupt-sampled", tmp_path)
    for outcome in gen:
        _landed(outcome, VERSIONS)
    fallbacks = [outcome[BAD - 1]["fallback"] for outcome in gen]
    # replica 1 received the flipped byte: it takes the bucket again from the train ranks. Replica
    # 2, relayed from it, either got the flipped copy too (and takes it again) or, where replica 1
    # forwards from engine memory after the good bytes overwrote it, the good ones: both land exact
    assert fallbacks[:2] == [False, True], ([outcome[BAD - 1] for outcome in gen], train[0][BAD - 1]["summary"])
    assert train[0][BAD - 1]["summary"]["refit/relay_fallbacks"] == sum(fallbacks)


def test_fanout_relay_raising_mid_refit_fails_alone_and_its_successors_land(tmp_path):
    """The head's engine raises while it lands refit 2: it fails that refit alone (named, stale),
    its successors land it from what it forwarded (its bytes were good: checked against the train
    ranks' digests at each hop); the next refit brings it back."""
    train, gen, _ = _run("raise", tmp_path)
    for g, outcome in enumerate(gen):
        if g != RELAY:
            _landed(outcome, VERSIONS)
    bad = gen[RELAY][BAD - 1]
    assert not bad["ok"] and "illegal memory access" in bad["error"] and bad["state"] == "stale", bad
    _landed([r for r in gen[RELAY] if r["version"] != BAD], [v for v in VERSIONS if v != BAD])
    for outcome in train:
        assert list(outcome[BAD - 1]["failed"]) == [RELAY]
        assert "illegal memory access" in outcome[BAD - 1]["failed"][RELAY]
        assert all(o["failed"] == {} for i, o in enumerate(outcome) if i != BAD - 1)


def test_fanout_replica_joining_takes_its_place_in_the_chain(tmp_path):
    """A replica that starts after refit 2 joins at refit 3 and gets it through the chain (new
    links, a new route epoch): every replica lands every version, the train ranks still send one
    replica's bytes."""
    train, gen, standby = _run("join", tmp_path)
    for outcome in gen:
        _landed(outcome, VERSIONS)
    for outcome in standby:
        _landed(outcome, (3, 4))
    for outcome in train:
        assert [o["members"] for o in outcome] == [[0, 1, 2]] * 2 + [[0, 1, 2, 3]] * 2
    for version in (3, 4):
        s, one = _one_replica_bytes(train, version, 4)
        assert s["refit/bytes"] == one and s["refit/replicas_ok"] == 4 and s["refit/relay_fallbacks"] == 0


def test_fanout_deltas_travel_along_the_chain(tmp_path):
    """``refit.delta: on``: from refit 2 on, the head gets delta payloads and forwards them as
    they are; every replica applies them to the version it holds and lands bit-exactly; the train
    ranks send one replica's delta."""
    train, gen, _ = _run("ok", tmp_path, delta="on")
    for outcome in gen:
        _landed(outcome, VERSIONS)
    for version in VERSIONS[1:]:
        s, _ = _one_replica_bytes(train, version, 3)
        assert s["refit/delta"] == 1 and s["refit/relay_fallbacks"] == 0
        assert 0 < s["refit/bytes"] < s["refit/bytes_full"] / 3 / 2  # one replica's delta, under half its bytes
        assert 0 < s["refit/bytes_relayed"] < s["refit/bytes_full"] / 3  # forwarded as they are: deltas
    assert [r["delta"] for r in gen[0]] == [False, True, True, True]


def test_fanout_bench_reports_one_json_line(capsys):
    """scripts/bench_fanout.py at a tiny size: direct and chain side by side, a head killed."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    bench = [sys.executable, str(root / "scripts" / "bench_fanout.py")]
    run = subprocess.run([*bench, "--json", "--dim", "256", "--layers", "4", "--reps", "2", "--mbps", "200"],
                         capture_output=True, text=True, timeout=300, cwd=root, env=preload_env("torch"))
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["bit_exact"] is True and result["relay_killed_ok"] is True
    assert result["trainer_egress_over_minimal"] == 1.0 and result["direct_egress_over_minimal"] == 3.0
    assert result["fanout_over_direct_s"] > 0
    sys.path.insert(0, str(root / "scripts"))  # its refusal, in this process (a fresh one imports torch again)
    import bench_fanout

    with pytest.raises(SystemExit) as bad:
        bench_fanout.main(["--replicas", "1"])
    assert bad.value.code == 2 and "fan-out needs at least 2 replicas" in capsys.readouterr().err


def test_fanout_demo_megatron_to_three_transformers_replicas_in_a_chain(capfd):
    """``demo --gen-dp 3 --fanout chain --delta on``: Megatron TP2 train ranks, a real optimizer
    step per refit, three transformers replicas in a chain: every refit bit-exact against Bridge's
    own export on every replica, what each serves checked against the trainer's forward, the train
    ranks sending one replica's bytes (a delta's from refit 2 on), the replicas relaying the rest."""
    import json

    from megatron_refit.tools.demo import main

    assert main(["--gen-dp", "3", "--fanout", "chain", "--delta", "on", "--json"]) == 0
    result = json.loads(capfd.readouterr().out.splitlines()[-1])
    assert result["ok"] and result["bit_exact"] and result["fanout"] == "chain"
    first, *later = result["refits"]
    assert first["bytes_sent"] * 3 == first["bytes_minimal"] and first["bytes_relayed"] >= 2 * first["bytes_sent"]
    for refit in result["refits"]:
        assert refit["relay_fallbacks"] == 0 and refit["replicas_ok"] == 3 and refit["serving"]["checked"] == 3
    for refit in later:
        assert refit["delta"] and 0 < refit["bytes_relayed"] < first["bytes_relayed"]
