"""Lesson 10: the hand-written all-reduces equal dist.all_reduce, and move exactly the bytes
the formulas say; the lesson's table and its broken mode do what the doc claims."""
import json
import re
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import (import_lesson, lesson_path, make_lesson, one_error_line, parse_error,
                      run_lesson, run_with_line_times)

SIZES = [1, 2, 3, 4, 5, 7, 12, 1000, 1001, 4099]  # several not divisible by 2, 3 or 4; some < N


def load_lesson():
    return import_lesson("10")


def expected_ring_bytes(size: int, n: int, rank: int) -> tuple[int, int]:
    """Written independently of the lesson: chunk i has size//n elements, plus one for the
    first size % n chunks (torch.tensor_split's rule). A rank sends all chunks but r+1 and
    then all but r+2; it receives all but r, then all but r+1."""
    c = [size // n + (1 if i < size % n else 0) for i in range(n)]
    sent = sum(c) - c[(rank + 1) % n] + sum(c) - c[(rank + 2) % n]
    received = sum(c) - c[rank] + sum(c) - c[(rank + 1) % n]
    return 4 * sent, 4 * received


GROUPS = [[0, 1, 2, 3], [1, 2, 3], [0, 2]]  # group rank != global rank in the last two


def check_groups(rank: int, world: int) -> None:
    """One rank of a world of 4 (run_ranks has joined the gloo group). For a world of 4 and
    the subgroups of 3 and 2 ranks: both algorithms against dist.all_reduce, and every rank's
    bytes against the formulas."""
    lesson = load_lesson()
    groups = [dist.group.WORLD] + [dist.new_group(ranks) for ranks in GROUPS[1:]]
    for ranks, group in zip(GROUPS, groups):
        if rank not in ranks:
            continue
        n, me = len(ranks), ranks.index(rank)
        assert dist.get_rank(group) == me
        for size in SIZES:
            x = torch.randn(size, generator=torch.Generator().manual_seed(100 * size + rank))
            expected = x.clone()
            dist.all_reduce(expected, group=group)

            got, wire = x.clone(), lesson.Wire(group)
            lesson.server_all_reduce(got, wire)
            torch.testing.assert_close(got, expected)
            s = 4 * size
            assert (wire.sent, wire.received) == (((n - 1) * s, (n - 1) * s) if me == 0 else (s, s))

            got, wire = x.clone(), lesson.Wire(group)
            lesson.ring_all_reduce(got, wire)
            torch.testing.assert_close(got, expected)
            assert (wire.sent, wire.received) == expected_ring_bytes(size, n, me), (size, n, me)
            assert (wire.sent, wire.received) == lesson.ring_bytes(size, n, me)
            if size % n == 0:  # the textbook formula, exactly, when N divides S
                assert wire.sent == wire.received == 2 * (n - 1) * s // n
    dist.barrier()


def test_algorithms_equal_all_reduce_and_bytes_match_formulas():
    """Worlds of 4, 3 and 2 ranks (the last two as subgroups whose ranks are renumbered)."""
    from common.distributed import run_ranks
    run_ranks(check_groups, 4, timeout_s=240, group_timeout_s=30)


def test_ring_bytes_formula_helpers():
    lesson = load_lesson()
    for n in (2, 3, 4, 5):
        for size in (n, 10 * n, 10 * n + 1, 1001):
            per_rank = [lesson.ring_bytes(size, n, r) for r in range(n)]
            assert per_rank == [expected_ring_bytes(size, n, r) for r in range(n)]
            # every byte sent is received by someone
            assert sum(s for s, _ in per_rank) == sum(r for _, r in per_rank)
            if size % n == 0:
                assert all(s == r == lesson.ring_formula(size, n) for s, r in per_rank)


def test_default_world_table_and_bytes(tmp_path):
    proc = make_lesson("10", "--out", tmp_path, "--sizes", "1000,100003", "--repeats", "2",
                       timeout=180)
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["lesson"] == "10" and m["world_size"] == 4 and m["backend"] == "gloo"
    big = 100003  # not divisible by 2, 3 or 4
    for row in m["server_bytes"]:
        want = 3 * 4 * big if row["rank"] == 0 else 4 * big
        assert row["sent"] == row["received"] == want
    for row in m["ring_bytes"]:
        assert (row["sent"], row["received"]) == expected_ring_bytes(big, 4, row["rank"])
    # correctness sweep: worlds 2, 3, 4, all within float tolerance of dist.all_reduce
    assert [c["n"] for c in m["checks"]] == [2, 3, 4]
    assert all(c["server_max_diff"] < 1e-4 and c["ring_max_diff"] < 1e-4 for c in m["checks"])
    # the table: every N x S x algorithm, with positive times and measured bytes = formula
    cells = {(c["n"], c["size"], c["algorithm"]): c for c in m["table"]}
    assert len(cells) == 3 * 2 * 3
    for n in (2, 3, 4):
        for size in (1000, big):
            assert all(cells[(n, size, a)]["median_ms"] > 0
                       for a in ("server", "ring", "dist.all_reduce"))
            assert cells[(n, size, "server")]["busiest_sent"] == (n - 1) * 4 * size
            ring_max = max(expected_ring_bytes(size, n, r)[0] for r in range(n))
            assert cells[(n, size, "ring")]["busiest_sent"] == ring_max
            assert cells[(n, size, "dist.all_reduce")]["busiest_sent"] is None
    # the shape the lesson is about: the server's busiest rank grows linearly, the ring's
    # stays below 2 S
    server = [cells[(n, big, "server")]["busiest_sent"] for n in (2, 3, 4)]
    ring = [cells[(n, big, "ring")]["busiest_sent"] for n in (2, 3, 4)]
    assert server[2] == 3 * server[0] and all(r < 2 * 4 * big for r in ring)
    out = proc.stdout
    steps = [int(k) for k in re.findall(r"^Step (\d+):", out, re.M)]
    assert steps == list(range(1, 8))
    assert "NO" not in out.split("Step 2:")[1].split("Step 5:")[0]  # every byte row matches
    assert re.search(r"^AG 3\s+(0123 ){3}0123", out, re.M), "the ring picture ends complete"
    assert "\x1b[" not in out


def test_a_rank_that_skips_the_ring_ends_the_job_within_the_timeout(tmp_path):
    timeout = 3
    rc, lines, stderr = run_with_line_times(
        [sys.executable, str(lesson_path("10")), "--out", str(tmp_path), "--world-size", "2",
         "--skip-rank", "1", "--timeout", str(timeout)], timeout=150)
    skipped = [t for t, line in lines if "--skip-rank 1: skipping" in line]
    assert skipped, [line for _, line in lines][-10:]
    waited = lines[-1][0] - skipped[0]
    assert timeout <= waited + 0.5, "it failed before anyone could have timed out?"
    assert waited < timeout + 20, f"job ended {waited:.1f}s after the skip (bound: timeout + 20s)"
    assert rc == 1
    error = [line for line in stderr.splitlines() if line.strip()]
    assert len(error) == 1 and "Traceback" not in stderr, stderr
    assert error[0].startswith("error: rank") and "--timeout" in error[0], error[0]
    assert not (tmp_path / "metrics.json").exists()
    # steps 1-3 ran before the break: a world of 2 draws its own ring
    out = "".join(line for _, line in lines[:-1])
    assert re.search(r"^start\s+0· 0·\s+·1 ·1", out, re.M), out
    assert re.search(r"^AG 1\s+01 01\s+01 01", out, re.M), out


@pytest.mark.parametrize("flags, expect", [
    (["--world-size", "1"], "--world-size 2"),
    (["--world-size", "20"], "--world-size"),
    (["--skip-rank", "4"], "--skip-rank 4"),
    (["--sizes", "0"], "--sizes"),
    (["--sizes", "1e6"], "--sizes"),
    (["--repeats", "0"], "--repeats"),
    (["--device", "cuda"], "--device"),
])
def test_bad_flags_are_one_clear_line(flags, expect, monkeypatch, capsys):
    line = parse_error(load_lesson(), flags, monkeypatch, capsys)
    assert expect in line, line


def test_a_bad_flag_from_the_command_line():
    line = one_error_line(run_lesson("10", "--world-size", "1", check=False, timeout=60))
    assert line.startswith("error:") and "--world-size 2" in line, line
