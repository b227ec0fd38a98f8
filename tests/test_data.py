"""The data pipeline: pure packing/masking core, the `files` source on `datasets`, resume and bad input.

Everything runs on a WordLevel tokenizer trained here on a few sentences and a tiny random Llama
checkpoint, both written to a temporary directory in Hugging Face format.
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import save_file

import data
import data.files
from conf.schema import register_configs
from conf.validate import ConfigError, validate
from data import IGNORE_INDEX, DataConfig, DataError, build_data, check_data_config
from data.packing import assemble_batch, pack_rows, plan_pieces, shifted_labels
from data.tokenize import tokenize_chat, tokenize_texts
from model import Llama

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "hello friend see you bye",
             "be brief hi there", "<|system|> <|user|> <|assistant|> [assistant] [user]"]
TINY_ARCH = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0)
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello friend"}, {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"}]


def save_tokenizer(directory: Path, chat_template: str | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama with the test tokenizer: a complete model.path directory."""
    directory = tmp_path_factory.mktemp("tiny_checkpoint")
    save_tokenizer(directory)
    model = Llama.from_config(TINY_ARCH)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    save_file({name: t.contiguous() for name, t in model.state_dict().items()}, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)


def tokens(tokenizer, ids) -> list:
    return [None if i == IGNORE_INDEX else tokenizer.convert_ids_to_tokens(int(i)) for i in ids]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def files_config(path, tmp_path, **options) -> DataConfig:
    options = {"num_proc": 1, **options}
    return DataConfig(name="files", path=str(path), cache_dir=str(tmp_path / "cache"), **options)


# Tokens with BOS and EOS: 9, 8, 3, 5, 0 (empty: no document), 4, 6, 10.
TEXTS = ["the cat sat on the mat the", "a dog ran in the park", "hello", "be brief hi", "", "cat cat", "dog dog dog dog",
         "the cat sat on the mat a dog"]


@pytest.fixture
def text_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "docs.jsonl", [{"text": text} for text in TEXTS])


# --- pure core -------------------------------------------------------------------------------------------


def test_shifted_labels_never_target_the_first_token_or_past_the_end():
    assert shifted_labels([5, 6, 7, 8], [True, True, False, True]) == [6, IGNORE_INDEX, 8, IGNORE_INDEX]
    assert shifted_labels([], []) == []


def test_plan_pieces_split_drop_truncate():
    lengths = np.array([3, 10, 0, 4])
    pieces, counts = plan_pieces(lengths, 4, "split")
    assert pieces.tolist() == [[0, 0, 3], [1, 0, 4], [1, 4, 8], [1, 8, 10], [3, 0, 4]] and counts.split == 1
    pieces, counts = plan_pieces(lengths, 4, "drop")
    assert pieces.tolist() == [[0, 0, 3], [3, 0, 4]] and counts.dropped == 1
    pieces, counts = plan_pieces(lengths, 4, "truncate")
    assert pieces.tolist() == [[0, 0, 3], [1, 0, 4], [3, 0, 4]] and counts.truncated == 1


def test_pack_rows_first_fit_within_the_window_and_unpacked():
    lengths = np.array([3, 4, 2, 4, 1, 5, 2])
    # 3 opens row A, 4 opens B, 2 fills A (closed), 4 opens C, 1 fills B, 5 is a full row, 2 opens D.
    assert pack_rows(lengths, 5, pack=True) == [[0, 2], [1, 4], [5], [3], [6]]
    # With one open row a piece that does not fit closes it: next-fit.
    assert pack_rows(lengths, 5, pack=True, window=1) == [[0], [1], [2], [3, 4], [5], [6]]
    assert pack_rows(np.array([3, 2, 4]), 5, pack=False) == [[0], [1], [2]]


def test_packed_batch_boundaries_positions_and_labels():
    rows = [[([10, 11, 12], [False, True, True]), ([20, 21], [False, True])], [([30, 31, 32, 33], [True] * 4)]]
    batch = assemble_batch(rows, seq_len=6, pad_id=0, packed=True)
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 6, 10, 12]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21, 0], [30, 31, 32, 33, 0, 0]]
    no = IGNORE_INDEX
    assert batch.labels.tolist() == [[11, 12, no, 21, no, no], [31, 32, 33, no, no, no]]
    unpacked = assemble_batch([rows[1]], seq_len=6, pad_id=0, packed=False)
    assert unpacked.cu_seqlens is None and unpacked.labels.tolist() == [[31, 32, 33, no, no, no]]


def test_packed_documents_do_not_attend_across(tokenizer):
    """Hidden states of a packed batch equal those of each document run alone."""
    torch.manual_seed(0)
    model = Llama.from_config(TINY_ARCH).eval()
    documents = [tokenize_texts([text], tokenizer, 2, 3)[0] for text in TEXTS[:4]]
    rows = [documents[:2], documents[2:]]
    batch = assemble_batch(rows, seq_len=20, pad_id=1, packed=True)
    with torch.no_grad():
        packed = model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens)
        for row, row_documents in enumerate(rows):
            start = 0
            for ids, _ in row_documents:
                alone = model(torch.tensor([ids]))[0]
                torch.testing.assert_close(packed[row, start:start + len(ids)], alone, rtol=1e-5, atol=1e-5)
                start += len(ids)
        unmasked = model(batch.input_ids, position_ids=batch.position_ids)
    second = len(documents[0][0])       # the second document of row 0 does see the first without cu_seqlens
    assert not torch.allclose(unmasked[0, second:second + 2], packed[0, second:second + 2], atol=1e-3)


# --- chat masks ------------------------------------------------------------------------------------------

def test_chat_fallback_template_masks_exactly_the_assistant_replies(tokenizer):
    ids, _ = document = tokenize_chat(CHAT, tokenizer, "assistant", tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert tokens(tokenizer, ids) == ["<s>", "<|system|>", "be", "brief", "</s>", "<|user|>", "hi", "there", "</s>",
                                      "<|assistant|>", "hello", "friend", "</s>", "<|user|>", "bye", "</s>",
                                      "<|assistant|>", "see", "you", "</s>"]
    labels = tokens(tokenizer, shifted_labels(*document))
    assert labels == [None] * 9 + ["hello", "friend", "</s>"] + [None] * 4 + ["see", "you", "</s>", None]


def test_chat_last_turn_and_all(tokenizer):
    last = tokens(tokenizer, shifted_labels(*tokenize_chat(CHAT, tokenizer, "last_turn", 2, 3)))
    assert last == [None] * 16 + ["see", "you", "</s>", None]
    ids, mask = tokenize_chat(CHAT, tokenizer, "all", 2, 3)
    assert shifted_labels(ids, mask) == ids[1:] + [IGNORE_INDEX]


def test_chat_uses_the_tokenizer_template_and_never_trains_its_headers(tmp_path):
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }} {% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    tokenizer = save_tokenizer(tmp_path, chat_template=template)
    ids, mask = tokenize_chat(CHAT[1:3], tokenizer, "assistant", 2, 3)
    assert tokens(tokenizer, ids) == ["<s>", "[user]", "hi", "there", "</s>", "[assistant]", "hello", "friend", "</s>"]
    assert tokens(tokenizer, shifted_labels(ids, mask)) == [None] * 5 + ["hello", "friend", "</s>", None]


def test_chat_template_that_rewrites_earlier_turns_needs_loss_on_all(tmp_path):
    template = "{% for m in messages %}{% if loop.last %}[user] {% endif %}{{ m['content'] }} {% endfor %}"
    tokenizer = save_tokenizer(tmp_path, chat_template=template)
    with pytest.raises(DataError, match="use data.loss_on=all"):
        tokenize_chat(CHAT[1:3], tokenizer, "assistant", 2, 3)
    ids, mask = tokenize_chat(CHAT[1:3], tokenizer, "all", 2, 3)
    assert tokens(tokenizer, ids) == ["<s>", "hi", "there", "[user]", "hello", "friend", "</s>"] and all(mask[1:])


def test_chat_unknown_role_is_named(tokenizer):
    with pytest.raises(DataError, match="record 7, message 1: unknown role 'wizard'"):
        tokenize_chat([CHAT[0], {"role": "wizard", "content": "x"}], tokenizer, "assistant", 2, 3, record=7)


# --- files source ----------------------------------------------------------------------------------------


def collect(stream, count: int) -> list:
    return [next(stream) for _ in range(count)]


def assert_same_batches(first: list, second: list) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_text_jsonl_packs_every_document_once_per_epoch(text_file, tmp_path, checkpoint, tokenizer):
    stream = build_data(files_config(text_file, tmp_path), seq_len=10, batch_size=1, seed=0, vocab_size=64,
                        tokenizer_path=str(checkpoint))
    batches = collect(stream, stream.stats.sequences)
    seen = sorted(tuple(b.input_ids[0, s:e].tolist()) for b in batches
                  for s, e in zip(b.cu_seqlens[:-1].tolist(), b.cu_seqlens[1:].tolist()) if b.input_ids[0, s] == 2)
    expected = sorted(tuple(ids) for ids, _ in tokenize_texts(TEXTS, tokenizer, 2, 3) if ids)
    assert seen == expected
    assert stream.state_dict()["epoch"] == 1
    assert all((b.labels[0] != IGNORE_INDEX).sum() > 0 for b in batches)


def test_stats_line_counts_documents_tokens_and_long_documents(text_file, tmp_path, checkpoint, caplog):
    caplog.set_level("INFO", logger="data.files")
    stream = build_data(files_config(text_file, tmp_path), seq_len=6, batch_size=1, seed=0, vocab_size=64,
                        tokenizer_path=str(checkpoint))
    stats = stream.stats
    assert (stats.documents, stats.tokens, stats.long_docs.split) == (7, 45, 3)
    padding = 1 - stats.tokens / (stats.sequences * 6)
    assert stats.padding_fraction == pytest.approx(padding)
    assert "7 documents, 45 tokens (mean 6.4 per document" in caplog.text and "3 split, 0 dropped" in caplog.text


def test_unpacked_rows_hold_one_document_each(text_file, tmp_path, checkpoint):
    cfg = files_config(text_file, tmp_path, pack=False, long_docs="truncate")
    stream = build_data(cfg, seq_len=8, batch_size=7, seed=0, vocab_size=64, tokenizer_path=str(checkpoint))
    batch = next(stream)
    assert batch.cu_seqlens is None
    assert sorted((batch.input_ids != 1).sum(1).tolist()) == [3, 4, 5, 6, 8, 8, 8]   # 9 and 10 truncated
    assert (batch.labels[batch.input_ids == 1] == IGNORE_INDEX).all()
    assert stream.stats.long_docs.truncated == 2


def test_shuffle_is_deterministic_per_seed_and_epoch(text_file, tmp_path, checkpoint):
    def first_epochs(seed):
        stream = build_data(files_config(text_file, tmp_path), seq_len=10, batch_size=1, seed=seed, vocab_size=64,
                            tokenizer_path=str(checkpoint))
        epoch = stream.stats.sequences
        return [b.input_ids for b in collect(stream, epoch)], [b.input_ids for b in collect(stream, epoch)]
    epoch0, epoch1 = first_epochs(seed=1)
    again0, again1 = first_epochs(seed=1)
    other0, _ = first_epochs(seed=2)
    assert all(torch.equal(a, b) for a, b in zip(epoch0 + epoch1, again0 + again1))
    assert not all(torch.equal(a, b) for a, b in zip(epoch0, epoch1))
    assert not all(torch.equal(a, b) for a, b in zip(epoch0, other0))


def test_resume_yields_the_identical_next_batches_across_epochs(text_file, tmp_path, checkpoint, monkeypatch):
    def pipeline():
        return build_data(files_config(text_file, tmp_path), seq_len=10, batch_size=2, seed=3, vocab_size=64,
                          tokenizer_path=str(checkpoint))
    original = pipeline()
    collect(original, 3)
    state = original.state_dict()
    expected = collect(original, 5)          # 16 rows: past the end of the first epoch
    assert original.state_dict()["epoch"] >= 1

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("re-tokenized on resume")
    monkeypatch.setattr(data.files, "tokenize_batch", no_tokenizing)
    resumed = pipeline()
    resumed.load_state_dict(state)
    assert_same_batches(collect(resumed, 5), expected)


def test_resume_refuses_a_different_plan(text_file, tmp_path, checkpoint):
    state = build_data(files_config(text_file, tmp_path), 10, 1, 0, 64, str(checkpoint)).state_dict()
    other = build_data(files_config(text_file, tmp_path), 12, 1, 0, 64, str(checkpoint))
    with pytest.raises(DataError, match="saved for a different dataset or packing"):
        other.load_state_dict(state)


def test_chat_jsonl_parquet_and_save_to_disk_give_the_same_batches(tmp_path, checkpoint, tokenizer):
    import datasets
    records = [{"messages": CHAT}, {"messages": CHAT[1:3]}, {"messages": CHAT[3:]}]
    jsonl = write_jsonl(tmp_path / "chat.jsonl", records)
    parquet = tmp_path / "parquet" / "chat.parquet"
    parquet.parent.mkdir()
    datasets.Dataset.from_list(records).to_parquet(str(parquet))
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    batches = []
    for path in (jsonl, parquet.parent, tmp_path / "saved"):
        stream = build_data(files_config(path, tmp_path), 32, 2, 0, 64, str(checkpoint))
        batches.append(collect(stream, 2))
    assert_same_batches(batches[0], batches[1])
    assert_same_batches(batches[0], batches[2])
    supervised = {tokenizer.convert_ids_to_tokens(int(i)) for b in batches[0] for i in b.labels[b.labels >= 0]}
    assert supervised == {"hello", "friend", "see", "you", "</s>"}


def test_long_chats_are_dropped_by_default(tmp_path, checkpoint):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": CHAT[1:3]}])
    stream = build_data(files_config(path, tmp_path), 12, 1, 0, 64, str(checkpoint))
    assert (stream.stats.documents, stream.stats.long_docs.dropped, stream.stats.sequences) == (2, 1, 1)


def test_plain_text_folder_is_one_document_per_file(tmp_path, checkpoint):
    folder = tmp_path / "texts"
    folder.mkdir()
    for index, text in enumerate(TEXTS[:3]):
        (folder / f"{index}.txt").write_text(text + "\n")
    stream = build_data(files_config(folder, tmp_path), 16, 1, 0, 64, str(checkpoint))
    assert (stream.stats.documents, stream.stats.tokens) == (3, 9 + 8 + 3)


def test_tokenization_is_cached_and_skipped_on_the_second_run(text_file, tmp_path, checkpoint, monkeypatch):
    build_data(files_config(text_file, tmp_path), 10, 1, 0, 64, str(checkpoint))
    monkeypatch.setattr(data.files, "tokenize_batch", lambda *a, **k: pytest.fail("tokenized twice"))
    build_data(files_config(text_file, tmp_path), 10, 1, 0, 64, str(checkpoint))
    changed = files_config(text_file, tmp_path, add_eos=False)
    with pytest.raises(pytest.fail.Exception, match="tokenized twice"):
        build_data(changed, 10, 1, 0, 64, str(checkpoint))


def test_several_tokenizing_processes_give_the_same_documents(text_file, tmp_path, checkpoint):
    one = build_data(files_config(text_file, tmp_path), 10, 2, 0, 64, str(checkpoint))
    two = build_data(files_config(text_file, tmp_path / "other", num_proc=2), 10, 2, 0, 64, str(checkpoint))
    assert one.documents["input_ids"][:] == two.documents["input_ids"][:]


# --- bad input -------------------------------------------------------------------------------------------


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
        check_data_config(files_config(tmp_path / path, tmp_path), 16, 64, str(checkpoint))


def test_mixed_file_kinds_are_rejected(tmp_path, checkpoint):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.txt").write_text("x\n")
    with pytest.raises(DataError, match="mixes file kinds"):
        check_data_config(files_config(tmp_path, tmp_path), 16, 64, str(checkpoint))


def test_file_source_needs_model_path_with_a_tokenizer(text_file, tmp_path):
    with pytest.raises(DataError, match="set model.path="):
        check_data_config(files_config(text_file, tmp_path), 16, 64, None)
    with pytest.raises(DataError, match="has no tokenizer"):
        check_data_config(files_config(text_file, tmp_path), 16, 64, str(tmp_path))


def test_tokenizer_larger_than_the_vocabulary(text_file, tmp_path, checkpoint, tokenizer):
    with pytest.raises(DataError, match=f"has {len(tokenizer)} tokens but the model's vocab_size is 8"):
        build_data(files_config(text_file, tmp_path), 16, 1, 0, 8, str(checkpoint))


@pytest.mark.parametrize("content,message", [
    ("", "holds no records: 1 matching file"),
    ('{"body": "x"}\n', r"have no field 'text' \(data.text_field\); fields present: \['body'\]"),
    ("{not json\n", "could not read data.path="),
    ('{"messages": [{"role": "wizard", "content": "x"}]}\n', "record 0, message 0: unknown role 'wizard'"),
])
def test_bad_records_fail_before_training(content, message, tmp_path, checkpoint):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        build_data(files_config(path, tmp_path), 16, 1, 0, 64, str(checkpoint))


def test_all_documents_dropped_is_an_error(text_file, tmp_path, checkpoint):
    with pytest.raises(DataError, match="no document is left to train on"):
        build_data(files_config(text_file, tmp_path, long_docs="drop"), 1, 1, 0, 64, str(checkpoint))


# --- through the trainer ---------------------------------------------------------------------------------


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


def test_document_lengths_are_read_as_whole_arrow_columns(monkeypatch):
    """Planning reads the length/target columns in one Arrow read: datasets' lazy Column read row by row
    took ~30 s per million documents, at every start and resume."""
    import datasets
    import datasets.arrow_dataset
    lengths = [3, 0, 7, 12, 5] * 200
    documents = datasets.Dataset.from_dict({
        "input_ids": [list(range(n)) for n in lengths], "is_target": [[True] * n for n in lengths],
        "length": lengths, "targets": [max(n - 1, 0) for n in lengths]}).select(range(999, -1, -1))

    def row_by_row(*args, **kwargs):
        raise AssertionError("a column was read row by row")
    monkeypatch.setattr(datasets.arrow_dataset.Column, "__getitem__", row_by_row)
    monkeypatch.setattr(datasets.arrow_dataset.Column, "__iter__", row_by_row)
    stream = data.files.PackedDocuments(documents, seq_len=10, batch_size=2, seed=0, pack=True, long_docs="split",
                                        pad_id=0)
    assert (stream.stats.documents, stream.stats.tokens, stream.stats.targets) == (800, 5400, 4600)
    assert sorted(stream.pieces[:, 0].tolist())[:5] == [0, 1, 1, 2, 4]   # lengths 5, 12 (split), 7, 0, 3
    assert stream.pieces[stream.pieces[:, 0] == 996].tolist() == [[996, 0, 10], [996, 10, 12]]
    assert next(stream).num_tokens == 20
