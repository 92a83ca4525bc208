"""CLI building block: `dspark-hf convert SRC DST [--to native|deepspec|zlab] [--target MODEL] [--dtype DTYPE]`."""

from __future__ import annotations

import argparse

from .convert import TARGET_LAYOUTS


def run_convert(args: argparse.Namespace) -> int:
    from .convert import convert
    from .formats import detect_format

    kwargs = {"dtype": args.dtype} if args.dtype else {}
    fmt = detect_format(args.src)
    path = convert(args.src, args.dst, to=args.to, target=args.target, **kwargs)
    print(f"{args.src} ({fmt}) -> {path} ({args.to})")
    return 0


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `convert` to an argparse subparsers object; the parsed args carry `func=run_convert`."""
    parser = subparsers.add_parser(
        "convert",
        help="convert a drafter checkpoint (native, DeepSpec Qwen3/Gemma4, z-lab DFlash, DeepSeek-V4 mtp.*)",
        description="Load a drafter in any known layout and write it as dspark_hf native, DeepSpec (vLLM/SGLang) or "
                    "z-lab DFlash.",
    )
    parser.add_argument("src", help="checkpoint folder or Hub id")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--to", choices=TARGET_LAYOUTS, default="native", help="output layout (default: native)")
    parser.add_argument("--target", default=None,
                        help="target model (folder or Hub id) supplying the embedding/LM head when the source has none")
    parser.add_argument("--dtype", default=None, help="load dtype, e.g. bfloat16 (default: the checkpoint's)")
    parser.set_defaults(func=run_convert)
    return parser
