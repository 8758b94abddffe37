"""`meshlm generate` and `meshlm serve`: load a model onto a mesh (meshlm.serve.loading, checked by
meshlm.job.resolve_serving), then stream text or serve HTTP (meshlm.serve).

Across several processes (the cluster flags of `meshlm train`, or a cluster's environment) every
process loads its shards of the weights and compiles the same engine; process 0 takes the prompt or
the HTTP requests, schedules every step and publishes it, the others run the steps it publishes
(meshlm/serve/engine/multihost.py). Each process runs under the supervisor and watchdog of
meshlm/distributed.py, as training does.

Warm-up (meshlm/serve/engine/warmup.py) shows a progress bar on process 0: `generate` compiles every shape
first; `serve` compiles the most needed ones, starts answering, and compiles the rest in the background.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

from meshlm import config
from meshlm.cli.flags import Parser, add_cluster_flags, add_dataclass_flags
from meshlm.errors import UsageError
from meshlm.serve.engine.limits import MAX_LOGPROBS, MAX_QUEUE, MAX_REQUEST_TOKENS

CLUSTER_HELP = (
    "as for `meshlm train` (docs/distributed.md): process 0 takes the work and schedules every step, "
    "the others run the same steps"
)


# --mesh_dim, --devices and --dtype are `meshlm train`'s (meshlm.config), with serving's default mesh and meaning.
SERVING_MESH = "1,1,-1,1"
SERVING_MEANING = {
    "mesh_dim": f"dp,fsdp,tp,sp as in `meshlm train` [default: {SERVING_MESH}, tensor parallel over all devices]",
    "devices": "simulate this many CPU devices",
    "dtype": "compute and weight dtype: auto (float32 on CPU, bfloat16 on accelerators), float32, bfloat16, "
    "float16 [default: auto]",
}


def add_model_flags(
    parser: argparse.ArgumentParser,
    max_batch: int | None,
    one_prompt: bool = False,
    meaning: dict[str, str] | None = None,
) -> None:
    """The flags `generate`, `serve` and `eval` share. `one_prompt` (generate): the cache and the prefill
    are sized to the one prompt unless the flags say otherwise, and the help says so. `meaning`: help
    texts by flag name where the command gives a flag another meaning."""
    meaning = {**SERVING_MEANING, **(meaning or {})}
    g = parser.add_argument_group("model and mesh")
    g.add_argument(
        "--checkpoint",
        required=True,
        metavar="P",
        help="a run's output_dir (or checkpoints/N), a `meshlm export`/`convert` folder, or a Hugging "
        "Face folder (config.json + *.safetensors; an hf: prefix is optional)",
    )
    g.add_argument("--step", type=int, help="which training checkpoint step (default: newest)")
    g.add_argument(
        "--base",
        metavar="DIR",
        help="a LoRA run's checkpoint is served as its base with the adapters merged in; the base model "
        "folder, when it is no longer where the run recorded it (docs/lora.md)",
    )
    g.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json to use instead of the one beside the weights")
    add_dataclass_flags(
        g, config.MeshConfig, only=("mesh_dim", "devices"), defaults={"mesh_dim": SERVING_MESH}, meaning=meaning
    )
    add_dataclass_flags(g, config.PrecisionConfig, only=("dtype",), meaning=meaning)
    g.add_argument(
        "--max_seq_len",
        type=int,
        help=meaning.get("max_seq_len")
        or (
            "context length of the KV cache (prompt + generated tokens) "
            + (
                "[default: the prompt's tokens plus --max_tokens]"
                if one_prompt
                else "[default: the model's, at most 2048]"
            )
        ),
    )
    g.add_argument(
        "--max_batch",
        type=int,
        default=max_batch,
        help=meaning.get("max_batch")
        or (
            "decode slots shared by concurrent requests, a multiple of dp×fsdp"
            + (f" [default: {max_batch}]" if max_batch else " [default: dp×fsdp]")
        ),
    )
    g.add_argument(
        "--prefill_buckets",
        metavar="N,N,...",
        help="prompt lengths that get a compiled prefill "
        + ("[default: the prompt's length]" if one_prompt else "[default: 32, 64, ... up to max_seq_len]"),
    )


def check_host(host: str) -> None:
    """--host names an address of this machine (or 0.0.0.0 / ::, every one of them): a bind to it on a
    free port succeeds. Otherwise one line, before anything loads (a busy --port is the server's own
    bind to report)."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
            0
        ]
    except socket.gaierror as e:
        raise UsageError(
            f"--host={host}: not a name or address this machine can resolve ({e.strerror}); "
            "use 127.0.0.1, 0.0.0.0 (every address) or one of this machine's addresses"
        ) from None
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise UsageError(
                    f"--host={host} is not an address of this machine; use 127.0.0.1, 0.0.0.0 "
                    "(every address) or one of this machine's own addresses"
                ) from None
            raise UsageError(f"--host={host}: cannot listen there ({e.strerror})") from None


def run_in_cluster(command: str, argv: list[str], args, work: Callable[[bool], int]) -> int:
    """`work(main)` here alone, or in each of the processes the flags or the cluster's environment name
    (`meshlm.distributed.run`)."""
    from meshlm import distributed

    cluster = distributed.resolve(args.coordinator_address, args.num_processes, args.process_id, args.peer_timeout)
    return distributed.run(command, argv, cluster, work, args.devices, connect_timeout=args.connect_timeout)


def load(args, console):
    """Devices, mesh and weights, reporting each step: (LoadedModel, meshlm.job.Job)."""
    import jax

    from meshlm.serve.loading import load_model

    n = jax.device_count()
    t0 = time.perf_counter()
    with console.status(f"loading {args.checkpoint} onto --mesh_dim={args.mesh_dim} ({n} {jax.devices()[0].platform})"):
        model, job = load_model(
            args.checkpoint,
            mesh_dim=args.mesh_dim,
            dtype=args.dtype,
            max_batch=args.max_batch,
            max_seq_len=args.max_seq_len,
            step=args.step,
            tokenizer=args.tokenizer,
            base=args.base,
        )
    if job.dcn is not None:
        console.print(
            f"{jax.process_count()} processes × {jax.local_device_count()} devices; across hosts "
            f"--dcn_mesh_dim={job.dcn} ({', '.join(f'{k}={v}' for k, v in job.dcn.as_dict().items() if v > 1)})"
        )
    cfg = model.cfg
    console.print(
        f"loaded {model.name} ({cfg.num_params() / 1e6:.1f}M params, {model.placement.policy.dtype}) in "
        f"{time.perf_counter() - t0:.1f} s on --mesh_dim={job.shape}"
    )
    return model, job.shape


def build_engine(model, shape, args, console, max_seq_len=None, buckets=None, first=None, warm_scorer=True, **limits):
    """The engine, compiled (in every process) but not started: process 0 starts it, the others follow
    it. `first`: compile only that many shapes, the most needed first (meshlm/serve/engine/warmup.py), and
    return the progress bar for the rest (None elsewhere than on the main process)."""
    from meshlm.serve.engine import multihost
    from meshlm.serve.engine.batching import Engine
    from meshlm.serve.engine.warmup import WarmupProgress

    if args.prefill_buckets:
        try:
            buckets = tuple(int(b) for b in args.prefill_buckets.split(","))
        except ValueError:
            raise UsageError(
                f"--prefill_buckets={args.prefill_buckets}: give comma-separated lengths like 64,256"
            ) from None
    engine = Engine(
        model,
        max_batch=args.max_batch or shape.data,
        max_seq_len=args.max_seq_len or max_seq_len,
        prefill_buckets=buckets,
        link=multihost.link(),
        warm_scorer=warm_scorer,
        **limits,
    )
    progress = None if console.quiet else WarmupProgress(console)
    try:
        seconds = engine.warmup(progress, count=first)
    except BaseException:
        if progress is not None:
            progress.close()
        raise
    done, total = engine.warmed()
    console.print(
        f"compiled {done} of {total} shapes in {seconds:.1f} s; context {engine.max_seq_len} tokens, "
        f"{engine.max_batch} slot(s), prompt buckets {', '.join(map(str, engine.buckets))}"
    )
    return engine, progress


def generate(argv: list[str]) -> int:
    from rich.console import Console

    from meshlm.serve.engine.request import GenerationRequest
    from meshlm.serve.engine.sampling import SamplingParams

    parser = Parser(prog="meshlm generate", description="Stream a completion of one prompt to the terminal.")
    add_model_flags(parser, max_batch=None, one_prompt=True)
    g = parser.add_argument_group("generation")
    g.add_argument("--prompt", required=True, help="the text to continue; - reads it from standard input")
    g.add_argument("--max_tokens", type=int, default=128, help="tokens to generate at most [default: 128]")
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy [default: 1.0]")
    g.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] [default: 1.0, off]")
    g.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest tokens [default: 0, off]")
    g.add_argument("--seed", type=int, help="makes sampling repeatable")
    g.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")
    add_cluster_flags(parser, CLUSTER_HELP)
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        raise UsageError(f"--max_tokens={args.max_tokens} must be a positive integer (tokens to generate at most)")
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:  # "temperature must be ..." is the flag --temperature's rule
        raise UsageError(f"--{e}") from None

    def work(main: bool) -> int:
        import jax

        from meshlm.serve.engine import multihost

        if jax.process_count() > 1:
            _stdout_for_text_only()
        prompt = (sys.stdin.read() if args.prompt == "-" else args.prompt) if main else None
        prompt = multihost.share("prompt", prompt, args.connect_timeout)  # stdin is process 0's
        err = Console(stderr=True, quiet=not main)
        model, shape = load(args, err)
        ids = model.tokenizer.encode(prompt)
        # Compile only what this prompt needs: one prefill length and a cache just long enough.
        step = 2 * shape.sp
        need = -(-(len(ids) + max(args.max_tokens, 0)) // step) * step
        bucket = min(-(-max(len(ids), 1) // step) * step, need)
        engine, _ = build_engine(
            model,
            shape,
            args,
            err,
            max_seq_len=min(need, model.cfg.max_seq_len),
            buckets=(min(bucket, model.cfg.max_seq_len),),
            warm_scorer=False,
        )
        request = GenerationRequest(ids, args.max_tokens, sampling, tuple(args.stop))
        try:
            engine.check(request)  # in every process, so that all of them stop on a bad request
        except ValueError as e:
            raise UsageError(f"{e} (--prompt/--max_tokens/--max_seq_len)") from None
        if not main:
            engine.follow()
            return 0
        _stream(engine.start(warmup=False), request, prompt, err)
        return 0

    return run_in_cluster("generate", argv, args, work)


def _stdout_for_text_only() -> None:
    """Across processes the collectives' C++ library prints connection notes on file descriptor 1,
    from several threads at once: drop what reaches the descriptor and keep `sys.stdout`, on a copy
    of it, for the text (the runtime's errors go to standard error)."""
    sys.stdout.flush()
    text = os.fdopen(os.dup(1), "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors, buffering=1)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 1)
    sys.stdout = text


def _stream(engine, request, prompt: str, err) -> None:
    """Process 0 of `meshlm generate`: the prompt, then the reply as it comes, then the rates."""
    try:
        handle = engine.submit(request)
        sys.stdout.write(prompt)
        for event in handle.iter_sync():
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        total = time.perf_counter() - handle.submitted
        ttft = (handle.first_token_at or time.perf_counter()) - handle.submitted
        rate = (handle.completion_tokens - 1) / max(total - ttft, 1e-9)
        err.print(
            f"[dim]{handle.completion_tokens} tokens ({handle.finish_reason}); first token after "
            f"{ttft * 1e3:.0f} ms, then {rate:.1f} tokens/s[/dim]"
        )
    finally:
        engine.stop()


def _serve_parser() -> Parser:
    """`meshlm serve`'s flags: the model's, the server's and the cluster's."""
    parser = Parser(prog="meshlm serve", description="An OpenAI-compatible HTTP API and a chat page.")
    add_model_flags(parser, max_batch=16)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes it [default: 127.0.0.1]")
    g.add_argument(
        "--port",
        type=int,
        default=8000,
        help="TCP port to listen on; taken before the model loads, so a busy one fails at once [default: 8000]",
    )
    g.add_argument(
        "--api_key",
        default=os.environ.get("MESHLM_API_KEY"),
        help="require `Authorization: Bearer KEY` (or set MESHLM_API_KEY) [default: none]",
    )
    g.add_argument("--model_name", help="the model id clients send and /v1/models lists [default: the folder name]")
    g.add_argument(
        "--header_timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="close a connection that has not sent a request's head (request line and headers) "
        "within S seconds of connecting or of its last reply [default: 10]",
    )
    g.add_argument(
        "--body_timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="close a connection that has not sent a request's body within S seconds of its head [default: 30]",
    )
    g.add_argument(
        "--max_queue",
        type=int,
        default=MAX_QUEUE,
        metavar="N",
        help=f"prompts that may wait for a slot at once; a request past that gets 429 [default: {MAX_QUEUE}]",
    )
    g.add_argument(
        "--max_request_tokens",
        type=int,
        default=MAX_REQUEST_TOKENS,
        metavar="N",
        help="tokens one request of several prompts may ask for in all (prompts × max_tokens) "
        f"[default: {MAX_REQUEST_TOKENS}]",
    )
    g.add_argument(
        "--max_logprobs",
        type=int,
        default=MAX_LOGPROBS,
        metavar="N",
        help=f"log-probabilities one request may return (tokens × (alternatives + 1)) [default: {MAX_LOGPROBS}]",
    )
    add_cluster_flags(parser, CLUSTER_HELP)
    return parser


def _checked_serve_limits(args) -> dict[str, int]:
    """The port and the timeouts checked; the engine's limits (--max_queue, --max_request_tokens,
    --max_logprobs) by flag name, each checked positive."""
    if not 0 < args.port < 65536:
        raise UsageError(f"--port={args.port} must be between 1 and 65535")
    for flag in ("header_timeout", "body_timeout"):
        if not 0 < getattr(args, flag) < float("inf"):
            raise UsageError(f"--{flag}={getattr(args, flag)} must be a positive number of seconds")
    limits = {flag: getattr(args, flag) for flag in ("max_queue", "max_request_tokens", "max_logprobs")}
    for flag, value in limits.items():
        if value < 1:
            raise UsageError(f"--{flag}={value} must be a positive integer")
    return limits


def serve(argv: list[str]) -> int:
    from rich.console import Console

    args = _serve_parser().parse_args(argv)
    limits = _checked_serve_limits(args)
    check_host(args.host)

    def work(main: bool) -> int:
        from meshlm.serve.api.server import bind
        from meshlm.serve.engine.warmup import FIRST

        console = Console(stderr=True, quiet=not main)
        sock = bind(args.host, args.port) if main else None  # before minutes of loading and compiling
        progress = None
        try:
            # The most needed shapes now, in every process; process 0 compiles the rest in the
            # background while serving (and publishes them to the others, which follow).
            engine, progress = build_engine(*load(args, console), args, console, first=FIRST, **limits)
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        if not main:
            engine.follow()  # until process 0's server stops
            return 0
        _serve_http(engine, progress, sock, args, console)
        return 0

    return run_in_cluster("serve", argv, args, work)


def _serve_http(engine, progress, sock, args, console) -> None:
    """Process 0 of `meshlm serve`: announce the address, start the engine and serve HTTP on `sock`
    until the server stops, then stop the engine (and the background compilation's progress bar)."""
    from meshlm.serve.api.server import serve as run_server

    if args.model_name:
        engine.model_name = args.model_name
    url = f"http://{args.host}:{args.port}"
    left = len(engine.uncompiled())
    console.print(
        f"serving {engine.model_name} on {url} (chat page at /, API at /v1)"
        + (f"; compiling the other {left} shapes in the background" if left else "")
    )
    if progress is not None:
        progress.on_done = lambda s: console.print(f"ready: every shape compiled ({s:.1f} s); serving on {url}")
    if not left:
        console.print(f"ready: serving on {url}")
    try:
        run_server(
            engine.start(background=True, progress=progress),
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            sock=sock,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
        )
    finally:
        engine.stop()
        if progress is not None:
            progress.close()
