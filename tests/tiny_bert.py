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


#: Architectures other than BERT that tests build tiny (random weights, saved locally).
TINY_ARCHITECTURES = ("roberta", "distilbert", "electra", "deberta-v2")


def save_tiny_encoder(path, kind: str, num_layers: int = 2) -> str:
    """A tiny encoder of architecture ``kind`` (hidden 64, no dropout, random weights) with MiniLM's
    WordPiece tokenizer; architectures without token types get a tokenizer that sends none."""
    import transformers as T
    from transformers import AutoTokenizer

    common = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=2,
                  intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  max_position_embeddings=66)
    if kind == "roberta":
        model = T.RobertaModel(T.RobertaConfig(**common, type_vocab_size=1, pad_token_id=0), add_pooling_layer=False)
    elif kind == "distilbert":
        model = T.DistilBertModel(T.DistilBertConfig(vocab_size=30522, dim=64, n_layers=num_layers, n_heads=2,
                                                     hidden_dim=128, dropout=0.0, attention_dropout=0.0,
                                                     max_position_embeddings=64, pad_token_id=0))
    elif kind == "electra":
        model = T.ElectraModel(T.ElectraConfig(**common, embedding_size=64))
    elif kind == "deberta-v2":
        model = T.DebertaV2Model(T.DebertaV2Config(**common, relative_attention=True, position_buckets=16,
                                                   max_relative_positions=32, pos_att_type=["p2c", "c2p"],
                                                   type_vocab_size=0))
    else:
        raise ValueError(f"no tiny {kind!r}; known: {', '.join(TINY_ARCHITECTURES)}")
    torch.manual_seed(0)
    model.save_pretrained(str(path))
    names = {} if kind == "electra" else {"model_input_names": ["input_ids", "attention_mask"]}
    AutoTokenizer.from_pretrained(M.resolve_model_path("minilm"), **names).save_pretrained(str(path))
    return str(path)
