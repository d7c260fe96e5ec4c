"""Parity with other implementations: transformers GptOss export/import and logit comparison."""
