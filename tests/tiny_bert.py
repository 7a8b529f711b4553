"""A tiny BERT (hidden 64, no dropout) with MiniLM's tokenizer, saved as a local model: the
production model factory builds LoRA on it in well under a second."""

import torch

from fedpower_app import model as M


def save_tiny_bert(path, num_layers: int) -> str:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=2,
                        intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        max_position_embeddings=64)
    torch.manual_seed(0)
    BertForSequenceClassification(config).bert.save_pretrained(str(path))  # no head: fedpower seeds it
    M.load_tokenizer("minilm").save_pretrained(str(path))
    return str(path)
