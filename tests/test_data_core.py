"""The pure data core: packing and masking of documents into batches, and chat masks (no files, no
`datasets`)."""
import numpy as np
import pytest
import torch

from data import IGNORE_INDEX, DataError
from data.packing import assemble_batch, pack_rows, plan_pieces, shifted_labels
from data.tokenize import tokenize_chat, tokenize_texts
from model import CausalLM
from tests.data_support import CHAT, TEXTS, TINY_ARCH, checkpoint, save_tokenizer, tokenizer, tokens  # noqa: F401


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
    model = CausalLM.from_config(TINY_ARCH).eval()
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
    with pytest.raises(DataError, match="^record 8, message 2: unknown role 'wizard'"):
        tokenize_chat([CHAT[0], {"role": "wizard", "content": "x"}], tokenizer, "assistant", 2, 3, record=7)
