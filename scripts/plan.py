"""Print the memory plan of a config: `python scripts/plan.py model=llama3_8b train=lora seq_len=524288`.

Plans for the GPU and host of this machine; elsewhere give the target's capacities, e.g.
`memory.gpu_memory_gib=79.2 memory.host_memory_gib=125`. Exits 1 when the plan does not fit, 2 when it
cannot be made (the message names the setting to give).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
import torch  # noqa: E402

from conf.schema import register_configs  # noqa: E402
from conf.schema.memory import check_memory  # noqa: E402
from trainer.build import plan_for  # noqa: E402

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg) -> None:
    device = torch.device("cpu" if cfg.device == "cpu" else "cuda")
    try:
        check_memory(cfg.memory)     # the plan is for a target machine: only its memory settings are checked
        plan = plan_for(cfg, device)
    except ValueError as error:   # bad settings, or no GPU to read capacities from
        print(f"cannot plan: {error}", file=sys.stderr)
        sys.exit(2)
    print(plan.describe() if plan.fits else plan.failure())
    if plan.placements is not None:
        full = " f=full: every activation kept" if "full" in plan.placements else ""
        print("layer inputs:     ", " ".join(p[0] for p in plan.placements), f"(g=gpu h=host r=recomputed{full})")
        print("attention outputs:", " ".join(p[0] for p in plan.attention), "(g=gpu h=host n=not kept)")
    sys.exit(0 if plan.fits else 1)


if __name__ == "__main__":
    main()
