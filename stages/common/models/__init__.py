"""Models and tokenizers: the tiny random-init Llama factory and the one way to load a Hugging Face folder."""
