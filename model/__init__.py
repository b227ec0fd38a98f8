"""Our decoder for every model family (model/families/); parameter names equal transformers' classes."""
from model.config import DecoderConfig
from model.hf_checkpoint import HFCheckpointError, unwrap_model
from model.decoder import CausalLM

__all__ = ["CausalLM", "DecoderConfig", "HFCheckpointError", "unwrap_model"]
