"""The `ddtree` command line (also `python -m ddtree.cli ...`).

  ddtree generate --target DIR --draft DIR --prompt TEXT [--mode tree|chain|autoregressive]
                  [--budget 64|auto] [--max-new-tokens 128] [--temperature 0] [--top-k 0] [--top-p 1]
  ddtree bench --target DIR --draft DIR --prompts FILE [--budget 64|auto] [--plot out.png] [--json F]
  ddtree calibrate --target DIR --draft DIR [--batch 1 4 16] [--plot out.png] [--json F]
  ddtree train-drafter --target DIR --out DIR [--corpus PATH] [--labels greedy|data] [--steps N]
  ddtree replay [--prompts 16] [--records F] [--costs JSON | --profiles F] [--batch 1] ...
  torchrun --nproc-per-node N -m ddtree.cli generate ...   (tensor-parallel target, every rank
                                                            decodes, rank 0 prints)

Local directories in Hugging Face format; nothing is downloaded. `--target embedded` /
`--draft embedded` name the embedded pair shipped with the package (ddtree.embedded).
"""
from __future__ import annotations

import argparse
import sys

from ..parallel import distributed_running
from . import decode, replay, train_drafter
from .common import UsageError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    decode.add_parsers(sub)
    train_drafter.add_parser(sub)
    replay.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "generate" and args.mode != "autoregressive" and not args.draft:
        parser.error("--draft is required unless --mode autoregressive")
    try:
        return args.func(args)
    except (UsageError, ValueError, FileNotFoundError, FloatingPointError) as e:
        # Bad input (arguments, files, checkpoints, a diverging training run): the message names
        # it; no traceback. Anything else is a bug and keeps its traceback.
        print(f"ddtree {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if distributed_running():
            import torch.distributed

            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
