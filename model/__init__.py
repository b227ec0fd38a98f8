"""Our Llama-3/3.1 implementation; parameter names equal transformers' LlamaForCausalLM."""
from model.config import LlamaConfig
from model.hf_checkpoint import HFCheckpointError, unwrap_llama
from model.llama import Llama

__all__ = ["Llama", "LlamaConfig", "HFCheckpointError", "unwrap_llama"]
