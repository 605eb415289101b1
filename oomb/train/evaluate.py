"""`oomb eval`: perplexity by position and retrieval accuracy of a model, saved as JSON and plots.

    load model (HF folder | oomb run/checkpoint | preset)  ->  check every setting
        -> perplexity by position bucket (held-out documents, chunked_eval)
        -> retrieval accuracy over lengths x depths (synthetic task, chunked_eval)
        -> <out>/results.json, perplexity.png, retrieval.png, a table on the terminal

Both evaluations run through ``oomb.engine.chunked_eval``: the forward of the training
step's stage 1 over every chunk, so a model evaluates at the lengths it trains at.
"""

from __future__ import annotations

import datetime
import json
import shlex
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import oomb
from oomb.sparse import DEFAULT_SCORE, SCORES
from oomb.train.checkpoint import write_text_atomic
from oomb.train.eval_metrics import (
    RETRIEVAL_TASKS,
    bucket_edges,
    finite_json,
    parse_depths,
    parse_lengths,
    perplexity_by_position,
    plot_perplexity,
    plot_retrieval,
    retrieval_grid,
    short_length,
)
from oomb.train.eval_model import (
    DTYPES,
    EvalError,
    base_config,
    check_positions,
    load_eval_model,
    resolve_device,
)
from oomb.train.rope import rope_is_scaled


def add_arguments(parser) -> None:
    """The options of `oomb eval` (every one shows in `oomb eval --help`)."""
    parser.add_argument("model", metavar="MODEL_OR_CHECKPOINT",
                        help="a Hugging Face model folder (local), an oomb run folder (its latest checkpoint) or "
                             "checkpoint folder, or a built-in preset name (random weights, for smoke tests)")
    g = parser.add_argument_group("perplexity by position")
    g.add_argument("--perplexity", nargs="+", metavar="PATH",
                   help="held-out documents (.txt/.md, .jsonl, .parquet files, folders, globs, or a datasets "
                        "save_to_disk folder): run the perplexity-by-position evaluation on them")
    g.add_argument("--ppl-length", type=int, default=4096, metavar="N",
                   help="tokens scored per document: its first N; shorter documents are skipped (default 4096)")
    g.add_argument("--ppl-docs", type=int, default=16, metavar="N",
                   help="at most this many documents (default 16)")
    g.add_argument("--buckets", default="pow2", metavar="pow2|N",
                   help="position buckets: pow2 ([1,2), [2,4), [4,8), ...) or N buckets of equal width "
                        "(default pow2)")
    g.add_argument("--text-field", default="text", metavar="NAME",
                   help="the text field of .jsonl/.parquet/dataset documents (default text)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer folder (default: the model folder's, or a checkpoint's run data.tokenizer or "
                        "model.path; the byte-level tokenizer when there is none)")
    g = parser.add_argument_group("retrieval accuracy")
    g.add_argument("--retrieval", action="store_true",
                   help="run the retrieval evaluation over the grid of --lengths x --depths")
    g.add_argument("--task", default=None, choices=sorted(RETRIEVAL_TASKS),
                   help="the built-in synthetic retrieval task (default: a checkpoint's run task when it is one "
                        "of these, else passkey)")
    g.add_argument("--lengths", default="1k,2k,4k", metavar="L1,L2,...",
                   help="sequence lengths in tokens, k = 1024, M = 1024^2 (default 1k,2k,4k)")
    g.add_argument("--depths", default="0,0.25,0.5,0.75,1", metavar="D1,D2,...",
                   help="where the answer is hidden, as fractions of the sequence (default 0,0.25,0.5,0.75,1)")
    g.add_argument("--samples", type=int, default=4, metavar="N",
                   help="sequences per (length, depth) cell (default 4)")
    g.add_argument("--digits", type=int, default=None, metavar="N",
                   help="answer digits (default: the checkpoint run's data.passkey_digits, else 5)")
    g.add_argument("--seed", type=int, default=None, metavar="N",
                   help="task seed; it also fixes the task's filler vocabulary, so evaluate a checkpoint with "
                        "its run's seed (the default for a checkpoint; 0 otherwise)")
    g = parser.add_argument_group("running")
    g.add_argument("--out", default=None, metavar="DIR",
                   help="output folder for results.json and the plots (default evals/<date-time>); "
                        "a folder that holds files is refused, never overwritten")
    g.add_argument("--chunk-size", type=int, default=4096, metavar="N",
                   help="tokens per chunk (a multiple of --page-size; default 4096)")
    g.add_argument("--page-size", type=int, default=128, metavar="N", help="tokens per K/V page (default 128)")
    g.add_argument("--batch-size", type=int, default=1, metavar="N", help="sequences per forward (default 1)")
    g.add_argument("--page-budget", type=int, default=None, metavar="N",
                   help="page-sparse attention: past pages each query block attends (default: dense, exact)")
    g.add_argument("--select-block", type=int, default=128, metavar="N",
                   help="with --page-budget: queries per selection block (default 128)")
    g.add_argument("--select-score", default=DEFAULT_SCORE, choices=SCORES,
                   help=f"with --page-budget: rank pages by the upper bound over their keys (bound) or by their mean "
                        f"key (mean, the paper's); default {DEFAULT_SCORE}")
    g.add_argument("--offload", action="store_true", help="keep the K/V pages in host memory (docs/offload.md)")
    g.add_argument("--offload-gpu-memory", default="0", metavar="SIZE",
                   help="with --offload: GPU memory for keeping whole layers' pages on the GPU, e.g. 40GiB "
                        "(default 0: two working layers)")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="run Python code shipped in the model folder (auto_map); read that code first. Never "
                        "taken from a run folder's config.json")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="parameter dtype: auto = a checkpoint's training dtype, else bfloat16 on CUDA, "
                        "float32 on CPU")


def _engine_options(args) -> dict:
    """chunked_eval's keywords for --page-budget/--select-block and --offload/--offload-gpu-memory."""
    from oomb.sparse import PageSelection
    from oomb.train.config import ConfigError
    from oomb.train.memory import parse_bytes

    engine: dict = {}
    if args.page_budget is not None:
        if args.page_budget < 1 or args.select_block < 1:
            raise EvalError("--page-budget and --select-block must be positive")
        engine["selection"] = PageSelection(page_budget=args.page_budget, block=args.select_block,
                                            score=args.select_score)
    try:
        gpu_bytes = parse_bytes(args.offload_gpu_memory)
    except ConfigError as e:
        raise EvalError(f"--offload-gpu-memory: {e}") from e
    if gpu_bytes and not args.offload:
        raise EvalError("--offload-gpu-memory sets what an offloaded store keeps on the GPU: add --offload")
    if args.offload:
        engine.update(offload=True, offload_gpu_bytes=gpu_bytes)
    return engine


def run_eval(args, argv: Sequence[str], console: Console | None = None) -> Path:
    """Check everything, evaluate, write results.json and the plots; returns the output folder."""
    console = console or Console()
    ppl_on, retrieval_on = args.perplexity is not None, args.retrieval
    if not (ppl_on or retrieval_on):
        raise EvalError("nothing to evaluate: give --perplexity PATH... and/or --retrieval")
    for name in ("chunk_size", "page_size", "batch_size", "samples", "ppl_length", "ppl_docs"):
        if getattr(args, name) <= 0:
            raise EvalError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.chunk_size % args.page_size:
        raise EvalError(f"--chunk-size {args.chunk_size} must be a multiple of --page-size {args.page_size}")
    engine = _engine_options(args)
    lengths = parse_lengths(args.lengths) if retrieval_on else []
    depths = parse_depths(args.depths) if retrieval_on else []
    edges = bucket_edges(args.ppl_length, args.buckets) if ppl_on else []
    out = Path(args.out) if args.out else Path("evals") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EvalError(f"--out {out} already holds files; oomb never overwrites results. Choose another --out")
    if ppl_on:
        from oomb.train.corpus import DataError, find_sources
        from oomb.train.rows import check_sources

        try:
            check_sources(find_sources(args.perplexity), args.text_field)  # every file read once, before the model
        except DataError as e:
            raise EvalError(str(e)) from e

    device = resolve_device(args.device)
    loaded = load_eval_model(args.model, device, args.dtype, trust_remote_code=args.trust_remote_code)
    model = loaded.model
    model_config = base_config(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    run = loaded.run_config
    seed = args.seed if args.seed is not None else (run.train.seed if run is not None else 0)
    digits = args.digits if args.digits is not None else (run.data.passkey_digits if run is not None else 5)
    for n in lengths:
        check_positions(model_config, n, "retrieval length")
    if ppl_on:
        check_positions(model_config, args.ppl_length, "--ppl-length")
    task_name = args.task or (run.data.task if run is not None and run.data.task in RETRIEVAL_TASKS else "passkey")
    make_task = RETRIEVAL_TASKS[task_name]
    if retrieval_on:
        try:
            task_vocab = max(make_task(n, d, seed, digits).vocab_size for n in lengths for d in depths)
        except ValueError as e:
            raise EvalError(f"--task {task_name}: {e}") from e
        if task_vocab > vocab:
            raise EvalError(f"the {task_name} task needs {task_vocab} token ids but the model's vocabulary has "
                            f"{vocab}")
    tokenizer = None
    if ppl_on:
        from oomb.train.corpus import DataError, check_tokenizer_fits, load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer if args.tokenizer is not None else loaded.tokenizer_dir)
            check_tokenizer_fits(tokenizer, vocab)
        except DataError as e:
            raise EvalError(str(e)) from e

    n_params = sum(p.numel() for p in model.parameters())
    dtype = model.get_input_embeddings().weight.dtype
    console.print(f"[bold]oomb eval[/]: {args.model} ({loaded.source}, {n_params / 1e6:.2f}M params, {dtype}) on "
                  f"{device}; chunk {args.chunk_size}, page {args.page_size}; writing {out}", highlight=False)
    results: dict = {
        "command": "oomb " + shlex.join(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "oomb_version": oomb.__version__,
        "model": {"spec": args.model, "source": loaded.source, "class": type(model).__name__,
                  "parameters": n_params, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
                  "vocab_size": vocab,
                  "max_position_embeddings": getattr(model_config, "max_position_embeddings", None),
                  "rope_scaled": rope_is_scaled(model_config)},
        "settings": {"chunk_size": args.chunk_size, "page_size": args.page_size, "batch_size": args.batch_size,
                     "page_budget": args.page_budget, "select_block": args.select_block if args.page_budget else None,
                     "select_score": args.select_score if args.page_budget else None,
                     "offload": args.offload, "offload_gpu_bytes": engine.get("offload_gpu_bytes", 0)},
    }
    common = dict(batch_size=args.batch_size, chunk_size=args.chunk_size, page_size=args.page_size, engine=engine)
    # The model's last two path parts: a full path makes a title wider than the figure.
    title = f"{'/'.join(Path(args.model).parts[-2:]) or args.model} ({loaded.source})"
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        if ppl_on:
            bar = progress.add_task("perplexity", total=args.ppl_docs)
            t0 = time.perf_counter()
            documents = (tokenizer(text, verbose=False)["input_ids"] for text in
                         _documents(args.perplexity, args.text_field))
            ppl = perplexity_by_position(model, documents, length=args.ppl_length, edges=edges,
                                         max_documents=args.ppl_docs, on_document=lambda: progress.advance(bar),
                                         **common)
            ppl.update(paths=list(args.perplexity), text_field=args.text_field, bucket_spec=args.buckets,
                       tokenizer=type(tokenizer).__name__, seconds=time.perf_counter() - t0)
            results["perplexity"] = ppl
        if retrieval_on:
            bar = progress.add_task(f"retrieval ({task_name})", total=len(lengths) * len(depths))
            t0 = time.perf_counter()
            grid = retrieval_grid(model, make_task, lengths=lengths, depths=depths, samples=args.samples,
                                  seed=seed, digits=digits, on_cell=lambda: progress.advance(bar), **common)
            results["retrieval"] = {"task": task_name, **grid, "seconds": time.perf_counter() - t0}

    out.mkdir(parents=True, exist_ok=True)
    files = ["results.json"]
    if ppl_on:
        plot_perplexity(results["perplexity"], out / "perplexity.png", title)
        files.append("perplexity.png")
    if retrieval_on:
        plot_retrieval(results["retrieval"], out / "retrieval.png", f"{title}: {task_name} accuracy")
        files.append("retrieval.png")
    write_text_atomic(out / "results.json", json.dumps(finite_json(results), indent=2, allow_nan=False) + "\n")
    _print_tables(results, console)
    console.print(f"wrote {', '.join(files)} to {out}", highlight=False)
    return out


def _documents(paths: Sequence[str], text_field: str) -> Iterable[str]:
    from oomb.train.corpus import DataError
    from oomb.train.rows import iter_documents

    try:
        yield from iter_documents(paths, text_field)
    except DataError as e:
        raise EvalError(str(e)) from e


def _print_tables(results: dict, console: Console) -> None:
    if "perplexity" in results:
        p = results["perplexity"]
        table = Table(title=f"perplexity by position: {p['documents']} documents x {p['length']} tokens")
        for name in ("positions", "tokens", "mean NLL", "perplexity"):
            table.add_column(name, justify="right")
        for r in p["buckets"]:
            table.add_row(f"{r['start']}-{r['end'] - 1}", f"{r['tokens']:,}", f"{r['mean_nll']:.4f}",
                          f"{r['perplexity']:.4g}")
        table.add_row("all", f"{p['tokens']:,}", f"{p['mean_nll']:.4f}", f"{p['perplexity']:.4g}", style="bold")
        console.print(table)
    if "retrieval" in results:
        r = results["retrieval"]
        table = Table(title=f"{r['task']} retrieval accuracy ({r['samples']} samples per cell)")
        table.add_column("depth \\ length", justify="right")
        for n in r["lengths"]:
            table.add_column(short_length(n), justify="right")
        for depth, row in zip(r["depths"], r["accuracy"], strict=True):
            table.add_row(f"{depth:g}", *(f"{a:.2f}" for a in row))
        console.print(table)
