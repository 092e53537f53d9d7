"""The default model's corpus, tokenizer, MTP module and model card (used by
``scripts/train_default_model.py``)."""
