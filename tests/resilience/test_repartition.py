"""Layers moved between stages of a running job, from live holders: the model stays the failure-free one.

A 3 x 2 tiny GPT (embedding, 3 blocks, head: five layers, cut [0, 2, 3, 5]) with worker (1, 1) absent trains 7
iterations under ``ds-recycle launch``; before iteration 0 the layers move to [0, 1, 3, 5] (block 1 leaves stage 0,
so the first-stage clipping norm is gathered from two stages), before 1 to [0, 3, 4, 5] (stage 0 holds a block of
stage 1, which its norm leaves out), before 3 to [0, 2, 4, 5], before 5 back to the job's own cut. Iterations 0 and
1 clip their gradients (so both ways of taking the norm count). Its final parameters equal the failure-free
reference bit for bit.
"""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from ds_recycle.events import Event, RejoinEvent, RepartitionEvent, events_of  # noqa: E402
from tests.harness import assert_same_model, launch, run, tiny_config  # noqa: E402

STEPS = 7
REJOIN_STEPS = 100  # the failure-free reference of tests/resilience/test_rejoin.py
SECOND_STEPS = 30  # that of tests/resilience/test_fail_slow.py
pytestmark = [pytest.mark.multiprocess]
STEADY = {"enabled": False}
"""``recycle.fail_slow`` of the jobs that count their moves: with four or six workers on two cores, a worker can
measure 1.3 times its stage peer's pace for long enough to be planned slow (a move of its own). The moves of a slow
worker are tested in tests/resilience/test_fail_slow.py."""


@pytest.mark.timeout(400)
def test_layers_move_there_and_back_same_model(tmp_path: Path, reference: Callable[[int, int, int], Path]) -> None:
    config = tiny_config(tmp_path, "moving", 3, 2, assume_failed=[[1, 1]], fail_slow=STEADY)
    out = tmp_path / "final.pt"
    job = run([sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", "5", "--master_port", "0",
               str(REPO / "tests" / "engine" / "_repartition_job.py"), "--deepspeed_config", str(config),
               "--steps", str(STEPS), "--move", "0=0,1,3,5", "--move", "1=0,3,4,5", "--move", "3=0,2,4,5",
               "--move", "5=0,2,3,5",
               "--save-final", str(out)], timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    moved = re.findall(r"MOVED (\d) (\[.*?\]) holds (\[.*?\])", job.output)
    assert len(moved) == 4 * 5, job.output[-3000:]  # every live worker, each move
    assert {(k, holds) for k, _, holds in moved} == {("0", "[0, 1, 3, 5]"), ("1", "[0, 3, 4, 5]"),
                                                     ("3", "[0, 2, 4, 5]"), ("5", "[0, 2, 3, 5]")}
    # before iteration 0: block 1 goes to stage 1's one live worker (rank 2 is (0, 1); (1, 1) is absent), from
    # stage 0 of its own pipeline (rank 0)
    first = {lists for k, lists, _ in moved if k == "0"}
    assert first == {"[(1, 0, 2)]"}, first
    assert re.search(r"step 0 loss \S+ clipped True", job.output) and re.search(r"step 1 loss \S+ clipped True",
                                                                                job.output), "no clipping"
    assert_same_model(out, reference(3, 2, STEPS))


TIED_STEPS = 7


@pytest.mark.timeout(400)
def test_blocks_move_around_tied_embeddings_and_checkpointed_segments_same_model(tmp_path: Path) -> None:
    """A 2 x 2 GPT whose head shares the embedding table (``tie_embeddings``: layers [tied embedding, block, block,
    LayerNorm, tied head], cut [0, 2, 5]), every layer a checkpointed segment; worker (1, 0) killed in iteration 1,
    never restarted: once the failure has lasted 3 iterations the first block leaves stage 0, which keeps only the
    tied embedding (the clipping norm then gathers the block's from stage 1, the table's first), and stage 1 runs
    four segments where it had three. The tied layers stay where they are; the final parameters are the failure-free
    run's, bit for bit."""
    model = {"vocab_size": 256, "seq_len": 32, "n_layer": 2, "d_model": 64, "n_head": 4, "tie_embeddings": True}
    runs = {}
    for name, kills in [("free", []), ("killed", ["--kill", "1:0@1:forward"])]:
        config = tiny_config(tmp_path, name, 2, 2, model=model, failure_timeout_s=60.0)
        job_config = json.loads(config.read_text())
        config.write_text(json.dumps({**job_config, "gradient_clipping": 0.05,  # every step clips: the norm counts
                                      "pipeline": {"activation_checkpoint_interval": 1}}))
        out, metrics = tmp_path / f"{name}.pt", tmp_path / f"{name}.jsonl"
        job = launch(4, ["--deepspeed_config", str(config), "--steps", str(TIED_STEPS), "--save-final", str(out),
                         "--metrics", str(metrics), *kills], timeout=300)
        assert job.returncode == 0, job.output[-4000:]
        runs[name] = (job, out, metrics)
    job, out, metrics = runs["killed"]
    moves = [e for e in events_of(job.metrics(metrics), Event) if isinstance(e, RepartitionEvent)]
    assert [(m.before, m.after) for m in moves] == [((0, 2, 5), (0, 1, 5))], moves
    assert_same_model(out, runs["free"][1])


@pytest.mark.timeout(400)
def test_a_lasting_failure_moves_layers_and_a_rejoin_moves_them_back(
        tmp_path: Path, reference: Callable[[int, int, int], Path]) -> None:
    """2 x 2, worker (1, 0) killed in iteration 2 and started again 3 s later: the members move a block off the
    stage that lost a replica once the failure has lasted 3 iterations (the default), move it back before the
    restarted worker joins, and end at the failure-free model, bit for bit."""
    out, metrics = tmp_path / "final.pt", tmp_path / "metrics.jsonl"
    config = tiny_config(tmp_path, "k", 2, 2, failure_timeout_s=60.0, fail_slow=STEADY)
    job = launch(4, ["--deepspeed_config", str(config), "--steps", str(REJOIN_STEPS), "--save-final", str(out), "--metrics", str(metrics),
                     "--kill", "1:0@2:forward"], timeout=300, launcher_args=["--restart_failed_after", "3"])
    assert job.returncode == 0, job.output[-4000:]
    events = [e for e in events_of(job.metrics(metrics), Event)
              if e.kind in ("failure", "repartition", "rejoin")]
    assert [e.kind for e in events] == ["failure", "repartition", "repartition", "rejoin"], events
    there, back, rejoin = events[1], events[2], events[3]
    assert isinstance(there, RepartitionEvent) and isinstance(back, RepartitionEvent)
    assert (there.before, there.after, there.absent) == ((0, 2, 4), (0, 1, 4), ((1, 0),))
    assert (back.before, back.after) == ((0, 1, 4), (0, 2, 4))
    assert there.planned_after is not None and there.planned_before is not None
    assert there.planned_after < there.planned_before and back.planned_before is None
    assert isinstance(rejoin, RejoinEvent) and back.iteration == rejoin.iteration
    assert_same_model(out, reference(2, 2, REJOIN_STEPS))


@pytest.mark.timeout(400)
def test_failures_after_a_move_are_survived_and_decided_again(
        tmp_path: Path, reference: Callable[[int, int, int], Path]) -> None:
    """2 x 3: workers (1, 0) and (2, 0) are killed in iteration 2 and the first stage's block moves to the second
    stage (one live replica against three); then (1, 1) and (2, 1) are killed in iteration 12: the job recovers on
    the moved partition, decides again for the new failure set (one replica a stage), moves the block back, and ends
    at the failure-free model."""
    out, metrics = tmp_path / "final.pt", tmp_path / "metrics.jsonl"
    kills = ["1:0@2:forward", "2:0@2:forward", "1:1@12:backward-input", "2:1@12:backward-input"]
    config = tiny_config(tmp_path, "k", 2, 3, failure_timeout_s=60.0, fail_slow=STEADY)
    job = launch(6, ["--deepspeed_config", str(config), "--steps", str(SECOND_STEPS), "--save-final", str(out), "--metrics", str(metrics),
                     *(a for k in kills for a in ("--kill", k))], timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    events = [e for e in events_of(job.metrics(metrics), Event) if e.kind in ("failure", "repartition")]
    moves = [e for e in events if isinstance(e, RepartitionEvent)]
    assert [(m.before, m.after) for m in moves] == [((0, 2, 4), (0, 1, 4)), ((0, 1, 4), (0, 2, 4))], events
    assert events.index(moves[0]) < max(i for i, e in enumerate(events) if e.kind == "failure") < events.index(moves[1])
    assert_same_model(out, reference(2, 3, SECOND_STEPS))


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("victim", "installed"), [("1:1@4:layer-move", False)], ids=["before-the-barrier"])
def test_a_failure_inside_a_move_is_survived(tmp_path: Path, reference: Callable[[int, int, int], Path], victim: str,
                                             installed: bool) -> None:
    """2 x 2, worker (1, 0) killed in iteration 0 for good: the members move a block off stage 0 before iteration 4,
    and a second worker of stage 1 dies inside that move, with its layers received but before the members agree the
    move is done: nobody installs it, the recovery drops what each received, and the job goes on on its partition to
    the failure-free model. (``("0:1@4:layer-moved", True)``, a worker lost after the members agreed, the others
    installing, passes too; left out of the suite for time: it is the path of a failure after a move.)"""
    out, metrics = tmp_path / "final.pt", tmp_path / "metrics.jsonl"
    job = launch(4, ["--deepspeed_config", str(tiny_config(tmp_path, "k", 2, 2, failure_timeout_s=60.0)),
                     "--steps", str(STEPS), "--save-final", str(out), "--metrics", str(metrics),
                     "--kill", "1:0@0:forward", "--kill", victim], timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    events = [e for e in events_of(job.metrics(metrics), Event) if e.kind in ("failure", "repartition")]
    assert [e.kind for e in events if e.kind == "failure"] == ["failure", "failure"], events
    assert f"fault injection: killing this worker ({victim})" in job.output
    moves = [(e.before, e.after) for e in events if isinstance(e, RepartitionEvent)]
    assert (((0, 2, 4), (0, 1, 4)) in moves) is installed, events
    assert ("layer move dropped in the recovery" in job.output) is not installed, job.output[-3000:]
    assert_same_model(out, reference(2, 2, STEPS))


@pytest.mark.timeout(400)
def test_a_checkpoint_written_while_moved_is_the_jobs_own_partition(
        tmp_path: Path, reference: Callable[[int, int, int], Path]) -> None:
    """2 x 2, worker (1, 0) killed in iteration 1 and never restarted: the layers move before iteration 5, and the
    checkpoint after it is written once they moved back (its files are the job's own partition's); a job of all
    four workers resumes from it and ends at the failure-free model."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    config = tiny_config(tmp_path, "k", 2, 2, failure_timeout_s=60.0)
    job = launch(4, ["--deepspeed_config", str(config), "--steps", str(STEPS), "--metrics", str(metrics),
                     "--checkpoint-dir", str(ckpt), "--checkpoint-interval", "6", "--kill", "1:0@1:forward"],
                 timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    events = [e for e in events_of(job.metrics(metrics), Event) if e.kind in ("repartition", "checkpoint")]
    assert [e.kind for e in events] == ["repartition", "repartition", "checkpoint"], events
    assert isinstance(events[1], RepartitionEvent) and events[1].after == (0, 2, 4)
    out = tmp_path / "resumed.pt"
    again = launch(4, ["--deepspeed_config", str(config), "--steps", str(STEPS), "--checkpoint-dir", str(ckpt),
                       "--resume", "--save-final", str(out)], timeout=300)
    assert again.returncode == 0, again.output[-4000:]
    assert "resum" in again.output.lower()
    assert_same_model(out, reference(2, 2, STEPS))
