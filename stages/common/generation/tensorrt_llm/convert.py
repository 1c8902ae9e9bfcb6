"""CLI: an HF Llama checkpoint to a TensorRT-LLM one sharded for --tp x --pp ranks (CPU, no tensorrt_llm).

    python -m alignflow.stages.common.generation.tensorrt_llm.convert --checkpoint DIR --out DIR \\
        --tp 2 --pp 1 --dtype bfloat16

Prints one summary line (bytes per rank, seconds); exits 2 with the reason on a checkpoint or
mapping it cannot convert. What it writes is what `trtllm-build --checkpoint_dir OUT` reads.
"""

from __future__ import annotations

import argparse
import sys

from alignflow.stages.common.generation.interface import DTYPE_NAMES, UnsupportedArchitectureError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m alignflow.stages.common.generation.tensorrt_llm.convert",
                                     description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", required=True, help="HF checkpoint folder (config.json + safetensors)."
    )
    parser.add_argument("--out", required=True, help="Folder to write (created atomically).")
    parser.add_argument("--tp", type=int, default=1, help="Tensor-parallel size (default 1).")
    parser.add_argument("--pp", type=int, default=1, help="Pipeline-parallel size (default 1).")
    parser.add_argument(
        "--dtype", choices=DTYPE_NAMES, default="float32", help="Weight dtype (default float32)."
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace --out if it exists.")
    args = parser.parse_args(argv)

    from alignflow.stages.common.generation.tensorrt_llm.checkpoint import convert_checkpoint

    try:
        report = convert_checkpoint(
            args.checkpoint,
            args.out,
            tp_size=args.tp,
            pp_size=args.pp,
            dtype=args.dtype,
            overwrite=args.overwrite,
        )
    except (ValueError, UnsupportedArchitectureError, FileExistsError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
