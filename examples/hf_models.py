"""Real model code: Hugging Face transformers' GPT-2 (language-model head) and BERT, two layers of
width 64, built from a config with random weights (nothing is downloaded), run on token ids.
transformers is optional: without it both cases are listed by skipped() with a one-line reason.
"""
import torch

try:
    import transformers
except Exception as e:  # ImportError, or a transformers release that does not fit this torch
    transformers, _MISSING = None, f"transformers does not import ({type(e).__name__}: {e})"
else:
    _MISSING = None

VOCAB, POSITIONS = 1000, 64


def gpt2(**config):
    """config: more GPT2Config fields (reorder_and_upcast_attn=True with attn_implementation="eager":
    attention scores in float32 inside a `with torch.autocast(..., enabled=False)` block of
    transformers' own)."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=POSITIONS,
                                  bos_token_id=0, eos_token_id=0, use_cache=False, **config)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                  intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=POSITIONS)
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


def skipped():
    """(name, why) for cases this machine cannot run."""
    return [("gpt2_tiny", _MISSING), ("bert_tiny", _MISSING)] if _MISSING else []


def cases():
    if transformers is None:
        return []
    torch.manual_seed(1)  # no explicit Generator: the tests also run with a CUDA default device
    ids = torch.randint(0, VOCAB, (2, 16))
    ids2 = torch.randint(0, VOCAB, (2, 16))
    return [
        ("gpt2_tiny", gpt2(), [(ids,), (ids2,)]),
        ("bert_tiny", bert(), [(ids,), (ids2,)]),
    ]
