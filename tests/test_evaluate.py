"""Evaluation (issue 39): held-out loss by position, the passkey probe, the held-out split, and that evaluating
changes nothing of training, of a resume's metrics or of what several processes compute together."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from conf.errors import ConfigError
from conf.schema import DataConfig
from conf.schema.eval import EvalConfig, evaluating, starts_with_eval
from conf.validate import validate
from data import IGNORE_INDEX
from data.held_out import held_out_data, split_documents
from data.passkey import FILLER, INSTRUCTION, NEEDLE, QUESTION, HaystackParts, passkey_grid
from kernels.attention import choose_route
from model import CausalLM, DecoderConfig
from tests.data_support import checkpoint, text_file  # noqa: F401
from tests.gloo_support import gloo_rank, run_two_ranks
from tests.jobs_support import REPO, job_config, records, single_torch_thread  # noqa: F401
from trainer.build import install_attention_route
from trainer.distributed import World, world_of
from trainer.evaluate import Evaluator, answer_misses, position_edges
from trainer.loop import train

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0)
RECALL = DataConfig(num_pairs=4, repeats=4, num_queries=4, num_keys=20, num_values=10)


def passkey_tokenizer(directory: Path):
    """A word-level tokenizer of the probe's words, digits one token each."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                  pre_tokenizers.Digits(individual_digits=True)])
    texts = [INSTRUCTION, FILLER, NEEDLE, QUESTION, "0 1 2 3 4 5 6 7 8 9"]
    core.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    return tokenizer


class Induction(nn.Module):
    """A model that finds the key by looking back: at each token it predicts what followed the latest
    earlier occurrence of its last four tokens in its document (an induction head), with an identity head."""

    def __init__(self, vocab: int):
        super().__init__()
        self.config = DecoderConfig(**{**TINY, "vocab_size": vocab})
        self.lm_head = nn.Linear(vocab, vocab, bias=False)
        nn.init.eye_(self.lm_head.weight)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None):
        hidden = torch.zeros(*input_ids.shape, self.lm_head.weight.shape[0])
        for row, (ids, positions) in enumerate(zip(input_ids.tolist(), position_ids.tolist())):
            for t in range(3, len(ids)):
                start = t - positions[t]
                for j in range(t - 1, start + 2, -1):
                    if ids[j - 3:j + 1] == ids[t - 3:t + 1]:
                        hidden[row, t, ids[j + 1]] = 10.0
                        break
        return hidden


def tiny_model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM.from_config(DecoderConfig(**TINY))


def test_position_buckets_are_powers_of_two_up_to_seq_len():
    assert position_edges(512) == [0, 64, 128, 256, 512]
    assert position_edges(1000) == [0, 64, 128, 256, 512, 1000]
    assert position_edges(48) == [0, 48]


def test_bucket_losses_weighted_by_their_tokens_equal_the_eval_loss():
    kernels.set_backend("reference")
    model = tiny_model()
    batches = held_out_data(RECALL, None, 0.0, 160, 2, 0, TINY["vocab_size"], None, 3).batches
    figures = Evaluator(model, torch.device("cpu"), World.single(), 160, batches, None).evaluate()
    edges = position_edges(160)
    weighted, total_tokens, total_loss = 0.0, 0, 0.0
    for batch in batches:
        supervised = batch.labels != IGNORE_INDEX
        for low, high in zip(edges, edges[1:]):
            count = int((supervised & (batch.position_ids >= low) & (batch.position_ids < high)).sum())
            weighted += figures.get(f"eval/loss_pos/{low}-{high}", 0.0) * count
        with torch.no_grad():
            total_loss += float(model.loss(model(batch.input_ids), batch.labels, reduction="sum"))
        total_tokens += int(supervised.sum())
    assert figures["eval/tokens"] == total_tokens
    assert figures["eval/loss"] == pytest.approx(total_loss / total_tokens, rel=1e-6)
    assert weighted / total_tokens == pytest.approx(figures["eval/loss"], rel=1e-6)
    assert figures["eval/perplexity"] == pytest.approx(math.exp(figures["eval/loss"]))
    assert 0.0 <= figures["eval/accuracy"] <= 1.0 and len([k for k in figures if "loss_pos" in k]) == 3


def test_a_haystack_hides_its_key_at_its_depth_and_asks_for_it_at_the_end(tmp_path):
    parts = HaystackParts(passkey_tokenizer(tmp_path), None)
    key = parts.encode(" 12345")
    where = []
    for depth in (0.0, 0.5, 1.0):
        ids, is_target = parts.haystack(300, depth, "12345")
        assert len(ids) == 300 and ids[-len(key):] == key and sum(is_target) == len(key) and is_target[-1]
        where.append(next(i for i in range(len(ids)) if ids[i:i + len(key)] == key))
    assert where[0] < 40 < where[1] < where[2] < 300 - 30


def test_passkey_is_at_chance_for_a_random_model_and_exact_for_one_that_finds_the_key(tmp_path):
    kernels.set_backend("reference")
    tokenizer = passkey_tokenizer(tmp_path)
    grid = passkey_grid(tokenizer, 256, 2, lengths=2, depths=3, trials=2)
    assert grid.lengths == [128, 256] and grid.depths == [0.0, 0.5, 1.0] and grid.cell_count == 12
    assert sorted(set(torch.cat([c.flatten() for c in grid.cells]).tolist())) == list(range(-1, 12))
    vocab = len(tokenizer)
    random_model = CausalLM.from_config(DecoderConfig(**{**TINY, "vocab_size": vocab}))
    chance = Evaluator(random_model, torch.device("cpu"), World.single(), 256, [], grid).evaluate()
    finder = Evaluator(Induction(vocab), torch.device("cpu"), World.single(), 256, [], grid).evaluate()
    assert chance["eval/passkey/accuracy"] == 0.0
    assert finder["eval/passkey/accuracy"] == 1.0
    assert finder["eval/passkey/128"] == finder["eval/passkey/256/50"] == 1.0


def test_the_passkey_logits_make_no_fp32_copy_of_a_bf16_head():
    head = torch.randn(96, 64).bfloat16()
    hidden, labels = torch.randn(1, 8, 64), torch.randint(0, 96, (1, 8))
    cells = torch.tensor([[-1, -1, 0, 0, -1, 1, 1, -1]])
    shapes = []

    class FloatResults(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            shapes.extend(r.shape for r in pytree.tree_leaves(result)
                          if isinstance(r, torch.Tensor) and r.dtype == torch.float32)
            return result
    with FloatResults():
        wrong, total = answer_misses(hidden, head, labels, cells, 2)
    assert head.shape not in shapes and head.t().shape not in shapes
    expected = ((hidden[0, [2, 3, 5, 6]].bfloat16() @ head.t()).float().argmax(-1) != labels[0, [2, 3, 5, 6]]).long()
    assert total == [2, 2] and wrong == [int(expected[:2].sum()), int(expected[2:].sum())]


@pytest.mark.parametrize("every, passkey_every, due, passkey_due", [
    (2, 0, [2, 4, 6], [6]),
    (0, 4, [4, 6], [4, 6]),          # the passkey alone: at its steps and at the end, as documented
    (0, 0, [6], [6]),                # eval.at_start=true alone: the end too
])
def test_an_evaluation_is_due_at_its_steps_and_at_the_end_whenever_one_is_on(every, passkey_every, due, passkey_due):
    evaluator = Evaluator(None, torch.device("cpu"), World.single(), 128, [], passkey=object(), every_steps=every,
                          passkey_every_steps=passkey_every, max_steps=6)
    assert [step for step in range(1, 7) if evaluator.due(step)] == due
    assert [step for step in range(1, 7) if evaluator.passkey_due(step)] == passkey_due


def test_a_run_with_only_the_passkey_scheduled_also_evaluates_at_start():
    cfg = OmegaConf.structured(EvalConfig)
    cfg.passkey.every_steps = 4
    assert evaluating(cfg) and starts_with_eval(cfg)
    cfg.at_start = False
    assert not starts_with_eval(cfg)


def test_the_held_out_split_is_by_document_disjoint_and_the_same_every_time():
    train_part, held = split_documents(1000, 0.05)
    assert len(held) == 50 and len(train_part) == 950 and not set(train_part) & set(held)
    again = split_documents(1000, 0.05)
    assert (again[0] == train_part).all() and (again[1] == held).all()
    assert len(split_documents(10, 0.001)[1]) == 1


def test_held_out_files_are_left_out_of_training_and_read_the_same_at_every_resume(tmp_path):
    from data import build_data
    from tests.data_support import save_tokenizer, write_jsonl
    save_tokenizer(tmp_path)
    words = ["the cat sat on the mat", "a dog ran in the park", "hello friend see you bye"]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": words[i % 3] + f" {'cat ' * (i % 7)}"} for i in range(40)])
    data_cfg = DataConfig(name="files", path=str(path), cache_dir=str(tmp_path / "cache"), num_proc=1)
    stream = build_data(data_cfg, 32, 2, 0, 64, str(tmp_path), held_out=0.25)
    whole = build_data(data_cfg, 32, 2, 0, 64, str(tmp_path))
    assert stream.stats.documents == 30 and whole.stats.documents == 40
    assert stream.plan["tokenized documents"] != whole.plan["tokenized documents"]     # a resume sees other data
    first = held_out_data(data_cfg, None, 0.25, 32, 2, 0, 64, str(tmp_path), 2)
    second = held_out_data(data_cfg, None, 0.25, 32, 2, 0, 64, str(tmp_path), 2)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(first.batches, second.batches))
    assert first.text and len(first.batches) == 2


def test_evaluating_changes_nothing_of_training(tmp_path):
    plain = train(job_config(tmp_path / "plain", "max_steps=4"))
    evaluated = train(job_config(tmp_path / "evaluated", "max_steps=4", "eval.every_steps=2"))
    assert [r["loss"] for r in records(tmp_path / "plain")] == \
        [r["loss"] for r in records(tmp_path / "evaluated") if "loss" in r]
    assert plain["loss"] == evaluated["loss"]
    steps = [r["step"] for r in records(tmp_path / "evaluated") if "eval/loss" in r]
    assert steps == [0, 2, 4]


def test_a_resumed_run_continues_the_eval_history_without_duplicates(tmp_path):
    train(job_config(tmp_path, "max_steps=3", "eval.every_steps=2", "checkpoint.every_steps=2"))
    train(job_config(tmp_path, "max_steps=6", "eval.every_steps=2", "checkpoint.every_steps=2"))
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == list(range(7))
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 2, 3, 4, 6]


def test_a_run_that_died_in_its_first_step_after_evaluating_at_start_can_be_run_again(tmp_path, monkeypatch):
    def dies(*args, **kwargs):
        raise RuntimeError("killed in step 1")
    monkeypatch.setattr("trainer.loop.train_step", dies)
    with pytest.raises(RuntimeError, match="killed in step 1"):
        train(job_config(tmp_path, "max_steps=2", "eval.every_steps=2"))
    assert [r["step"] for r in records(tmp_path)] == [0]
    monkeypatch.undo()
    train(job_config(tmp_path, "max_steps=2", "eval.every_steps=2"))      # the same command again
    assert [r["step"] for r in records(tmp_path)] == [0, 1, 2]


def test_the_progress_clock_starts_after_the_evaluation_at_start(tmp_path, monkeypatch, caplog):
    import trainer.console
    real_evaluate, slept = Evaluator.evaluate, []

    def slow_evaluate(self, with_passkey=True):      # an hour-long evaluation, on the console's clock
        slept.append(3600.0)
        return real_evaluate(self, with_passkey)
    monkeypatch.setattr(Evaluator, "evaluate", slow_evaluate)
    monkeypatch.setattr(trainer.console, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + sum(slept)))
    caplog.set_level("INFO", logger="trainer.console")
    train(job_config(tmp_path, "max_steps=2", "eval.every_steps=0", "eval.at_start=true"))
    line = next(record.getMessage() for record in caplog.records if record.getMessage().startswith("step 1/"))
    assert "elapsed 00:00 " in line or "elapsed 00:01 " in line, line


@pytest.mark.parametrize("overrides, message", [
    (["eval.every_steps=-1"], "eval.every_steps=-1 must be at least 0"),
    (["eval.fraction=1.5"], "eval.fraction=1.5 must be in"),
    (["eval.fraction=0.1"], "take held-out documents of data=files"),
    (["eval.passkey.filler=text"], "eval.passkey.filler='text' is not one of"),
    (["data=files", "data.path=x", "model.path=/tmp", "eval.every_steps=5"], "set eval.path=<files> or eval.fraction"),
])
def test_eval_settings_are_checked(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(job_config(tmp_path, *overrides))


def test_an_evaluation_fits_below_the_training_steps_plan():
    from tests.test_config import make_config
    from trainer.build import plan_for
    for overrides in (["seq_len=65536"], ["seq_len=131072", "train=full"], ["seq_len=8192", "memory.checkpoint=false"],
                      ["seq_len=524288"]):
        cfg = make_config("model=llama3_8b", "memory.gpu=h100_80gb", *overrides)
        validate(cfg)
        plan = plan_for(cfg, torch.device("cuda"))
        static = plan.gpu["weights"] + plan.gpu["rope tables"]
        assert static < plan.eval_peak <= plan.gpu_peak, overrides


def _sequence_parallel_worker(rank: int, init_file: str, failures, directory: str):
    with gloo_rank(rank, init_file, failures):
        kernels.set_backend("reference")
        torch.set_num_threads(1)
        tokenizer = passkey_tokenizer(Path(directory) / f"tokenizer-{rank}")
        grid = passkey_grid(tokenizer, 256, 1, lengths=2, depths=2, trials=1)
        batches = held_out_data(RECALL, None, 0.0, 256, 2, 0, len(tokenizer), None, 1).batches
        torch.manual_seed(0)
        model = CausalLM.from_config(DecoderConfig(**{**TINY, "vocab_size": max(len(tokenizer), 96)}))
        with torch.no_grad():
            model.lm_head.weight.mul_(40)      # a random model whose passkey answers are not all wrong
        expected = Evaluator(model, torch.device("cpu"), World.single(), 256, batches, grid).evaluate()
        world = world_of(rank, 2, 2)
        install_attention_route(model, choose_route(torch.device("cpu"), 16, "reference",
                                                     sequence_group=world.sequence_group))
        together = Evaluator(model, torch.device("cpu"), world, 256, batches, grid).evaluate()
        for name, value in expected.items():
            if name != "eval/time_s":
                assert together[name] == pytest.approx(value, rel=1e-5), name
        assert together.keys() == expected.keys()


def test_sequence_parallel_ranks_combine_their_figures(tmp_path):
    run_two_ranks(_sequence_parallel_worker, str(tmp_path))


def test_report_draws_loss_by_position_and_the_passkey_heatmap(tmp_path):
    from scripts.report import report
    rows = [{"step": 0, "eval/loss": 2.0, "eval/loss_pos/0-64": 2.0, "eval/loss_pos/64-128": 3.0,
             "eval/passkey/64/0": 0.0, "eval/passkey/64/100": 1.0, "eval/passkey/128/0": 0.0,
             "eval/passkey/128/100": 0.0},
            {"step": 1, "loss": 1.0, "tokens_per_s": 5.0, "host_rss_gib": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    written = {path.name for path in report(tmp_path)}
    assert {"report_loss_by_position.png", "report_passkey.png"} <= written


def test_evaluate_script_says_how_and_evaluates_a_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, "scripts/evaluate.py", "--help"], cwd=REPO, capture_output=True,
                          text=True, check=True)
    assert "checkpoint" in done.stdout and "model.path" in done.stdout
    assert ".venv/bin/python scripts/evaluate.py <run dir>" in done.stdout
    train(job_config(tmp_path / "run", "max_steps=2", "checkpoint.every_steps=2", "eval.every_steps=2"))
    out = tmp_path / "eval"
    subprocess.run([sys.executable, "scripts/evaluate.py", str(tmp_path / "run" / "checkpoints" / "step-2"),
                    "--out", str(out)], cwd=REPO, check=True, capture_output=True, text=True)
    figures = json.loads((out / "evaluation.json").read_text())
    trained = next(row for row in records(tmp_path / "run") if row["step"] == 2)
    misspelt = subprocess.run([sys.executable, "scripts/evaluate.py", str(tmp_path / "run" / "checkpoints" / "step-2"),
                               "--out", str(out), "eval.sequencs=4"], cwd=REPO, capture_output=True, text=True)
    assert misspelt.returncode == 1 and misspelt.stderr.strip() == (
        "evaluation failed: unknown setting eval.sequencs: the nearest is eval.sequences (eval has: every_steps, "
        "sequences, at_start, path, fraction, passkey)")
    # The same weights, config, held-out sequences and kernels on the same CPU: the very figure training logged.
    assert figures["eval/loss"] == trained["eval/loss"] and figures["eval/tokens"] == trained["eval/tokens"] > 0
    assert (out / "loss_by_position.png").is_file()

    model_dir = tmp_path / "model"           # a Hugging Face directory with a tokenizer: the passkey probe too
    tokenizer = passkey_tokenizer(model_dir)
    model = CausalLM.from_config(DecoderConfig(**{**TINY, "vocab_size": len(tokenizer)}))
    from safetensors.torch import save_file
    (model_dir / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    save_file({name: t.contiguous() for name, t in model.state_dict().items()}, str(model_dir / "model.safetensors"))
    subprocess.run([sys.executable, "scripts/evaluate.py", str(model_dir), "--out", str(out / "model"), "device=cpu",
                    "seq_len=256", "eval.passkey.lengths=2", "eval.passkey.depths=2", "data.num_keys=20",
                    "data.num_values=10", "data.num_pairs=4", "data.num_queries=4"],
                   cwd=REPO, check=True, capture_output=True, text=True)
    figures = json.loads((out / "model" / "evaluation.json").read_text())
    assert figures["eval/passkey/accuracy"] == 0.0 and "eval/passkey/256/100" in figures
    assert (out / "model" / "passkey.png").is_file()
    refused = subprocess.run([sys.executable, "scripts/evaluate.py", "--out", str(out / "bad"), "seq_len=16"],
                             cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        next(line for line in refused.stderr.splitlines() if line.startswith("evaluation failed: seq_len=16"))]


def test_evaluate_script_refuses_weights_that_do_not_fit_the_model():
    from scripts.evaluate import ExportError, load_weights
    model = tiny_model()
    weights = dict(model.state_dict())
    del weights["lm_head.weight"]
    with pytest.raises(ExportError, match=r"do not fit the model of its config: 1 missing \(first: lm_head.weight\)$"):
        load_weights(tiny_model(), weights, Path("step-2"))
    weights = {**model.state_dict(), "model.extra.weight": torch.zeros(1)}
    with pytest.raises(ExportError, match=r"config: 1 unexpected \(first: model.extra.weight\)$"):
        load_weights(tiny_model(), weights, Path("step-2"))
    loaded = tiny_model(seed=1)
    load_weights(loaded, model.state_dict(), Path("step-2"))
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


# --- issue 47: haystack lengths derived from seq_len and checked before anything is built; keys placed at a
# whole token, the depth placed recorded ---

def test_passkey_lengths_default_to_the_halvings_of_seq_len_the_tokenizer_allows(tmp_path):
    tokenizer = passkey_tokenizer(tmp_path)
    assert EvalConfig().passkey.lengths is None
    # A haystack needs 71 tokens here (instruction, key, question) and 32 of filler: 64 is too short.
    assert passkey_grid(tokenizer, 512, 1, lengths=None, depths=2, trials=1).lengths == [128, 256, 512]
    assert passkey_grid(tokenizer, 4096, 1, lengths=None, depths=1, trials=1).lengths == [512, 1024, 2048, 4096]


def files_job(tmp_path, checkpoint, text_file, *overrides):
    return job_config(tmp_path / "run", "data=files", f"data.path={text_file}", f"data.cache_dir={tmp_path / 'cache'}",
                      "model=tiny", f"model.path={checkpoint}", "seq_len=128", "max_steps=2", "eval.every_steps=2",
                      "eval.fraction=0.25", *overrides)


def test_evaluation_with_its_defaults_runs_at_a_short_seq_len(tmp_path, checkpoint, text_file):
    train(files_job(tmp_path, checkpoint, text_file))
    assert records(tmp_path / "run")[-1]["eval/passkey/128"] in (0.0, 1.0)


def test_haystack_lengths_given_too_short_for_the_tokenizer_are_refused_before_anything_is_built(tmp_path, checkpoint,
                                                                                                  text_file):
    from data import DataError
    with pytest.raises(DataError) as refused:
        train(files_job(tmp_path, checkpoint, text_file, "eval.passkey.lengths=3"))
    assert str(refused.value) == (
        "eval.passkey.lengths=3 at seq_len=128 makes a haystack of 32 tokens, and one needs 84 with this tokenizer "
        "(the instruction, key and question, and 32 of filler): set eval.passkey.lengths=1 or fewer, or leave it "
        "unset (derived from seq_len)")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="^eval.passkey.lengths=9 halves seq_len=128 down to nothing"):
        validate(files_job(tmp_path, checkpoint, text_file, "eval.passkey.lengths=9"))


def test_the_key_sits_at_the_whole_token_nearest_its_depth_which_names_its_figures(tmp_path):
    from scripts.report import passkey_cells
    tokenizer = passkey_tokenizer(tmp_path)
    parts = HaystackParts(tokenizer, None)
    key = parts.encode(" 12345")
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    where = []
    for depth in depths:
        ids, _ = parts.haystack(128, depth, "12345")
        where.append(next(i for i in range(len(ids)) if ids[i:i + len(key)] == key))
    # 128 tokens hold 57 of filler (71 are fixed): the key goes after 0, 14, 28, 43 and 57 of them, not at
    # whole repeats of the 39-token filler sentence.
    needle_start = where[0]
    assert [position - needle_start for position in where] == [0, 14, 28, 43, 57]
    grid = passkey_grid(tokenizer, 128, 1, lengths=1, depths=5, trials=1)
    assert grid.placed == [split / 57 for split in (0, 14, 28, 43, 57)]
    figures = Evaluator(Induction(len(tokenizer)), torch.device("cpu"), World.single(), 128, [], grid).evaluate()
    assert {name for name in figures if name.startswith("eval/passkey/128/")} == {
        f"eval/passkey/128/{depth}" for depth in (0, 25, 49, 75, 100)}
    assert passkey_cells(figures)[1] == [0, 25, 49, 75, 100]        # the heatmap's depth axis
