"""benchmarks.unsloth_step on a CPU: its arguments, the longest-length search against stand-in runners and
processes, the record's shape and the model folder (a tiny config); Unsloth itself runs only on a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import unsloth_step as us

ROOT = Path(__file__).resolve().parents[2]


def test_the_module_imports_nothing_unsloth_must_come_before():
    # Unsloth patches transformers, peft and trl when it is imported first: the step process imports it after this
    # module, so the module (and --help) must not pull them in.
    code = ("import sys, benchmarks.unsloth_step; "
            "print([m for m in ('transformers', 'peft', 'trl', 'oomb', 'unsloth') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    helped = subprocess.run([sys.executable, "-m", "benchmarks.unsloth_step", "--help"], cwd=ROOT,
                            capture_output=True, text=True)
    assert helped.returncode == 0 and "--longest" in helped.stdout and "--prepare-model" not in helped.stdout


def test_import_unsloth_refuses_after_transformers(monkeypatch):
    import transformers  # noqa: F401  (this process has it already: the guard must see it)

    with pytest.raises(RuntimeError, match="transformers.*imported before unsloth"):
        us.import_unsloth()


def test_arguments_and_their_defaults():
    args = us.parse_args(["--lengths", "16384,65536"])
    assert (args.preset, args.rank, args.alpha, args.optimizer, args.repeats, args.warmup) == (
        "llama-3-8b", 32, 32, "adamw8bit", 2, True)
    assert args.model_dir.endswith("oomb-unsloth/llama-3-8b") and args.argv == ["--lengths", "16384,65536"]
    assert us.system_name(args) == "unsloth-qlora-r32"
    s = us.settings(args)
    assert s["lora"]["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (s["gradient_checkpointing"], s["load_in_4bit"], s["optimizer"]) == ("unsloth", True, "adamw8bit")
    longest = us.parse_args(["--longest", "--known-fits", "131072", "--preset", "qwen3-8b", "--tiled-mlp"])
    assert longest.longest and longest.lengths is None and longest.known_fits == 131072
    assert longest.model_dir.endswith("oomb-unsloth/qwen3-8b") and us.system_name(longest).endswith("-tiled-mlp")
    for bad in ([], ["--lengths", "1024", "--repeats", "0"], ["--lengths", "1024", "--optimizer", "sgd"],
                ["--longest", "--known-fits", "4096", "--known-fails", "4096"]):
        with pytest.raises(SystemExit):
            us.parse_args(bad)


def test_refused_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert us.main(["--lengths", "1024"]) == 2
    assert us.main(["--longest"]) == 2
    assert capsys.readouterr().err.count("needs a CUDA GPU") == 2


def test_row_status_reads_the_error():
    assert us.row_status({"seq_len": 1, "step_s": 1.0}) == "ok"
    assert us.row_status({"error": "out of memory: CUDA out of memory. Tried to allocate"}) == "oom"
    assert us.row_status({"error": "killed by signal 9 (SIGKILL: ...)"}) == "killed"
    assert us.row_status({"error": "timeout: killed after 60 s"}) == "timeout"
    assert us.row_status({"error": "RuntimeError: Triton compile failed"}) == "error"
    assert us.error_text(torch.OutOfMemoryError("CUDA out of memory.\nmore")) == "out of memory: CUDA out of memory."
    assert us.error_text(ValueError("bad\nthing")) == "ValueError: bad"


class FakeRunner:
    """Steps fit up to ``limit`` tokens; each call a process (one model load), its lengths in order up to the
    first failure. ``clock``: advanced by each try's seconds (overhead + step time growing with length^2)."""

    def __init__(self, limit, *, overhead=60.0, step_at_64k=20.0, clock=None, failure="out of memory: CUDA"):
        self.limit, self.overhead, self.step_at_64k, self.clock = limit, overhead, step_at_64k, clock
        self.failure = failure
        self.calls = []

    def __call__(self, lengths, timeout_s):
        self.calls.append((list(lengths), timeout_s))
        rows, wall = [], self.overhead
        for n in lengths:
            if n > self.limit:
                rows.append({"seq_len": n, "error": self.failure})
                break
            step = self.step_at_64k * (n / 65536) ** 2
            wall += step
            rows.append({"seq_len": n, "step_s": step})
        if self.clock is not None:
            self.clock.now += wall
        for row in rows:
            row.update({"try": len(self.calls) - 1, "try_wall_s": wall})
        return rows


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_the_search_doubles_then_bisects_one_process_per_try():
    run = FakeRunner(limit=300_000)
    got = us.longest_search(run, start=65536, max_length=1 << 20, resolution=8192, align=1024, budget_s=1e9)
    assert got["stopped"] == "resolved"
    lo, hi = got["longest_ok"], got["shortest_failed"]
    assert lo <= 300_000 < hi and hi - lo <= 8192 and lo % 1024 == 0 and hi % 1024 == 0
    assert all(len(lengths) == 1 for lengths, _ in run.calls)  # each try its own process
    tried = [lengths[0] for lengths, _ in run.calls]
    assert tried[:4] == [65536, 131072, 262144, 524288]  # doubling until the first failure
    assert tried[4] == 393216  # then the midpoint of 262144 and 524288
    assert [t["status"] for t in got["tries"]][:4] == ["ok", "ok", "ok", "oom"]
    assert len(got["tries"]) == len(tried)


def test_the_doubling_can_share_a_process_and_a_killed_try_bounds_too():
    run = FakeRunner(limit=200_000, failure="killed by signal 9")
    got = us.longest_search(run, start=65536, max_length=1 << 20, resolution=16384, align=1024, budget_s=1e9,
                            grow_in_one_process=True)
    assert run.calls[0][0] == [65536, 131072, 262144, 524288, 1048576]
    assert [t["seq_len"] for t in got["tries"][:3]] == [65536, 131072, 262144]  # it stopped at its first failure
    assert got["tries"][2]["status"] == "killed"
    assert all(len(lengths) == 1 for lengths, _ in run.calls[1:])  # the bisection: a process per try
    assert got["longest_ok"] <= 200_000 < got["shortest_failed"] and got["stopped"] == "resolved"


def test_when_the_start_fails_the_search_halves():
    run = FakeRunner(limit=20_000)
    got = us.longest_search(run, start=65536, max_length=1 << 20, resolution=2048, align=1024, budget_s=1e9)
    tried = [lengths[0] for lengths, _ in run.calls]
    assert tried[:3] == [65536, 32768, 16384]
    assert got["longest_ok"] <= 20_000 < got["shortest_failed"] and got["stopped"] == "resolved"
    nothing = us.longest_search(FakeRunner(limit=100), start=4096, max_length=1 << 20, resolution=1024, align=1024,
                                budget_s=1e9)
    assert (nothing["longest_ok"], nothing["shortest_failed"], nothing["stopped"]) == (None, 1024, "nothing_fits")


def test_everything_fitting_stops_at_the_longest_allowed():
    got = us.longest_search(FakeRunner(limit=1 << 30), start=65536, max_length=300_000, resolution=8192, align=1024,
                            budget_s=1e9)
    assert (got["longest_ok"], got["shortest_failed"], got["stopped"]) == (262144, None, "max_length")


def test_known_bounds_go_straight_to_the_bisection():
    run = FakeRunner(limit=300_000)
    got = us.longest_search(run, start=65536, max_length=1 << 20, resolution=8192, align=1024, budget_s=1e9,
                            known_fits=262144, known_fails=393216)
    assert run.calls[0][0] == [327680]
    assert got["longest_ok"] <= 300_000 < got["shortest_failed"] <= 393216
    grown = FakeRunner(limit=300_000)
    us.longest_search(grown, start=65536, max_length=1 << 20, resolution=8192, align=1024, budget_s=1e9,
                      known_fits=131072)
    assert grown.calls[0][0] == [262144]  # past what fits, the start being shorter
    aimed = FakeRunner(limit=300_000)
    us.longest_search(aimed, start=290816, max_length=1 << 20, resolution=8192, align=1024, budget_s=1e9,
                      known_fits=131072)
    assert aimed.calls[0][0] == [290816]  # a start aimed past it (memory_fit's guess) is tried first
    with pytest.raises(ValueError):
        us.longest_search(grown, start=1, max_length=2, resolution=1, align=1, budget_s=1, known_fits=4, known_fails=2)


def test_the_budget_stops_tries_that_would_not_end_in_time():
    # 60 s a process, 20 s a step at 64K growing as length^2: 80 s at 64K, 140 s at 128K, 380 s at 256K.
    clock = Clock()
    run = FakeRunner(limit=1 << 30, clock=clock)
    got = us.longest_search(run, start=65536, max_length=1 << 20, resolution=8192, align=1024, budget_s=400,
                            clock=clock)
    assert [lengths[0] for lengths, _ in run.calls] == [65536, 131072]  # 256K: about 380 s, 180 s left
    assert got["stopped"] == "budget" and got["longest_ok"] == 131072 and "262144 tokens needs about" in (
        got["stop_detail"])
    assert run.calls[1][1] == pytest.approx(320.0)  # each try may run for what is left of the budget
    assert us.estimate_try_s(got["tries"], 262144) == pytest.approx(60 + 80 * 4)
    assert us.estimate_try_s([], 1024) is None
    clock.now = 0.0
    few = FakeRunner(limit=1 << 30, clock=clock)
    short = us.longest_search(few, start=65536, max_length=1 << 20, resolution=8192, align=1024, budget_s=100,
                              min_try_s=60, clock=clock)
    assert len(few.calls) == 1 and short["stopped"] == "budget"  # 20 s left after the first: under min_try_s


def test_a_timeout_or_an_error_ends_the_search():
    timed_out = us.longest_search(FakeRunner(limit=100_000, failure="timeout: killed after 300 s"), start=65536,
                                  max_length=1 << 20, resolution=8192, align=1024, budget_s=1e9)
    assert (timed_out["longest_ok"], timed_out["shortest_failed"], timed_out["stopped"]) == (65536, None, "timeout")
    broken = us.longest_search(FakeRunner(limit=100_000, failure="RuntimeError: bad"), start=65536,
                               max_length=1 << 20, resolution=8192, align=1024, budget_s=1e9)
    assert broken["stopped"] == "error" and broken["stop_detail"] == "131072 tokens: RuntimeError: bad"


CHILD = """
import json, os, signal, sys, time
mode, out, lengths = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
rows = []
for n in lengths:
    if n > 200 and mode == "oom":
        rows.append({"seq_len": n, "error": "out of memory: CUDA out of memory"})
    elif n > 200 and mode == "killed":
        print("step at", n, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    elif n > 200 and mode == "hang":
        time.sleep(60)
    elif n > 200 and mode == "crash":
        sys.exit("Traceback: ImportError: no unsloth")
    else:
        rows.append({"seq_len": n, "step_s": 0.5, "peak_gpu_gib": 1.0})
    json.dump({"results": rows}, open(out, "w"))
    if "error" in rows[-1]:
        break
"""


@pytest.mark.parametrize("mode,status", [("oom", "oom"), ("killed", "killed"), ("hang", "timeout"),
                                         ("crash", "error")])
def test_each_try_runs_in_a_process_and_its_death_is_a_row(tmp_path, mode, status):
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    args = us.parse_args(["--longest"])
    run = us.subprocess_runner(args, tmp_path / "tries", command=lambda lengths, out: [
        sys.executable, str(child), mode, str(out), ",".join(str(n) for n in lengths)])
    rows = run([100, 300, 500], timeout_s=3 if mode == "hang" else 60)
    assert [r["seq_len"] for r in rows] == [100, 300]
    assert us.row_status(rows[0]) == "ok" and us.row_status(rows[1]) == status
    assert all(r["try"] == 0 and r["try_wall_s"] > 0 for r in rows)
    if mode == "killed":
        assert rows[1]["error"].startswith("killed by signal 9") and rows[1]["error"].endswith("step at 300")
    if mode == "crash":
        assert rows[1]["error"].startswith("exit code 1") and "no unsloth" in rows[1]["error"]
    assert (tmp_path / "tries" / "try0.log").is_file()
    assert run([100], timeout_s=60)[0]["try"] == 1  # the next try: a process and files of its own
    assert (tmp_path / "tries" / "try1.json").is_file()


def test_the_try_command_times_one_step_per_length():
    args = us.parse_args(["--longest", "--rank", "16", "--optimizer", "adamw", "--model-dir", "/m"])
    cmd = us.try_command(args, [65536, 131072], Path("/w/try0.json"))
    assert cmd[:2] == ["-m", "benchmarks.unsloth_step"]
    got = us.parse_args(cmd[2:])
    assert (got.lengths, got.repeats, got.warmup, got.rank, got.optimizer, got.model_dir, got.out, got.longest) == (
        "65536,131072", 1, False, 16, "adamw", "/m", "/w/try0.json", False)


def test_lora_on_bf16_and_full_fine_tuning_are_their_own_systems(tmp_path):
    lora = us.parse_args(["--lengths", "4096", "--base", "bf16", "--rank", "16"])
    assert (lora.base, us.system_name(lora)) == ("bf16", "unsloth-lora-r16")
    assert us.settings(lora)["load_in_4bit"] is False and us.settings(lora)["lora"]["r"] == 16
    full = us.parse_args(["--lengths", "4096", "--full"])
    assert (full.base, us.system_name(full)) == ("bf16", "unsloth-full")
    assert us.settings(full)["full_finetuning"] is True and us.settings(full)["lora"] is None
    assert us.settings(us.parse_args(["--lengths", "4096"]))["load_in_4bit"] is True  # QLoRA stays the default
    with pytest.raises(SystemExit):
        us.parse_args(["--lengths", "4096", "--full", "--base", "nf4"])
    (tmp_path / "chat.jsonl").write_text("")
    with pytest.raises(SystemExit):  # no chat.jinja beside the data
        us.parse_args(["--lengths", "4096", "--packed-data", str(tmp_path / "chat.jsonl")])
    # a --longest try runs what its search runs
    (tmp_path / "chat.jinja").write_text("")
    args = us.parse_args(["--longest", "--full", "--packed-data", str(tmp_path / "chat.jsonl")])
    got = us.parse_args(us.try_command(args, [4096], tmp_path / "t.json")[2:])
    assert (got.full, got.base, got.packed_data) == (True, "bf16", str(tmp_path / "chat.jsonl"))


def test_packed_steps_read_the_packer_s_sequences_with_their_positions(tmp_path):
    from benchmarks.packed import packed_batches, position_ids_of, write_chat_data

    data, template = write_chat_data(tmp_path, 40, seed=2)
    args = us.parse_args(["--preset", "qwen2.5-0.5b", "--lengths", "2048", "--packed-data", str(data)])
    next_inputs = us.step_inputs(args, 1000, 2048, device="cpu")
    expected = packed_batches("qwen2.5-0.5b", 2048, data, template)
    for _ in range(2):  # each step the next sequence, as the stack and `oomb train` read them
        ids, labels, positions = next_inputs()
        batch = expected.batch(1)
        assert torch.equal(ids, batch.input_ids) and torch.equal(labels, batch.labels)
        assert torch.equal(positions, position_ids_of(batch.doc_ids)) and int((positions == 0).sum()) >= 2
    random_ids = us.step_inputs(us.parse_args(["--lengths", "64"]), 1000, 64, device="cpu")
    ids, labels, positions = random_ids()
    assert ids.shape == (1, 64) and labels is ids and positions is None and torch.equal(random_ids()[0], ids)


def test_the_record_has_the_shape_of_the_other_benchmarks():
    args = us.parse_args(["--lengths", "16384,32768", "--out", "x.json"])
    rows = [{"system": "unsloth-qlora-r32", "seq_len": 16384, "step_s": 4.2, "peak_gpu_gib": 12.0},
            {"system": "unsloth-qlora-r32", "seq_len": 32768, "error": "out of memory: CUDA"}]
    record = json.loads(json.dumps(us.build_record(args, rows, complete=True, setup={"load_s": 30.0})))
    assert {"bench", "complete", "command", "date", "machine", "versions", "settings", "unsloth", "results"} <= set(
        record)
    assert record["bench"] == "unsloth" and record["results"] == rows and record["unsloth"] == {"load_s": 30.0}
    assert record["command"] == "python -m benchmarks.unsloth_step --lengths 16384,32768 --out x.json"
    assert {"torch", "transformers", "unsloth", "unsloth_zoo", "bitsandbytes", "peft", "trl"} <= set(
        record["versions"])
    assert "longest" not in record and record["memory_fit"] is None  # one completed length: no line
    result = {"longest_ok": 1, "shortest_failed": 2, "stopped": "resolved", "tries": rows}
    longest = us.build_record(args, rows, complete=True, longest=result)["longest"]
    assert longest == {"longest_ok": 1, "shortest_failed": 2, "stopped": "resolved"}  # the tries are the results


def test_the_memory_fit_says_where_the_peak_reaches_the_card():
    rows = [{"seq_len": 16384, "peak_gpu_gib": 10.0}, {"seq_len": 65536, "peak_gpu_gib": 22.0},
            {"seq_len": 65536, "error": "out of memory: x"}, {"seq_len": 131072, "error": "RuntimeError"}]
    fit = us.memory_fit(rows, capacity_gib=79.0)
    assert fit["gib_per_1k_tokens"] == pytest.approx(12.0 / 48) and fit["base_gib"] == pytest.approx(6.0)
    assert fit["reaches_capacity_at"] == 299008 and fit["lengths"] == [16384, 65536]
    assert us.memory_fit(rows, None)["reaches_capacity_at"] is None
    assert us.memory_fit(rows[:1], 79.0) is None


def test_the_model_folder_is_written_whole_then_marked(tmp_path):
    from oomb.train.config.presets import preset_config

    config = preset_config("llama-3-8b")
    config.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 512})
    folder = tmp_path / "oomb-unsloth" / "llama-3-8b"
    assert not us.model_dir_ready(folder, "llama-3-8b")
    folder.parent.mkdir()
    us.save_model_dir(folder, "llama-3-8b", config=config, device="cpu")
    assert us.model_dir_ready(folder, "llama-3-8b") and not us.model_dir_ready(folder, "qwen3-8b")
    assert not (tmp_path / "oomb-unsloth" / "llama-3-8b.partial").exists()
    saved = json.loads((folder / "config.json").read_text())
    assert (saved["model_type"], saved["vocab_size"], saved["hidden_size"]) == ("llama", 512, 64)
    assert any(p.suffix == ".safetensors" for p in folder.iterdir())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.pad_token == us.PAD_TOKEN and tok.pad_token != tok.eos_token and len(tok) <= 512
    (folder / us.MARKER).unlink()  # a folder whose writing was cut off is built again
    assert not us.model_dir_ready(folder, "llama-3-8b")
