"""Records to documents: token ids plus, per token, whether it is a training target.

Pure functions of a record and a Hugging Face tokenizer (no `datasets`), so the exact masks are testable
on single records.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from conf.schema.data import LOSS_ON
from data.packing import Document

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Any of these marks a directory as holding a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Every file of a saved tokenizer starts with one of these (save_pretrained's names).
TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens", "chat_template", "added_tokens")
# Used when the tokenizer has no chat template: "<|role|>\n" + content + EOS per message, and
# "<|assistant|>\n" as the generation prompt, so a reply (content + EOS) is exactly the supervised part.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class DataError(ValueError):
    """Data that cannot be trained on; the message names the file or setting and the fix."""


class RecordError(DataError):
    """A record that cannot be tokenized, by its 0-based index in the dataset; the files source names its file
    and 1-based record in that file (data.files). Its args are its fields, so it pickles from a worker."""

    def __init__(self, record: int, problem: str):
        super().__init__(record, problem)
        self.record, self.problem = record, problem

    def __str__(self) -> str:
        return f"record {self.record + 1}, {self.problem}"


def check_tokenizer_files(path: str) -> None:
    directory = Path(path).expanduser()
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise DataError(f"model.path={path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the "
                        f"checkpoint's tokenizer files into it (AutoTokenizer.save_pretrained)")


def tokenizer_files(directory: Path) -> list[Path]:
    """The files of the tokenizer saved in `directory` (a model directory), sorted by name."""
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.startswith(TOKENIZER_FILE_PREFIXES))


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, from local files only."""
    from transformers import AutoTokenizer
    check_tokenizer_files(path)
    return AutoTokenizer.from_pretrained(str(Path(path).expanduser()), local_files_only=True)


def check_vocabulary(tokenizer, vocab_size: int, path: str, setting: str = "model.path") -> None:
    """DataError when the tokenizer at `path` (named by `setting`) has ids past the model's embedding."""
    if len(tokenizer) > vocab_size:
        raise DataError(f"the tokenizer in {setting}={path!r} has {len(tokenizer)} tokens but the model's "
                        f"vocab_size is {vocab_size}: token ids past the embedding would crash; use a checkpoint "
                        f"whose vocab_size covers its tokenizer")


def with_bos_eos(ids: list[int], is_target: list[bool], bos_id: int | None, eos_id: int | None) -> Document:
    """Add BOS/EOS where given and absent. An added EOS is a target when the token before it is (the end
    of a trained reply), so the model learns to stop. Empty documents stay empty."""
    if not ids:
        return [], []
    if bos_id is not None and ids[0] != bos_id:
        ids, is_target = [bos_id] + ids, [False] + is_target
    if eos_id is not None and ids[-1] != eos_id:
        ids, is_target = ids + [eos_id], is_target + [is_target[-1]]
    return ids, is_target


def tokenize_texts(texts: list[str], tokenizer, bos_id: int | None, eos_id: int | None) -> list[Document]:
    """Plain-text documents: every token is a target."""
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [with_bos_eos(ids, [True] * len(ids), bos_id, eos_id) for ids in encoded]


def check_text(text, field: str, record: int) -> None:
    """RecordError unless the `record`-th (0-based) record's `field` is a string: the tokenizer would fail on
    None or a number without naming the record, and read a list as a text pair."""
    if text is None:
        raise RecordError(record, f"has no {field!r} (missing or null): give every record its text, or remove it")
    if not isinstance(text, str):
        shown = repr(text) if len(repr(text)) <= 60 else repr(text)[:57] + "..."
        raise RecordError(record, f"{field!r} is {type(text).__name__} ({shown}), not a string: give the text as "
                                  f"one string")


def check_messages(messages, record: int) -> None:
    """RecordError for the `record`-th (0-based) record's messages, naming the message 1-based."""
    if not isinstance(messages, list) or not messages:
        raise RecordError(record, f"messages must be a non-empty list of {{role, content}}, got {messages!r}")
    for turn, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
            raise RecordError(record, f"message {turn}: expected {{'role', 'content'}}, got {message!r}")
        if message["role"] not in CHAT_ROLES:
            raise RecordError(record, f"message {turn}: unknown role {message['role']!r}; known roles: "
                                      f"{', '.join(CHAT_ROLES)} (rename it in the data)")


def suffix_after(prefix: str, text: str) -> str:
    if not text.startswith(prefix):
        raise DataError("the chat template renders a conversation's first messages differently once more "
                        "follow, so assistant tokens cannot be located: use data.loss_on=all or a tokenizer "
                        "whose chat template only appends per message")
    return text[len(prefix):]


Render = Callable[[list[dict], bool], str]   # (messages, add_generation_prompt) -> text


def chat_segments(messages: list[dict], render: Render) -> list[tuple[str, int | None]]:
    """The rendered conversation cut into consecutive pieces of text, each tagged with the index of the
    assistant message whose reply it is (None for prompts, headers and other roles).

    A reply is what rendering the message adds after the generation prompt for it, so role headers are
    never trained on; this needs a template whose output for a prefix of the messages is a prefix of the
    output for all of them (true of Llama-3's and the fallback).
    """
    segments: list[tuple[str, int | None]] = []
    rendered = ""
    for index, message in enumerate(messages):
        reply = message["role"] == "assistant"
        if reply and index:
            prompt = render(messages[:index], True)
            segments.append((suffix_after(rendered, prompt), None))
            rendered = prompt
        full = render(messages[:index + 1], False)
        segments.append((suffix_after(rendered, full), index if reply else None))
        rendered = full
    return segments


def chat_renderer(tokenizer) -> Render:
    template = tokenizer.chat_template or FALLBACK_CHAT_TEMPLATE
    return lambda messages, prompt: tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=prompt)


def trained_replies(messages: list[dict], loss_on: str) -> set[int] | None:
    """Indices of the assistant messages trained on; None means every token."""
    if loss_on not in LOSS_ON:
        raise DataError(f"data.loss_on={loss_on!r} is not one of {LOSS_ON}")
    if loss_on == "all":
        return None
    replies = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    return set(replies[-1:] if loss_on == "last_turn" else replies)


def tokenize_chat(messages: list[dict], tokenizer, loss_on: str, bos_id: int | None, eos_id: int | None,
                  record: int = 0) -> Document:
    """A conversation rendered with the tokenizer's chat template (or FALLBACK_CHAT_TEMPLATE), targets
    set by `loss_on`: all tokens, every assistant reply, or the last one."""
    from jinja2 import TemplateError
    check_messages(messages, record)
    render = chat_renderer(tokenizer)
    trained = trained_replies(messages, loss_on)
    try:
        # Training on everything needs no reply boundaries, so any template works for loss_on=all.
        segments = [(render(messages, False), None)] if trained is None else chat_segments(messages, render)
    except TemplateError as error:      # raise_exception in templates that enforce an order of roles
        raise RecordError(record, f"the tokenizer's chat template refuses it: {error} (fix the record, or give a "
                                  f"tokenizer whose template takes it)") from None
    except DataError as error:          # suffix_after: replies cannot be located in this record's rendering
        raise RecordError(record, str(error)) from None
    encoded = tokenizer([text for text, _ in segments], add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    is_target: list[bool] = []
    for (_, reply), segment_ids in zip(segments, encoded):
        ids += segment_ids
        is_target += [trained is None or reply in trained] * len(segment_ids)
    return with_bos_eos(ids, is_target, bos_id, eos_id)
