"""`meshlm convert` (Hugging Face weights in or out) and `meshlm export` (a checkpoint's parameters only)."""

from __future__ import annotations

from pathlib import Path

from meshlm.cli.flags import Parser
from meshlm.errors import UsageError


def _check_out(path: str, flag: str) -> None:
    """The folder to write, checked before any weights are read: new or empty, not a file or under one."""
    from meshlm.checkpoint.folders import check_out

    check_out(Path(path).expanduser(), flag)


def convert(argv: list[str]) -> int:
    from meshlm.checkpoint.convert import convert_from_hf, convert_to_hf

    parser = Parser(prog="meshlm convert", description="Hugging Face LLaMA weights in (--from_hf) or out (--to_hf).")
    parser.add_argument(
        "--from_hf", metavar="DIR", help="a LlamaForCausalLM folder (config.json + *.safetensors) to import"
    )
    parser.add_argument("--out", metavar="P", help="with --from_hf: the meshlm params folder to write")
    parser.add_argument("--to_hf", metavar="DIR", help="the Hugging Face folder to write (config.json + safetensors)")
    parser.add_argument(
        "--checkpoint", metavar="P", help="with --to_hf: a params folder, a run's output_dir or a checkpoint"
    )
    parser.add_argument("--step", type=int, help="with --to_hf: which training checkpoint step (default: newest)")
    parser.add_argument("--dtype", help="cast weights to float32, bfloat16 or float16 (default: keep)")
    args = parser.parse_args(argv)
    if bool(args.from_hf) == bool(args.to_hf):
        raise UsageError("give exactly one of --from_hf=DIR --out=P or --to_hf=DIR --checkpoint=P")
    if args.from_hf:
        if not args.out:
            raise UsageError("--from_hf needs --out=P, the folder to write")
        _check_out(args.out, "--out")
        from meshlm.checkpoint.origin import record_origin

        path = convert_from_hf(args.from_hf, args.out, args.dtype)
        record_origin(path, args.from_hf)  # so a LoRA export on this folder names the Hugging Face base
    else:
        if not args.checkpoint:
            raise UsageError("--to_hf needs --checkpoint=P, what to convert")
        _check_out(args.to_hf, "--to_hf")
        path = convert_to_hf(args.checkpoint, args.to_hf, args.dtype, step=args.step)
    print(f"wrote {path}")
    return 0


def export(argv: list[str]) -> int:
    from meshlm.checkpoint.convert import export_params

    parser = Parser(
        prog="meshlm export",
        description="Write a checkpoint's parameters only (for serving), in the compute "
        "dtype; a LoRA run's adapters as a PEFT folder (--lora_format=peft) or merged into the base (--merge).",
    )
    parser.add_argument(
        "--checkpoint", metavar="D", required=True, help="a run's output_dir, its checkpoints/ or checkpoints/N"
    )
    parser.add_argument("--out", metavar="P", required=True, help="the folder to write")
    parser.add_argument("--step", type=int, help="which checkpoint step (default: newest)")
    parser.add_argument(
        "--dtype",
        help="override the dtype (default: the model's compute dtype; float32 adapters with "
        "--lora_format; the base's dtype with --merge)",
    )
    parser.add_argument(
        "--lora_format",
        metavar="F",
        help="a LoRA run's adapters only: peft (a Hugging Face PEFT "
        "adapter folder, adapter_config.json + adapter_model.safetensors)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: the base weights with the adapters merged in (W + alpha/r·A·B), as a Hugging Face folder",
    )
    parser.add_argument(
        "--base",
        metavar="DIR",
        help="with --lora_format or --merge: the base model the adapters "
        "were trained on (default: the --init_from folder the checkpoint records)",
    )
    args = parser.parse_args(argv)
    if args.lora_format is not None and args.lora_format != "peft":
        raise UsageError(f"--lora_format={args.lora_format}: the one format is peft")
    if args.lora_format and args.merge:
        raise UsageError("--lora_format=peft writes the adapters, --merge the merged weights; pass one of them")
    if args.base is not None and not (args.lora_format or args.merge):
        raise UsageError("--base is for a LoRA export: add --lora_format=peft or --merge")
    _check_out(args.out, "--out")
    if args.lora_format or args.merge:
        from meshlm.checkpoint.lora_export import export_merged, export_peft

        write = export_peft if args.lora_format else export_merged
        print(f"wrote {write(args.checkpoint, args.out, args.step, args.base, args.dtype)}")
        return 0
    print(f"wrote {export_params(args.checkpoint, args.out, args.dtype, args.step)}")
    return 0
