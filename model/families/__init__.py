"""The built-in model families: one module each, registered here (model/family.py says what a family is)."""
from model.families.llama import LLAMA
from model.families.mistral import MISTRAL
from model.families.qwen2 import QWEN2
from model.families.qwen3 import QWEN3
from model.family import register_family

for _family in (LLAMA, QWEN2, QWEN3, MISTRAL):
    register_family(_family)
