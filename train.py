"""Entry point: `python train.py [group=option ...] [key=value ...]` (Hydra overrides)."""
import hydra

from conf.schema import register_configs
from trainer.loop import train

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
