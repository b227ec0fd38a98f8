"""The embedded default job: the synthetic recall task is well-formed and the tiny model learns it."""
import math

import torch

from conf.schema import DataConfig
from conf.schema.data import RECALL_SPECIAL_TOKENS
from data import IGNORE_INDEX, RecallTask
from data.synthetic import QUERY
from tests.jobs_support import job_config, records, single_torch_thread  # noqa: F401
from trainer.loop import train

TASK = DataConfig(num_pairs=8, repeats=4, num_queries=5, num_keys=20, num_values=10)


def recall_batch(seed=0, seq_len=100, batch_size=3):
    return next(RecallTask(TASK, seq_len, batch_size, seed, vocab_size=64))


def test_every_target_is_the_value_filed_under_an_earlier_occurrence_of_its_key():
    batch = recall_batch()
    first_key = RECALL_SPECIAL_TOKENS
    first_value = first_key + TASK.num_keys
    for tokens, labels in zip(batch.input_ids.tolist(), batch.labels.tolist()):
        targets = [t for t, label in enumerate(labels) if label != IGNORE_INDEX]
        assert len(targets) == TASK.num_pairs * (TASK.repeats - 1) + TASK.num_queries
        for t in targets:
            key = tokens[t]
            assert first_key <= key < first_value
            earlier = [s for s in range(1, t) if tokens[s] == key and tokens[s - 1] != QUERY]
            assert earlier and all(tokens[s - 1] == labels[t] for s in earlier)
        assert tokens[-2 * TASK.num_queries::2] == [QUERY] * TASK.num_queries


def test_batches_depend_only_on_seed_and_index():
    stream = RecallTask(TASK, 100, 2, seed=3, vocab_size=64)
    first, second = next(stream), next(stream)
    resumed = RecallTask(TASK, 100, 2, seed=3, vocab_size=64)
    resumed.load_state_dict({"index": 1})
    assert torch.equal(next(resumed).input_ids, second.input_ids)
    assert not torch.equal(first.input_ids, second.input_ids)
    assert not torch.equal(recall_batch(seed=1).input_ids, recall_batch(seed=2).input_ids)


def test_tiny_model_learns_recall_well_above_chance(tmp_path):
    """A short version of `python train.py`: chance accuracy is 1/32, loss ln(32) = 3.47. The held-out
    sequences (another seed) are learned as the training ones are."""
    cfg = job_config(tmp_path, "seq_len=160", "batch_size=8", "data.num_pairs=8", "data.repeats=6",
                     "data.num_queries=8", "max_steps=150", "optim.warmup_steps=20", "optim.lr=1e-3",
                     "eval.every_steps=50", "eval.sequences=16")
    train(cfg)
    trained = [r for r in records(tmp_path) if "loss" in r]
    last = trained[-10:]
    accuracy = sum(r["accuracy"] for r in last) / len(last)
    loss = sum(r["loss"] for r in last) / len(last)
    assert accuracy > 0.5 and loss < math.log(32) / 2, (accuracy, loss)
    held_out = [r["eval/accuracy"] for r in records(tmp_path) if "eval/accuracy" in r]
    assert len(held_out) == 4 and held_out[0] < 0.1 and held_out[-1] > 0.5, held_out
