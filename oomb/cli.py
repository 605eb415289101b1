"""`oomb` command line: `oomb train [CONFIG.yaml] [key=value ...]`, `oomb plan ...`, `oomb data ...`, `oomb eval`.

The benchmarks are not part of the package: `python -m benchmarks.NAME` from the repo root (benchmarks/README.md)."""

from __future__ import annotations

import argparse
import logging
import sys

from rich.console import Console
from rich.markup import escape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oomb", description="Long-context training on one GPU.")
    parser.add_argument("--version", action="version", version=f"oomb {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser(
        "train",
        help="train a model (no arguments: a small built-in default on the passkey task)",
        description="Precedence: key=value overrides > CONFIG.yaml > defaults. Keys: see --list-keys.",
    )
    train_p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value",
                         help="an optional YAML config file first, then dotted overrides like train.steps=100")
    train_p.add_argument("--list-keys", action="store_true", help="print every config key with its default")
    train_p.add_argument("--list-presets", action="store_true", help="print the built-in model presets")
    plan_p = sub.add_parser("plan", help="the memory one training step of a config needs, and the longest "
                            "context that fits", description="Same config and key=value overrides as `oomb train`. "
                            "Exit status 1 when the run does not fit. See docs/memory.md.")
    plan_p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    plan_p.add_argument("--gpu-memory", help="plan for a GPU of this size (e.g. 141GiB) instead of this machine's")
    plan_p.add_argument("--host-memory", help="plan for this much host memory (e.g. 125GiB) instead of this machine's")
    plan_p.add_argument("--json", action="store_true", help="print the plan as JSON")
    data_p = sub.add_parser("data", help="the first packed sequence of a config's data, the tokens that carry loss "
                            "marked", description="Same config and key=value overrides as `oomb train`; reads and "
                            "packs the data as the run would, builds no model, writes nothing.")
    data_p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    data_p.add_argument("--tokens", action="store_true",
                        help="one line per token (position, id, token, carries loss, document) instead of the text")
    data_p.add_argument("--max-tokens", type=int, default=4096, help="show at most this many tokens (default 4096)")
    eval_p = sub.add_parser("eval", help="perplexity by position and retrieval accuracy of a model or checkpoint",
                            description="Evaluate a model: perplexity by position on held-out documents "
                            "(--perplexity) and retrieval accuracy over lengths x depths (--retrieval). "
                            "Writes results.json, perplexity.png and retrieval.png to --out. See docs/eval.md.")
    from oomb.train.eval.evaluate import add_arguments

    add_arguments(eval_p)

    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "plan" and all("=" in e and not e.startswith("-") for e in extra):
        args.args += extra  # key=value after an option: `oomb plan cfg.yaml --gpu-memory 141GiB train.x=1`
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    console = Console(stderr=False)
    # liger-kernel imports peft, which imports bitsandbytes, whose CPU backend logs on CPUs with AVX-512 BF16 that
    # an optional CPU 4-bit kernel package is missing, on every command: noise that reads as a broken install.
    # (oomb's 4-bit runs are on CUDA; a library user's logging is left as they set it.)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    if args.command == "train":
        return _train(args, console)
    if args.command == "plan":
        return _plan(args, console)
    if args.command == "data":
        return _data(args, console)
    return _eval(args, sys.argv[1:] if argv is None else argv, console)


def _version() -> str:
    from oomb import __version__

    return __version__


def _train(args, console: Console) -> int:
    from rich.text import Text

    from oomb.train.config.keys import describe_keys
    from oomb.train.config.presets import preset_names
    from oomb.train.config.settings import ConfigError
    from oomb.train.loop.faults import EXIT_CONFIG, RunStopped
    from oomb.train.loop.trainer import train
    from oomb.train.runfolder.rundir import load_run_config

    if args.list_keys:
        for key, default, doc in describe_keys():
            console.print(f"[bold]{key}[/] = {default}  [dim]{doc}[/]", highlight=False)
        return 0
    if args.list_presets:
        console.print("\n".join(preset_names()))
        return 0
    config_path = None
    overrides = list(args.args)
    if overrides and "=" not in overrides[0]:
        config_path = overrides.pop(0)
    printed: list[Exception] = []

    def report(e: Exception) -> None:  # before a torchrun job's ranks leave their group (trainer.train)
        if isinstance(e, RunStopped):  # a failure the trainer handled: the message says what is on disk and what to do
            console.print(Text.assemble(("stopped: ", "red"), str(e)), highlight=False, soft_wrap=True)
        else:
            console.print(f"[red]config error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        console.file.flush()
        printed.append(e)

    try:
        cfg = load_run_config(config_path, overrides)
        train(cfg, console, on_error=report)
    except (ConfigError, RunStopped) as e:
        if e not in printed:
            report(e)
        return e.exit_code if isinstance(e, RunStopped) else EXIT_CONFIG
    return 0


def _plan(args, console: Console) -> int:
    from oomb.train.config.settings import ConfigError
    from oomb.train.loop.memory import run_plan
    from oomb.train.runfolder.rundir import load_run_config

    overrides = list(args.args)
    config_path = overrides.pop(0) if overrides and "=" not in overrides[0] else None
    try:
        cfg = load_run_config(config_path, overrides)
        return run_plan(cfg, console, gpu_memory=args.gpu_memory, host_memory=args.host_memory, as_json=args.json)
    except ConfigError as e:
        console.print(f"[red]config error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2


def _data(args, console: Console) -> int:
    from oomb.train.config.settings import ConfigError
    from oomb.train.data.preview import show_first_sequence
    from oomb.train.runfolder.rundir import load_run_config

    overrides = list(args.args)
    config_path = overrides.pop(0) if overrides and "=" not in overrides[0] else None
    try:
        cfg = load_run_config(config_path, overrides)
        show_first_sequence(cfg, console, max_tokens=args.max_tokens, tokens=args.tokens)
    except ConfigError as e:
        console.print(f"[red]config error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    return 0


def _eval(args, argv: list[str], console: Console) -> int:
    from oomb.train.eval.evaluate import EvalError, run_eval

    try:
        run_eval(args, argv, console)
    except EvalError as e:
        console.print(f"[red]eval error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
