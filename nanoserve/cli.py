"""The `nanoserve` command line.

    nanoserve generate --model demo --prompt "ROMEO:" --max-tokens 100
    nanoserve eval --model demo --text FILE [--context N --stride S]
    nanoserve bench throughput|latency|speculative [--model demo --num-requests N --out FILE.json]
    nanoserve quantize --model demo --method gptq --bits 4 --group-size 128 --calib FILE --out DIR
    nanoserve serve --model demo [--host 127.0.0.1 --port 8000 --api-key KEY --max-waiting N
                                  --lora-modules N=P]
    nanoserve bench serve --url http://127.0.0.1:8000/v1 --rates 1 4 16 [--out FILE.json]

Text streams to stdout (pipe it), statistics to stderr; bad input prints `nanoserve: error: ...`,
exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import MISSING, fields
from typing import get_args, get_type_hints

from .config import ENGINE_ARGS, SECTION_TYPES, EngineArg
from .errors import NanoserveError
from .serving.limits import ServerLimits
from .serving.tool_calls import TOOL_CALL_PARSERS, ToolCallConfig

MODEL_HELP = "shipped name (demo), checkpoint dir, llama2.c .bin or hub id"
LOAD_ARGS = ("dtype", "device")  # eval and quantize load a model and run no engine


def add_engine_args(p: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """--model, and one flag per engine argument (nanoserve/config/args.py's ENGINE_ARGS, the table
    LLM reads too): --max-num-seqs 8, --no-enable-prefix-caching, ... `names`: only these."""
    p.add_argument("--model", default="demo", help=MODEL_HELP)
    for name, arg in ENGINE_ARGS.items():
        if arg.cli and (names is None or name in names):
            p.add_argument("--" + name.replace("_", "-"), **flag_options(arg))


def flag_options(arg: EngineArg) -> dict:
    """argparse's options for one engine argument: its type and default from the config dataclass
    that holds it, its help and choices from the table."""
    default = engine_arg_default(arg)
    options = {"default": default, "help": arg.help}
    if arg.choices:
        options["choices"] = arg.choices
    kind = engine_arg_type(arg)
    if kind is bool and default:
        options["action"] = argparse.BooleanOptionalAction
    elif kind is bool:
        options["action"] = "store_true"
    else:
        options["type"] = kind
    if default is not None and kind is not bool:
        options["help"] += " (default %(default)s)"
    return options


def engine_arg_default(arg: EngineArg):
    """The default of the config field behind `arg` (None where the field has none)."""
    if arg.field == "enabled":
        return False
    default = {f.name: f.default for f in fields(SECTION_TYPES[arg.section])}[arg.field]
    return None if default is MISSING else default


def engine_arg_type(arg: EngineArg) -> type:
    """bool, int, float or str: what the command line parses the field's value as."""
    if arg.field == "enabled":
        return bool
    hint = get_type_hints(SECTION_TYPES[arg.section])[arg.field]
    for kind in (bool, int, float):
        if hint is kind or kind in get_args(hint):
            return kind
    return str


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments given on the command line (those at their default are left out)."""
    kwargs = {}
    for name, arg in ENGINE_ARGS.items():
        value = getattr(args, name, None)
        if arg.cli and value is not None and value != engine_arg_default(arg):
            kwargs[name] = value
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nanoserve",
                                 description="An educational LLM inference engine.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")

    e = sub.add_parser("eval", help="perplexity of a model on a text file (sliding window)")
    add_engine_args(e, LOAD_ARGS)
    e.add_argument("--text", required=True, help="a UTF-8 text file")
    e.add_argument("--context", type=int,
                   help="window length in tokens (default: the model's context)")
    e.add_argument("--stride", type=int, help="tokens scored per window (default: context // 2)")
    e.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens of the file")

    b = sub.add_parser("bench",
                       help="benchmark static / dynamic / continuous batching (and HF generate)")
    b.add_argument("workload", choices=["throughput", "latency", "speculative", "serve"],
                   help="speculative: the target alone vs speculative decoding, γ = 1..8, T = 0 "
                        "and 1; serve: Poisson load on a running server (--url)")
    b.add_argument("--model", default="demo", help=MODEL_HELP)
    b.add_argument("--speculative-model", help="speculative: the draft model (default demo-draft)")
    b.add_argument("--num-requests", type=int)
    b.add_argument("--batch-size", type=int, default=16, help="static/dynamic batch size")
    b.add_argument("--max-wait-ms", type=float, default=20.0, help="dynamic batching's wait")
    b.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 32.0],
                   help="latency: requests/s")
    b.add_argument("--no-hf", action="store_true",
                   help="throughput: skip the HF transformers baseline")
    b.add_argument("--out", help="save the results as JSON here")
    b.add_argument("--url", default="http://127.0.0.1:8000/v1", help="serve: the server's /v1 root")
    b.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY") or None,
                   help="serve: the server's key")
    b.add_argument("--input-len", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"),
                   help="serve: prompt tokens, uniform in [MIN, MAX]")
    b.add_argument("--output-len", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"),
                   help="serve: tokens to generate, uniform in [MIN, MAX]")
    b.add_argument("--slo-ttft-ms", type=float, help="serve: goodput's time-to-first-token SLO")
    b.add_argument("--slo-tpot-ms", type=float, help="serve: goodput's time-per-output-token SLO")

    q = sub.add_parser("quantize",
                       help="quantize a model's linears (RTN, GPTQ, AWQ; W8A8 int8, SmoothQuant, "
                            "FP8), save in the GPTQ or compressed-tensors format")
    add_engine_args(q, LOAD_ARGS)
    q.add_argument("--method", choices=["rtn", "gptq", "awq", "int8", "smoothquant", "fp8"],
                   default="gptq",
                   help="int8: W8A8 (per-channel weights, per-token activations); smoothquant: "
                        "the same after SmoothQuant's smoothing (needs --calib); fp8: W8A8-FP8. "
                        "These three write compressed-tensors")
    q.add_argument("--format", choices=["gptq", "compressed-tensors"],
                   help="checkpoint format of the 4-bit methods (default gptq)")
    q.add_argument("--alpha", type=float, default=0.5,
                   help="SmoothQuant's migration strength α in [0, 1]")
    q.add_argument("--bits", type=int, default=4, help="2..8 (the GPTQ format stores 2, 3, 4 or 8)")
    q.add_argument("--group-size", type=int, default=128,
                   help="weights per (scale, zero); -1 = one group per row")
    q.add_argument("--asym", action="store_true",
                   help="asymmetric grid (zero points per group; default symmetric); a GPTQ "
                        "checkpoint is then written as GPTQ v2")
    q.add_argument("--act-order", action="store_true",
                   help="GPTQ: quantize columns by decreasing activation energy")
    q.add_argument("--lm-head", action="store_true",
                   help="quantize the LM head too (a tied one gets its own copy: the checkpoint "
                        "is written untied, the embedding stays float)")
    q.add_argument("--calib", help="calibration text file (GPTQ and AWQ need one)")
    q.add_argument("--nsamples", type=int, default=32, help="calibration windows")
    q.add_argument("--seqlen", type=int, help="tokens per window (default: min(context, 512))")
    q.add_argument("--seed", type=int, default=0, help="which windows of the calibration text")
    q.add_argument("--out", required=True,
                   help="output directory (config.json + model.safetensors)")

    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    add_engine_args(v)
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /ping "
                        "and /metrics (default: $NANOSERVE_API_KEY, else none)")
    v.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model name clients send; several: each serves the model, the first "
                        "answers requests that name none (default: --model)")
    v.add_argument("--chat-template",
                   help="a Jinja chat template file (default: the model's own, if any)")
    v.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="PEFT LoRA adapters served beside it")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let tool_choice auto (the default when a request has tools) read calls "
                        "out of the model's text; needs --tool-call-parser")
    v.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                   help="the format the model writes calls in (hermes: <tool_call> JSON blocks)")
    v.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body accepted (default 4 MiB); larger ones get 413")
    v.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    limits = ServerLimits()
    v.add_argument("--max-prompts-per-request", type=int, default=limits.max_prompts_per_request,
                   help="prompts in one completions batch (default %(default)s)")
    v.add_argument("--max-prompt-tokens-per-request", type=int,
                   default=limits.max_prompt_tokens_per_request,
                   help="prompt tokens in one request, and in /tokenize (default %(default)s)")
    v.add_argument("--max-chat-messages", type=int, default=limits.max_chat_messages,
                   help="messages in one chat (default %(default)s)")
    v.add_argument("--shutdown-grace", type=float, default=limits.shutdown_grace_s,
                   help="seconds responses in flight get after SIGTERM (default %(default)s)")
    return ap


def cmd_generate(args) -> None:
    from .engine.llm import LLM
    from .engine.sampler import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
                            seed=args.seed, stop=args.stop)
    llm = LLM(args.model, **engine_kwargs(args))
    n_prompt = len(llm.encode_prompt(args.prompt))
    start, n_out = time.perf_counter(), 0
    for out in llm.stream_request(args.prompt, params):
        print(out[0], end="", flush=True)
        n_out = len(out[1].token_ids)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    spec = out[1].outputs[0].spec_stats if n_out else None
    spec_note = (f" speculative: acceptance={spec.acceptance_rate:.2f} "
                 f"tokens/step={spec.tokens_per_step:.2f}"
                 if spec is not None and spec.num_steps else "")
    print(f"[nanoserve] model={args.model} device={llm.device} "
          f"dtype={str(llm.dtype).removeprefix('torch.')} prompt_tokens={n_prompt} "
          f"generated_tokens={n_out} time={elapsed:.2f}s "
          f"tokens/s={n_out / elapsed:.1f}{spec_note}", file=sys.stderr)


def cmd_eval(args) -> None:
    from .models.loader import load_model
    from .tools.evaluate import perplexity, read_text

    text = read_text(args.text)  # check the file before loading the model
    model, cfg, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    res = perplexity(model, tok, text, context=args.context, stride=args.stride,
                     max_tokens=args.max_tokens)
    print(res.table())


def cmd_bench(args) -> None:
    from .tools import bench

    if args.workload == "serve":
        from .tools.bench_serve import bench_serve, format_bench_serve

        print(format_bench_serve(bench_serve(
            url=args.url, rates=tuple(args.rates), n=args.num_requests or 32,
            in_range=tuple(args.input_len),
            out_range=tuple(args.output_len), slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            api_key=args.api_key, out=args.out)))
        return
    if args.workload == "speculative":
        print(bench.format_speculative(bench.speculative(
            model=args.model, draft=args.speculative_model or "demo-draft", out=args.out,
            **({"n": args.num_requests} if args.num_requests else {}))))
        return
    common = dict(model=args.model, batch_size=args.batch_size, max_wait_ms=args.max_wait_ms,
                  out=args.out)
    if args.num_requests:
        common["n"] = args.num_requests
    if args.workload == "throughput":
        print(bench.format_throughput(bench.throughput(hf=not args.no_hf, **common)))
    else:
        print(bench.format_latency(bench.latency(rates=tuple(args.rates), **common)))


def cmd_quantize(args) -> None:
    from .models.loader import load_model
    from .quant.model import QuantizeConfig, calibration_ids, quantize_model
    from .quant.online import quantize_on_load
    from .quant.save import (
        check_compressed_target,
        replace_linears,
        save_compressed,
        save_quantized,
    )
    from .quant.smoothquant import smooth_model
    from .tools.evaluate import read_text

    w8 = args.method in ("int8", "smoothquant", "fp8")
    _check_quantize_args(args, w8)
    text = read_text(args.calib) if args.calib else None
    model, cfg, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    if w8 or args.format == "compressed-tensors":
        check_compressed_target(cfg)  # before the (long) quantization, not after
    seqlen = args.seqlen or min(cfg.max_position_embeddings, 512)
    calib = calibration_ids(tok, text, args.nsamples, seqlen,
                            args.seed) if text is not None else None
    start = time.perf_counter()
    if w8:
        if args.method == "smoothquant":
            smooth_model(model, calib, args.alpha)
        names = quantize_on_load(model, "fp8" if args.method == "fp8" else "int8")
        out = save_compressed(model, args.out, tokenizer_from=args.model)
        print(f"[nanoserve] {args.method}: {len(names)} linears in "
              f"{time.perf_counter() - start:.1f}s; saved to {out}",
              file=sys.stderr)
        return
    config = QuantizeConfig(method=args.method, bits=args.bits, group_size=args.group_size,
                            sym=not args.asym,
                            act_order=args.act_order, lm_head=args.lm_head)
    result = quantize_model(model, calib, config)
    if args.format == "compressed-tensors":
        out = save_compressed(replace_linears(model, result.qweights), args.out,
                              tokenizer_from=args.model)
    else:  # an asymmetric grid as GPTQ v2: the form gptqmodel reads from another tool
        out = save_quantized(model, result, args.out, tokenizer_from=args.model,
                             checkpoint_format="gptq_v2" if args.asym else "gptq")
    print(f"[nanoserve] {args.method} {args.bits}-bit g{args.group_size}: {len(result.qweights)} "
          f"linears in {time.perf_counter() - start:.1f}s; block output errors "
          f"{', '.join(f'{e:.2e}' for e in result.block_errors) or '(no calibration)'}; saved to "
          f"{out}",
          file=sys.stderr)


def _check_quantize_args(args, w8: bool) -> None:
    """Every flag of `quantize` either applies to the method or is refused by name, before any model
    loads."""
    if w8:
        unused = [flag for flag, used in (("--bits", args.bits != 4),
                                          ("--group-size", args.group_size != 128),
                                          ("--asym", args.asym),
                                          ("--act-order", args.act_order),
                                          ("--lm-head", args.lm_head)) if used]
        if unused or args.format == "gptq":
            raise NanoserveError(f"--method {args.method} is 8-bit, per channel, saved as "
                                 f"compressed-tensors: {', '.join(unused) or '--format gptq'} does "
                                 "not apply to it")
    elif args.format == "compressed-tensors" and (args.bits != 4 or args.act_order):
        raise NanoserveError("--format compressed-tensors writes 4-bit groups in order: not --bits "
                             f"{args.bits}{' with --act-order' if args.act_order else ''}")
    if (args.alpha != 0.5 and args.method != "smoothquant") or not 0 <= args.alpha <= 1:
        raise NanoserveError(f"--alpha {args.alpha}: SmoothQuant's α, in [0, 1], for --method "
                             "smoothquant only")
    if args.method not in ("rtn", "int8", "fp8") and not args.calib:
        raise NanoserveError(f"--method {args.method} needs --calib FILE (text to calibrate on)")


def cmd_serve(args) -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise NanoserveError(f"nanoserve serve needs the serve extra ({e.name} is missing): "
                             "pip install 'nanoserve[serve]'") from e
    from .serving.server import serve

    if not 0 < args.port < 65536:
        raise NanoserveError(f"--port {args.port} is not a TCP port (1..65535)")
    if args.max_body_bytes < 1:
        raise NanoserveError(f"--max-body-bytes {args.max_body_bytes} must be ≥ 1")
    serve(args.model, host=args.host, port=args.port, api_key=args.api_key,
          served_model_name=args.served_model_name, chat_template=args.chat_template,
          log_level=args.log_level, max_body_bytes=args.max_body_bytes,
          lora_modules=args.lora_modules,
          tool_config=ToolCallConfig(args.enable_auto_tool_choice, args.tool_call_parser),
          limits=ServerLimits(args.max_prompts_per_request, args.max_prompt_tokens_per_request,
                              args.max_chat_messages, args.shutdown_grace),
          **engine_kwargs(args))

def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"generate": cmd_generate, "eval": cmd_eval, "bench": cmd_bench, "quantize": cmd_quantize,
         "serve": cmd_serve}[args.command](args)
    except NanoserveError as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
