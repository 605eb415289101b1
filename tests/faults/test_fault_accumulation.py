"""Faults in a run of text data with train.grad_accum=2: a stop in the second batch of a step drops
the gradients of the first too, and the checkpoint keeps the data position from before the dropped
step, so the resumed run trains on the same sequences as the uninterrupted one, step for step."""

import signal
from pathlib import Path

import pytest
from faultrun import RUN, assert_resumes_exactly, finish, losses, run_process, start_process, step_of, wait_for
from tiny_models import tiny_model

from oomb.cli import main
from oomb.train.loop.faults import EXIT_INTERRUPTED, EXIT_OUT_OF_MEMORY
from oomb.train.runfolder.checkpoint import checkpoint_state, find_checkpoint


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> list[str]:
    """Arguments of a text run: a local model folder (byte-level tokenizer, 257 ids) and a few documents."""
    root = tmp_path_factory.mktemp("text")
    tiny_model("llama", vocab_size=300).save_pretrained(root / "model")
    texts = root / "texts"
    texts.mkdir()
    for i in range(8):  # ~2.6k bytes: 6 steps x 2 x 512 tokens wrap the corpus (the epoch is data state too)
        (texts / f"doc{i}.txt").write_text(f"Document {i}: " + "the quick brown fox jumps over the lazy dog. "
                                           * (3 + i))
    return [f"model.path={root / 'model'}", "data.task=text", f"data.paths=[{texts}]", "train.grad_accum=2", *RUN]


@pytest.fixture(scope="module")
def straight_text(tmp_path_factory, text_run) -> Path:
    run = tmp_path_factory.mktemp("straight-text") / "run"
    assert main(["train", f"out_dir={run}", "train.save_every=2", *text_run]) == 0
    return run


def test_sigint_in_the_second_accumulated_batch_drops_the_step_and_rewinds_the_data(tmp_path, text_run,
                                                                                     straight_text):
    run, marker = tmp_path / "run", tmp_path / "in-chunk"
    proc = start_process("slow-chunk", f"out_dir={run}", *text_run, fault_step=3, fault_batch=2, marker=marker)
    wait_for(marker.exists, proc, "batch 2 of step 3")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == EXIT_INTERRUPTED, (out, err)
    assert "interrupted by SIGINT after step 2 of 6 (step 3 was in progress and is dropped" in out
    ckpt = find_checkpoint(run)
    assert step_of(ckpt) == 2 and sorted(losses(run)) == [1, 2]
    # Step 3 had drawn its sequences; the checkpoint holds the position before them.
    expected = checkpoint_state(straight_text / "checkpoints" / "step-00000002")["data"]
    assert checkpoint_state(ckpt)["data"] == expected
    assert expected["corpus"] != checkpoint_state(straight_text / "checkpoints" / "step-00000004")["data"]["corpus"]
    assert_resumes_exactly(run, straight_text)


def test_out_of_memory_in_the_second_accumulated_batch_saves_the_step_before(tmp_path, text_run, straight_text):
    run = tmp_path / "run"
    proc = run_process("oom-cuda", f"out_dir={run}", *text_run, fault_step=4, fault_batch=2)
    assert proc.returncode == EXIT_OUT_OF_MEMORY, (proc.stdout, proc.stderr)
    out = " ".join(proc.stdout.split())
    assert "out of memory in the forward/backward pass of step 4" in out
    assert "The model and optimizer are as after step 3 and were saved to" in out
    assert step_of(find_checkpoint(run)) == 3 and sorted(losses(run)) == [1, 2, 3]
    assert_resumes_exactly(run, straight_text)
