"""Bad data settings and input: rejected by conf's check or the data preflight before anything is built,
or by the files source before training; and a files job through the trainer."""
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from conf.schema import DataConfig, register_configs
from conf.schema.data import check_data
from conf.validate import ConfigError, validate
from data import DataError, build_data, preflight_data
from tests.data_support import checkpoint, files_config, text_file, tokenizer  # noqa: F401

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()


def test_offline_mode_is_on():
    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize("path,message", [
    ("missing.jsonl", "is not an existing file, folder or glob"),
    ("someorg/some_hub_dataset", "Hub datasets are never downloaded"),
    ("*.parquet", "matches no data files"),
    ("notes.csv", "has extension '.csv'"),
])
def test_bad_paths_are_rejected_early(path, message, tmp_path, checkpoint):
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=message):
        preflight_data(files_config(tmp_path / path, tmp_path), str(checkpoint))


def test_held_out_files_that_are_training_files_are_refused_and_eval_path_is_named(text_file, tmp_path, checkpoint):
    training = files_config(text_file, tmp_path)
    for same in (text_file, tmp_path / "*.jsonl", tmp_path / "." / "docs.jsonl"):
        with pytest.raises(DataError, match="^" + re.escape(f"eval.path='{same}' names 1 of the files data.path=")):
            preflight_data(training, str(checkpoint), str(same))
    with pytest.raises(DataError, match="^eval.path='missing.jsonl' is not an existing file"):
        preflight_data(training, str(checkpoint), "missing.jsonl")
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "other.jsonl").write_text('{"body": "x"}\n')
    preflight_data(training, str(checkpoint), str(tmp_path / "held"))       # files of their own
    from data.held_out import held_out_data
    with pytest.raises(DataError, match="^records in eval.path=.* have no field 'text'"):
        held_out_data(training, str(tmp_path / "held"), 0.0, 16, 1, 0, 64, str(checkpoint), 1)


def test_mixed_file_kinds_are_rejected(tmp_path, checkpoint):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.txt").write_text("x\n")
    with pytest.raises(DataError, match="mixes file kinds"):
        preflight_data(files_config(tmp_path, tmp_path), str(checkpoint))


def test_file_source_needs_model_path_with_a_tokenizer(text_file, tmp_path):
    with pytest.raises(ConfigError, match="set model.path="):
        check_data(files_config(text_file, tmp_path), 16, 64, None)
    with pytest.raises(DataError, match="has no tokenizer"):
        preflight_data(files_config(text_file, tmp_path), str(tmp_path))


@pytest.mark.parametrize("options,message", [
    ({"format": "xml"}, "data.format='xml' is not one of"),
    ({"loss_on": "everything"}, "data.loss_on='everything' is not one of"),
    ({"num_proc": -1}, "data.num_proc=-1 must be >= 0"),
])
def test_bad_file_options_are_config_errors(options, message, text_file, tmp_path, checkpoint):
    with pytest.raises(ConfigError, match=message):
        check_data(files_config(text_file, tmp_path, **options), 16, 64, str(checkpoint))


def test_file_source_needs_data_path(checkpoint):
    with pytest.raises(ConfigError, match="data=files needs data.path="):
        check_data(DataConfig(name="files"), 16, 64, str(checkpoint))


def test_tokenizer_larger_than_the_vocabulary(text_file, tmp_path, checkpoint, tokenizer):
    with pytest.raises(DataError, match=f"has {len(tokenizer)} tokens but the model's vocab_size is 8"):
        build_data(files_config(text_file, tmp_path), 16, 1, 0, 8, str(checkpoint))


@pytest.mark.parametrize("content,message", [
    ("", "holds no records: 1 matching file"),
    ("  \n\n \n", r"holds no records: 1 matching file\(s\), all empty or whitespace only"),
    ('{"body": "x"}\n', r"have no field 'text' \(data.text_field\); fields present: \['body'\]"),
    ("{not json\n", "could not read data.path="),
    ('{"messages": [{"role": "wizard", "content": "x"}]}\n', "bad.jsonl record 1, message 1: unknown role 'wizard'"),
])
def test_bad_records_fail_before_training(content, message, tmp_path, checkpoint):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        build_data(files_config(path, tmp_path), 16, 1, 0, 64, str(checkpoint))


def test_all_documents_dropped_is_an_error(text_file, tmp_path, checkpoint):
    with pytest.raises(DataError, match="no document is left to train on"):
        build_data(files_config(text_file, tmp_path, long_docs="drop"), 1, 1, 0, 64, str(checkpoint))


def job_config(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_validate_reports_data_errors_as_config_errors(text_file):
    with pytest.raises(ConfigError, match="set model.path="):
        validate(job_config("data=files", f"data.path={text_file}"))


def test_train_runs_on_a_jsonl_file(text_file, tmp_path, checkpoint):
    from trainer.loop import train
    cfg = job_config("data=files", f"data.path={text_file}", f"data.cache_dir={tmp_path / 'cache'}", "model=tiny",
                     f"model.path={checkpoint}", "seq_len=16", "batch_size=2", "max_steps=2", "log_every=1",
                     "optim.warmup_steps=0", "device=cpu", f"output_dir={tmp_path / 'run'}")
    metrics = train(cfg)
    assert metrics["step"] == 2 and np.isfinite(metrics["loss"]) and metrics["loss"] > 0


# --- issue 47: data that trains no token is refused before the model is built, naming file, count and fix ---

@pytest.mark.parametrize("records,seq_len,fix", [
    ([{"messages": [{"role": "system", "content": "be brief"}]}] * 3, 16, "data.loss_on=all"),
    ([{"messages": [{"role": "user", "content": "hi there"}]}] * 3, 16, "data.loss_on=all"),
    ([{"text": "the cat sat on the mat"}] * 3, 1, "raise seq_len"),
])
def test_data_that_trains_no_token_is_refused_naming_the_file_the_count_and_the_fix(records, seq_len, fix, tmp_path,
                                                                                     checkpoint):
    from tests.data_support import write_jsonl
    path = write_jsonl(tmp_path / "none.jsonl", records)
    with pytest.raises(DataError) as refused:
        build_data(files_config(path, tmp_path), seq_len, 1, 0, 64, str(checkpoint))
    message = str(refused.value)
    assert message.startswith(f"data.path='{path}': 0 of its ") and "\n" not in message
    assert "3 documents" in message and fix in message


def test_a_run_on_data_that_trains_no_token_stops_before_the_model_is_built(tmp_path, checkpoint, monkeypatch):
    import trainer.loop
    from tests.data_support import write_jsonl
    path = write_jsonl(tmp_path / "system.jsonl", [{"messages": [{"role": "system", "content": "be brief"}]}] * 2)
    monkeypatch.setattr(trainer.loop, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    cfg = job_config("data=files", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", "model=tiny",
                     f"model.path={checkpoint}", "seq_len=16", "max_steps=2", "device=cpu",
                     f"output_dir={tmp_path / 'run'}")
    with pytest.raises(DataError, match="0 of its"):
        trainer.loop.train(cfg)


def test_train_py_stops_on_data_that_trains_no_token_with_one_line_and_exit_2(tmp_path, checkpoint):
    from tests.data_support import write_jsonl
    from tests.jobs_support import train_process
    path = write_jsonl(tmp_path / "system.jsonl", [{"messages": [{"role": "system", "content": "be brief"}]}] * 2)
    done = train_process(tmp_path / "run", "data=chat", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}",
                         "model=tiny", f"model.path={checkpoint}", "seq_len=16")
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output
    [line] = [line for line in output.splitlines() if "0 of its" in line]
    assert re.search(re.escape(f"data.path='{path}': 0 of its ") + r"\d+ tokens in 2 documents would be trained on: "
                     + re.escape("no record has an assistant reply to train on (data.loss_on=assistant trains only "
                                 "those): add assistant turns, or set data.loss_on=all to train on every token") + "$",
                     line)
