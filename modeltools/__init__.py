"""The offline model tools: write GGUF files (convert from Hugging Face checkpoints, synth
random models of the real or a tiny shape, the GGUF writer), prune experts (REAP saliency),
and judge a model (perplexity). Commands use them; no serving process imports them."""
