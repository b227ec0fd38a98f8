"""Entry point: `python train.py [group=option ...] [key=value ...]` (Hydra overrides)."""
import logging
import sys

import hydra

from conf.schema import register_configs
from conf.validate import ConfigError
from data.tokenize import DataError
from model.hf_checkpoint import HFCheckpointError
from trainer.checkpoint_format import CheckpointError
from trainer.guard import BadStepsError
from trainer.loop import train

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
