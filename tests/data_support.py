"""Shared by the data tests: a WordLevel tokenizer trained here on a few sentences, a tiny random CausalLM
checkpoint (both written to a temporary directory in Hugging Face format), and small record files."""
import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from conf.schema import DataConfig
from data import IGNORE_INDEX
from model import CausalLM

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "hello friend see you bye",
             "be brief hi there", "<|system|> <|user|> <|assistant|> [assistant] [user]"]
TINY_ARCH = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0)
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello friend"}, {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"}]


def save_tokenizer(directory: Path, chat_template: str | None = None, words: list[str] | None = None):
    """A word-level tokenizer of SENTENCES' words (or of `words`) and four special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.train_from_iterator(words or SENTENCES, trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<pad>", "<s>", "</s>"]))
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
    model = CausalLM.from_config(TINY_ARCH)
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
TEXTS = ["the cat sat on the mat the", "a dog ran in the park", "hello", "be brief hi", "", "cat cat",
         "dog dog dog dog", "the cat sat on the mat a dog"]


@pytest.fixture
def text_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "docs.jsonl", [{"text": text} for text in TEXTS])
