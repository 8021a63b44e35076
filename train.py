"""Entry point: `torchrun --nproc-per-node N train.py --config train_configs/X.toml [--section.key value ...]`."""

import sys
import warnings

# torchdata's StatefulDataLoader calls a deprecated torch API on every construction
warnings.filterwarnings("ignore", message=".*set_vital.*")

from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.data.sources import DataError


def main(argv: list[str]) -> int:
    try:
        config = load_config(argv)
        from titan_ulysses.trainer import Trainer

        trainer = Trainer(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except DataError as e:  # bad rows, empty files, other data than the checkpoint's
        print(f"data error: {e}", file=sys.stderr)
        return 2
    trainer.train()
    return 0


if __name__ == "__main__":
    import torch.distributed as dist

    code = main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
