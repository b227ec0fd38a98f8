"""Entry point: `python train.py [group=option ...] [key=value ...]` (Hydra overrides)."""
import logging
import sys

from trainer.allocator import prefer_expandable_segments

prefer_expandable_segments()       # before torch (imported below) initializes CUDA

import hydra  # noqa: E402

from conf.schema import register_configs  # noqa: E402
from conf.validate import ConfigError  # noqa: E402
from data.tokenize import DataError  # noqa: E402
from model.hf_checkpoint import HFCheckpointError  # noqa: E402
from trainer.checkpoint.format import CheckpointError  # noqa: E402
from trainer.guard import BadStepsError  # noqa: E402
from trainer.loop import train  # noqa: E402

register_configs()
# Errors whose message already says what is wrong and what to change: shown without a traceback.
USER_ERRORS = (ConfigError, DataError, HFCheckpointError, CheckpointError, BadStepsError)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> None:
    try:
        train(cfg)
    except USER_ERRORS as error:
        logging.getLogger("train").error("%s", error)
        sys.exit(2)


if __name__ == "__main__":
    main()
