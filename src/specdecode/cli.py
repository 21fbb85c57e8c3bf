"""Command line: ``specdecode generate | serve | bench | bench-serve | models | calibrate-layerskip | fit-controller | train-head``.

Parsing, loading and printing only; the loop lives in ``engine.py``. The parsed flags become typed configs
in one place per command (``flags.py``, ``serve/flags.py``, ``bench/command.py``, ``bench/serve_command.py``);
what runs takes those, never the flags. Every user error ends with one line ``specdecode: error: ...`` on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from specdecode.cores import bound_openmp_spin, oversubscription_warning

bound_openmp_spin()  # before torch loads libgomp, which reads its spin count once
import torch  # noqa: E402

from specdecode.argtypes import positive_int
from specdecode.bench.child_server import ServerFailed
from specdecode.bench.command import add_arguments as add_bench_arguments
from specdecode.bench.serve_command import add_arguments as add_bench_serve_arguments
from specdecode.control.model_file import load_controller_file
from specdecode.drafter_setup import DrafterConfig, drafter_factory
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.flags import (add_drafter_arguments, add_gamma_arguments, add_kv_arguments, add_model_arguments,
                              cache_configs, drafter_config, target_config)
from specdecode.grammar import Grammar, GrammarError
from specdecode.heads.command import add_arguments as add_head_arguments
from specdecode.kv.cache import CacheConfig, CacheFullError
from specdecode.kv.memory import KVBudgetError
from specdecode.models.build import LoadedModel, resolve_device
from specdecode.models.fetch import FetchError
from specdecode.models.loader import LoadError
from specdecode.models.registry import DEFAULT_MODEL, UnknownModelError
from specdecode.sampling import SamplingParams
from specdecode.serve.flags import add_arguments as add_serve_arguments
from specdecode.skip_sets import CALIBRATION_PROMPTS, calibrate_and_store
from specdecode.target import TargetConfig


class UsageError(Exception):
    """Bad input from the user; printed as one line, exit status 2."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_generate_arguments(sub.add_parser("generate", help="generate text from a prompt"))
    add_bench_arguments(sub.add_parser("bench", help="benchmark every method and its peers side by side on prompt suites"))

    _add_model_tool_commands(sub)
    add_bench_serve_arguments(sub.add_parser(
        "bench-serve", help="load-test the server: plain vs speculative decoding at several concurrencies"))
    add_serve_arguments(sub.add_parser(
        "serve", help="serve an OpenAI-compatible API with continuous batching and speculation"))

    t = sub.add_parser("train-head", help="train an EAGLE or Medusa draft head on the target's own answers")
    add_model_arguments(t, device=False)  # trains on the CPU; heads/ sits below flags.py, so the flags are added here
    add_head_arguments(t)
    return parser


def _add_generate_arguments(g: argparse.ArgumentParser) -> None:
    add_model_arguments(g)
    g.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    add_drafter_arguments(g)
    add_gamma_arguments(g)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="same seed, same output")
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--prediction", default=None, metavar="FILE|-",
                   help="text the answer is expected to be mostly made of (e.g. the file an edit starts from), "
                        "drafted wherever the answer follows it; '-' reads it from stdin")
    structured = g.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", default=None, metavar="FILE",
                            help="the answer is JSON valid under this JSON schema (every token drawn from the "
                                 "model's distribution masked by it; the tokens it forces are drafted)")
    structured.add_argument("--regex", default=None, metavar="RE", help="the answer matches this regex whole")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_kv_arguments(g)


def _add_model_tool_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`models`, `peers`, `calibrate-layerskip` and `fit-controller`: the commands that prepare, not run."""
    m = sub.add_parser("models", help="list the named models and whether each is cached")
    m.add_argument("--json", action="store_true")

    peers = sub.add_parser("peers", help="build llama.cpp's own tools (llama-server, llama-bench, ...) as peers")
    peers.add_argument("action", choices=("build", "list"),
                       help="build: download llama-cpp-python's source and build the tools (about 15 min on 2 cores); "
                            "list: where they are")
    peers.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")

    c = sub.add_parser("calibrate-layerskip", help="search the layers to skip for self-speculation")
    add_model_arguments(c)
    c.add_argument("--gamma", type=positive_int, default=4, help="draft length the prediction assumes")
    c.add_argument("--new-tokens", type=positive_int, default=48, help="reference tokens per calibration prompt")
    c.add_argument("--json", action="store_true")

    f = sub.add_parser("fit-controller", help="fit the confidence controller's acceptance models from step records")
    f.add_argument("records", nargs="+", metavar="RECORDS.jsonl", help="files from `specdecode bench --record-steps`")
    f.add_argument("--out", required=True, metavar="FILE", help="the controller file to write (JSON)")
    f.add_argument("--alias", action="append", default=[], metavar="DRAFTER=FROM",
                   help="give DRAFTER the model fitted for FROM (same signals), e.g. draft=layerskip (repeatable)")
    f.add_argument("--l2", type=float, default=1.0, help="L2 penalty on the standardised weights (default 1)")
    f.add_argument("--merge", default=None, metavar="FILE",
                   help="keep this controller file's models for the drafters the records do not cover")


def _read_stdin(what: str) -> str:
    if sys.stdin is None:  # the process was started with file descriptor 0 closed
        raise UsageError(f"cannot read the {what} from stdin: stdin is closed")
    try:
        return sys.stdin.read()
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"cannot read the {what} from stdin: {exc}") from None


def _checked_text(text: str, what: str, source: str) -> str:
    try:
        # Undecodable bytes arrive as lone surrogates (surrogateescape) that the tokenizer rejects.
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"the {what} ({source}) is not valid UTF-8 text: {exc.reason} at character "
                         f"{exc.start}") from None
    return text


def _read_prompt(prompt: str) -> str:
    if prompt == "-":
        return _checked_text(_read_stdin("prompt"), "prompt", "stdin")
    return _checked_text(prompt, "prompt", "argument")


def _read_prediction(source: str | None) -> str | None:
    """``--prediction``: a file's text, or stdin's ('-')."""
    if source is None:
        return None
    if source == "-":
        return _checked_text(_read_stdin("prediction"), "prediction", "stdin")
    try:
        return _checked_text(Path(source).read_text(encoding="utf-8"), "prediction", source)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prediction {source}: cannot read it ({exc})") from None


def _engine_for(drafter: DrafterConfig, target_config: TargetConfig, target: LoadedModel, spec: SpeculativeConfig,
                caches: tuple[CacheConfig, CacheConfig]) -> Engine:
    new = drafter_factory(drafter, target_config, target, caches[1], _log)
    return Engine(target.model, target.tokenizer, new() if new is not None else None, spec, cache=caches[0])


def _grammar_flag(args: argparse.Namespace) -> str:
    return "--regex" if args.regex is not None else "--json-schema"


def _read_grammar(args: argparse.Namespace) -> Grammar | None:
    """``--json-schema FILE`` or ``--regex RE`` as a grammar; a file that cannot be read or a schema that is not
    JSON is refused before any model loads, one that does not compile once the engine compiles it."""
    if args.regex is None and args.json_schema is None:
        return None
    try:
        if args.regex is not None:
            return Grammar.regex(args.regex)
        try:
            text = Path(args.json_schema).read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--json-schema {args.json_schema}: cannot read it ({exc})") from None
        return Grammar.json_schema(text)
    except GrammarError as exc:
        raise UsageError(f"{_grammar_flag(args)}: {exc}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    if args.prompt == "-" and args.prediction == "-":
        raise UsageError("the prompt and --prediction cannot both be read from stdin ('-'); give one as a file")
    prompt = _read_prompt(args.prompt)
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    prediction = _read_prediction(args.prediction)
    grammar = _read_grammar(args)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    # Validated before any model is loaded.
    spec = SpeculativeConfig(args.gamma, args.gamma_max, args.controller_file, args.long_max)
    if args.gamma in ("confidence", "adaptive"):
        load_controller_file(args.controller_file)
    drafter = drafter_config(args)
    caches = cache_configs(args, draft=drafter.has_draft_cache)
    target_settings = target_config(args)
    target = target_settings.load(progress=_log)
    if args.chat:
        if not target.tokenizer.chat_template:
            raise UsageError(f"model {args.model} has no chat template; drop --chat")
        prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine = _engine_for(drafter, target_settings, target, spec, caches)
    engine.warmup()
    try:
        stream = engine.stream(prompt, sampling, args.max_new_tokens, args.stop, prediction=prediction, grammar=grammar)
    except GrammarError as exc:
        raise UsageError(f"{_grammar_flag(args)}: {exc}") from None
    if args.json:
        for _ in stream:  # runs the request to its end
            pass
        result = stream.result
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "stats": result.stats.to_dict()}))
        return 0
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = stream.result.stats
    predicted = f"{s.predicted_speedup:.2f}x" if s.predicted_speedup is not None else "n/a"
    _log(f"[{s.tokens_generated} tokens, {s.tokens_per_s:.1f} tok/s, {s.target_forwards} target forwards, "
         f"tau {s.mean_accepted_length:.2f}, acceptance {s.acceptance_rate:.2f}, predicted speedup {predicted}, "
         f"KV {s.kv_bytes_per_token:.0f} B/token, "
         + (f"prediction {s.prediction_accepted}/{s.prediction_drafted} tokens kept, " if prediction else "")
         + (f"forced {s.forced_accepted}/{s.forced_drafted} tokens kept, " if grammar and s.forced_drafted else "")
         + f"finish {stream.result.finish_reason}]")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from specdecode.models.fetch import cached_path
    from specdecode.models.registry import list_models

    rows = [{"name": m.name, "default": m.name == DEFAULT_MODEL, "cached": cached_path(m) is not None,
             "path": str(cached_path(m) or ""), "description": m.description} for m in list_models()]
    if args.json:
        print(json.dumps(rows))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = "cached " if r["cached"] else "not cached"
        print(f"{r['name']:<{width}}  {mark:<10}  {r['description']}{'  (default)' if r['default'] else ''}")
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    from specdecode.bench import llamacpp_tools

    if args.action == "build":
        try:
            llamacpp_tools.build(_log, jobs=args.jobs)
        except RuntimeError as exc:  # a missing tool or a failed step: the message says which
            raise UsageError(str(exc)) from None
        return 0
    for tool in llamacpp_tools.TOOLS:
        path = llamacpp_tools.find(tool)
        print(f"{tool:26} {path if path else f'not built (`{llamacpp_tools.BUILD_COMMAND}`)'}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    target = target_config(args).load(progress=_log)
    result = calibrate_and_store(target, args.dtype, gamma=args.gamma, new_tokens=args.new_tokens, progress=_log)
    if args.json:
        print(json.dumps({"model": target.source, "skip": list(result.skip), "agreement": result.agreement,
                          "predicted_speedup": result.predicted_speedup, "gamma": result.gamma,
                          "prompts": len(CALIBRATION_PROMPTS)}))
    else:
        print(f"skip layers {','.join(map(str, result.skip))}: agreement {result.agreement:.3f}, "
              f"predicted speedup {result.predicted_speedup:.2f}x at gamma {result.gamma}")
    return 0


def cmd_fit_controller(args: argparse.Namespace) -> int:
    from specdecode.control.fit import fit_controller
    from specdecode.control.model_file import save_controller_file
    from specdecode.control.records import read_records

    aliases = {}
    for item in args.alias:
        name, sep, source = item.partition("=")
        if not sep or not name or not source:
            raise UsageError(f"--alias {item!r}: expected DRAFTER=FROM, e.g. draft=layerskip")
        aliases[name] = source
    entries = fit_controller(read_records(args.records), aliases, args.l2)
    if args.merge:  # read before anything is written: --merge and --out may name the same file
        kept = {k: v for k, v in load_controller_file(args.merge).entries.items() if k not in entries}
        entries = {**kept, **entries}
        _log(f"kept {', '.join(sorted(kept)) or 'nothing'} from {args.merge}")
    save_controller_file(entries, args.out)
    for name, m in sorted(entries.items()):
        v = m.validation
        held = (f"held-out log loss {v['log_loss']}, accuracy {v['accuracy']} (base rate {v['base_rate']}, "
                f"{v['samples']} tokens)" if v else "no held-out split (too few records)")
        source = "" if m.fitted_on_drafter == name else f" (the {m.fitted_on_drafter} fit)"
        _log(f"{name}{source}: {m.samples} tokens from {', '.join(m.models)}; {held}")
    _log(f"wrote {args.out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from specdecode.bench.command import bench_command, run_command

    return run_command(bench_command(args))


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from specdecode.bench.serve_command import bench_serve_config, run_command

    return run_command(bench_serve_config(args), _log)


def cmd_serve(args: argparse.Namespace) -> int:
    from specdecode.serve.command import run_command
    from specdecode.serve.flags import serve_config

    return run_command(serve_config(args), _log)


def cmd_train_head(args: argparse.Namespace) -> int:
    from specdecode.heads.command import run_command

    return run_command(args, _log)


# What bad input, a missing file, an impossible setting or a server child that fails (bench-serve's, a peer's)
# raise: one line and exit status 2. Anything else is a bug and keeps its traceback.
USER_ERRORS = (UsageError, ValueError, OSError, LoadError, FetchError, UnknownModelError, KVBudgetError,
               CacheFullError, ServerFailed)

COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "models": cmd_models, "calibrate-layerskip": cmd_calibrate,
            "fit-controller": cmd_fit_controller, "train-head": cmd_train_head, "serve": cmd_serve,
            "bench-serve": cmd_bench_serve, "peers": cmd_peers}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
        warning = None if getattr(args, "ray", False) else oversubscription_warning(args.threads)  # (Ray: elsewhere)
        if warning is not None:
            _log(warning)
    try:
        if getattr(args, "device", None):
            args.device = resolve_device(args.device)  # no GPU for --device cuda: refused before anything loads
        return COMMANDS[args.command](args)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as other command-line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        _log("specdecode: interrupted")
        return 130
    except USER_ERRORS as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        _log(f"specdecode: error: {message}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
