"""Entry point: `torchrun --nproc-per-node N train.py --config train_configs/X.toml [--section.key value ...]`.

`python train.py --help` lists every setting with its default and docstring.
"""

import os
import sys
import warnings

# torchdata's StatefulDataLoader calls a deprecated torch API on every construction
warnings.filterwarnings("ignore", message=".*set_vital.*")

from titan_ulysses.config.manager import ConfigError, load_config


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        from titan_ulysses.config.help import format_help

        print(format_help())
        return 0
    try:
        config = load_config(argv)
        from titan_ulysses.trainer import Trainer

        trainer = Trainer(config)
    except ConfigError as e:
        # every rank finds the same error before any process group work: say it once per node
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"config error: {e}", file=sys.stderr)
        return 2
    trainer.train()
    return 0


if __name__ == "__main__":
    import torch.distributed as dist

    code = main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
