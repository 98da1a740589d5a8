"""The embedded inference engine: local models, tokenizers and generation."""
