"""Our Llama-3/3.1 implementation; parameter names equal transformers' LlamaForCausalLM."""
from model.config import DecoderConfig
from model.hf_checkpoint import HFCheckpointError, unwrap_model
from model.decoder import CausalLM

__all__ = ["CausalLM", "DecoderConfig", "HFCheckpointError", "unwrap_model"]
