"""Our Llama-3/3.1 implementation; parameter names equal transformers' LlamaForCausalLM."""
from model.checkpoint import CheckpointError
from model.config import LlamaConfig
from model.llama import Llama, unwrap_llama

__all__ = ["Llama", "LlamaConfig", "CheckpointError", "unwrap_llama"]
