"""Our Llama against transformers' LlamaForCausalLM: same checkpoint, same loss, same gradients (fp32)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from model import CausalLM

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
SHAPES = [
    # (hidden, heads, kv_heads, layers, intermediate, vocab, rope_scaling, tied)
    (64, 4, 4, 2, 96, 101, None, False),            # multi-head, odd vocabulary
    (64, 8, 2, 2, 160, 128, LLAMA3_SCALING, False),  # GQA 4:1 with Llama-3.1 RoPE scaling
    (96, 6, 1, 3, 200, 77, LLAMA3_SCALING, True),    # multi-query, tied embeddings
]


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).detach().norm() / ref.detach().norm())


def save_hf_model(tmp_path, hidden, heads, kv_heads, layers, intermediate, vocab, rope_scaling, tied):
    config = HFLlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           num_hidden_layers=layers, intermediate_size=intermediate, vocab_size=vocab,
                           rope_scaling=rope_scaling, max_position_embeddings=256, tie_word_embeddings=tied,
                           rms_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).float()
    with torch.no_grad():   # non-trivial norm weights, so a wrong norm cannot pass
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("shape", SHAPES, ids=["mha", "gqa-llama3-rope", "mqa-tied"])
def test_loss_and_gradients_match_transformers(tmp_path, shape):
    hf = save_hf_model(tmp_path, *shape)
    ours = CausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    vocab = shape[5]
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (2, 45), generator=generator)
    labels = torch.randint(0, vocab, (2, 45), generator=generator)
    labels[0, :7] = -100

    ref_loss = F.cross_entropy(hf(input_ids).logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=-100)
    ref_loss.backward()
    loss = ours.loss(ours(input_ids), labels)
    loss.backward()

    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    ref_params = dict(hf.named_parameters())
    our_params = dict(ours.named_parameters())
    assert our_params.keys() == ref_params.keys()
    for name, param in our_params.items():
        assert relative_error(param.grad, ref_params[name].grad) < 1e-5, name


def test_packed_documents_match_separate_documents():
    """Positions restart per document and no token sees another document: a pack equals its parts."""
    torch.manual_seed(0)
    model = CausalLM.from_config(dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2))
    lengths = [5, 1, 11]
    docs = [torch.randint(0, 50, (1, n)) for n in lengths]
    cu_seqlens = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    packed = model(torch.cat(docs, dim=1), cu_seqlens=cu_seqlens)
    separate = torch.cat([model(doc) for doc in docs], dim=1)
    assert relative_error(packed, separate) < 1e-6
