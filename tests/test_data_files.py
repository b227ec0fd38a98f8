"""The `files` source on `datasets`: formats, packing stats, shuffling, caching, exact resume and errors that
name the file."""
from pathlib import Path

import pytest
import torch

import data.files
from data import IGNORE_INDEX, DataError, build_data
from data.tokenize import tokenize_texts
from tests.data_support import (CHAT, TEXTS, checkpoint, files_config, text_file, tokenizer,  # noqa: F401
                                write_jsonl)


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
    # Trained: all but each piece's first token (the 12-token documents are two pieces): 4,600 - 200 pieces.
    assert (stream.stats.documents, stream.stats.tokens, stream.stats.targets) == (800, 5400, 4400)
    assert sorted(stream.pieces[:, 0].tolist())[:5] == [0, 1, 1, 2, 4]   # lengths 5, 12 (split), 7, 0, 3
    assert stream.pieces[stream.pieces[:, 0] == 996].tolist() == [[996, 0, 10], [996, 10, 12]]
    assert next(stream).num_tokens == 20


@pytest.mark.parametrize("name,content,line", [
    ("docs.jsonl", '{"text": "a"}\n\n{"text": "b"}\n{"text": "c", oops}\n{"text": "d"}\n', 4),
    ("docs.json", '[{"text": "a"},\n {"text": "b"},\n {"text": "c" "d"}]\n', 3)])
def test_a_malformed_json_line_is_named_with_its_file_and_line(tmp_path, checkpoint, name, content, line):
    suffix = Path(name).suffix
    write_jsonl(tmp_path / f"good{suffix}", [{"text": "fine"}])
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=f"{tmp_path / name} line {line}: not valid JSON"):
        build_data(files_config(tmp_path / f"*{suffix}", tmp_path), 10, 1, 0, 64, str(checkpoint))


def test_a_glob_mixing_text_and_chat_records_names_the_files_and_their_fields(tmp_path, checkpoint):
    write_jsonl(tmp_path / "a_text.jsonl", [{"text": "hello"}])
    write_jsonl(tmp_path / "b_text.jsonl", [{"text": "bye"}])
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=r"different fields: .*a_text.jsonl, .*b_text.jsonl: \['text'\]; "
                                        r".*chat.jsonl: \['messages'\]"):
        build_data(files_config(tmp_path / "*.jsonl", tmp_path), 10, 1, 0, 64, str(checkpoint))


def test_parquet_files_with_different_columns_are_named(tmp_path, checkpoint):
    import datasets
    datasets.Dataset.from_list([{"text": "hello"}]).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_list([{"messages": CHAT, "id": 1}]).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(DataError, match=r"a.parquet: \['text'\]; .*b.parquet: \['id', 'messages'\]"):
        build_data(files_config(tmp_path / "*.parquet", tmp_path), 10, 1, 0, 64, str(checkpoint))


# --- issue 40: whitespace-only files, chat errors by file and 1-based record, mostly-padding rows ---

def test_a_file_of_blank_lines_is_skipped_like_an_empty_one(tmp_path, checkpoint):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat sat"}])
    (tmp_path / "b.jsonl").write_text("  \n\n\t\n")       # datasets: 'Instruction "train" corresponds to no data'
    stream = build_data(files_config(tmp_path / "*.jsonl", tmp_path), 8, 1, 0, 64, str(checkpoint))
    assert stream.stats.documents == 1


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_chat_error_names_the_file_and_its_1_based_record(tmp_path, checkpoint, kind):
    import datasets
    bad = [CHAT[0], {"role": "wizard", "content": "x"}]
    for name, records in (("a", [{"messages": CHAT}] * 2), ("b", [{"messages": CHAT}, {"messages": bad}])):
        if kind == "jsonl":
            write_jsonl(tmp_path / f"{name}.jsonl", records)
        else:
            datasets.Dataset.from_list(records).to_parquet(str(tmp_path / f"{name}.parquet"))
    with pytest.raises(DataError, match=f"^{tmp_path / f'b.{kind}'} record 2, message 2: unknown role 'wizard'"):
        build_data(files_config(tmp_path / f"*.{kind}", tmp_path), 64, 1, 0, 64, str(checkpoint))


def test_rows_mostly_padding_are_warned_about_with_the_numbers(tmp_path, checkpoint, caplog):
    path = write_jsonl(tmp_path / "short.jsonl", [{"text": "the cat sat"}])
    caplog.set_level("INFO", logger="data.files")
    build_data(files_config(path, tmp_path), 64, 1, 0, 64, str(checkpoint))
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == ("data: 92.2% of the packed rows is padding (5 tokens fill 1 rows of seq_len=64), so most of "
                       "each step computes nothing: lower seq_len or add data")
    caplog.clear()
    build_data(files_config(path, tmp_path), 8, 1, 0, 64, str(checkpoint))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


# --- issue 47: every bad record named by file and 1-based record, with what is wrong ---

@pytest.mark.parametrize("record,problem", [
    ({"other": "x"}, "has no 'text' (missing or null)"),
    ({"text": None}, "has no 'text' (missing or null)"),
    ({"text": 5}, "'text' is int (5), not a string"),
    ({"text": ["the cat", "sat"]}, "'text' is list (['the cat', 'sat']), not a string"),
])
def test_a_text_record_that_is_not_a_string_is_named_with_its_file_and_record(tmp_path, checkpoint, record, problem):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "the cat"}, record, {"text": "a dog"}])
    with pytest.raises(DataError) as refused:
        build_data(files_config(path, tmp_path), 16, 1, 0, 64, str(checkpoint))
    assert str(refused.value).startswith(f"{path} record 2, {problem}")


def test_text_given_as_lists_is_refused_not_tokenized_as_text_pairs(tmp_path, checkpoint):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": ["the cat", "sat on"]}, {"text": ["a dog", "ran"]}])
    with pytest.raises(DataError, match=f"^{path} record 1, 'text' is list"):
        build_data(files_config(path, tmp_path), 16, 1, 0, 64, str(checkpoint))


ALTERNATING_TEMPLATE = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|{{ message['role'] }}|> {{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def test_a_chat_template_that_refuses_a_record_is_named_with_the_file_record_and_its_message(tmp_path):
    from tests.data_support import save_tokenizer
    save_tokenizer(tmp_path / "tokenizer", chat_template=ALTERNATING_TEMPLATE)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[1:3]}, {"messages": CHAT[1:2] + CHAT[3:4]}])
    with pytest.raises(DataError) as refused:
        build_data(files_config(path, tmp_path), 32, 1, 0, 64, str(tmp_path / "tokenizer"))
    assert str(refused.value) == (f"{path} record 2, the tokenizer's chat template refuses it: Conversation roles "
                                  f"must alternate user/assistant/user/assistant/... (fix the record, or give a "
                                  f"tokenizer whose template takes it)")


def test_a_parquet_file_without_rows_is_skipped_like_an_empty_file_and_named_when_alone(tmp_path, checkpoint):
    import pyarrow
    import pyarrow.parquet
    pyarrow.parquet.write_table(pyarrow.table({"text": pyarrow.array([], pyarrow.string())}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=f"^data.path='{tmp_path / 'a.parquet'}' holds no records"):
        build_data(files_config(tmp_path / "a.parquet", tmp_path), 16, 1, 0, 64, str(checkpoint))
    pyarrow.parquet.write_table(pyarrow.table({"text": ["the cat sat"]}), tmp_path / "b.parquet")
    stream = build_data(files_config(tmp_path / "*.parquet", tmp_path), 16, 1, 0, 64, str(checkpoint))
    assert stream.stats.documents == 1


def test_an_empty_json_array_is_skipped_like_an_empty_file(tmp_path, checkpoint):
    (tmp_path / "a.json").write_text(" [\n ]\n")
    with pytest.raises(DataError, match=f"^data.path='{tmp_path / 'a.json'}' holds no records"):
        build_data(files_config(tmp_path / "a.json", tmp_path), 16, 1, 0, 64, str(checkpoint))
    (tmp_path / "b.json").write_text('[{"text": "the cat sat"}]')
    assert build_data(files_config(tmp_path / "*.json", tmp_path), 16, 1, 0, 64, str(checkpoint)).stats.documents == 1


def test_a_text_file_that_is_not_utf8_is_named_with_the_fix(tmp_path, checkpoint):
    (tmp_path / "good.txt").write_text("the cat sat\n")
    (tmp_path / "latin.txt").write_bytes("the cat sat on the mat\nin the café\n".encode("latin-1"))
    with pytest.raises(DataError) as refused:
        build_data(files_config(tmp_path / "*.txt", tmp_path), 16, 1, 0, 64, str(checkpoint))
    assert str(refused.value) == (
        f"could not read data.path='{tmp_path / '*.txt'}': {tmp_path / 'latin.txt'} is not UTF-8 text (byte 0xe9 "
        f"at offset 33): convert it, e.g. iconv -f latin1 -t utf-8 {tmp_path / 'latin.txt'} > "
        f"{tmp_path / 'latin.utf8.txt'}")


def test_a_chat_record_among_text_records_is_named_as_such(tmp_path, checkpoint):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "the cat"}, {"text": "a dog"}, {"messages": CHAT}])
    with pytest.raises(DataError) as refused:
        build_data(files_config(path, tmp_path), 32, 1, 0, 64, str(checkpoint))
    assert str(refused.value).startswith(f"{path} record 3 is a chat record ('messages') among 2 text records "
                                         f"('text') in data.path='{path}'")


def test_a_chat_template_that_renders_a_record_differently_once_more_follow_names_the_record(tmp_path):
    from tests.data_support import save_tokenizer
    counting = "{{ messages | length }} {% for message in messages %}{{ message['content'] }} {% endfor %}"
    save_tokenizer(tmp_path / "tokenizer", chat_template=counting)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[1:3]}])
    with pytest.raises(DataError, match=f"^{path} record 1, the chat template renders a conversation's first "):
        build_data(files_config(path, tmp_path), 32, 1, 0, 64, str(tmp_path / "tokenizer"))
